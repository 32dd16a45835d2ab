"""vtensor: train PyTorch models under a hard memory budget by swapping chunks of activations."""

from vtensor.activations.manager import MemoryManager
from vtensor.activations.report import (
    Granularity,
    IterationReport,
    PlanSource,
    Policy,
    StepStats,
)
from vtensor.budget import BudgetKind, BudgetSpec, device_budget, parse_budget, share_of_peak
from vtensor.errors import (
    BudgetFormatError,
    IllegalMoveError,
    InfeasibleBudgetError,
    InPlaceModificationError,
    LayeringError,
    ParamOffloadError,
    StorageTierError,
    SwapAuthenticationError,
    UnmeasurableMemoryError,
    VTensorError,
    WeightFileChecksumError,
    WeightFileError,
    WeightFileFormatError,
    WeightFileMismatchError,
    WeightFileTruncatedError,
    WeightFileVersionError,
)
from vtensor.io.chunk import DEFAULT_CHUNK_BYTES, ChunkState
from vtensor.io.engines import Tier
from vtensor.layering.demand import DemandLayering, LayeringReport
from vtensor.layering.weightfile import WeightFile, evict_page_cache, write_weights
from vtensor.measure.independent import PeakSource
from vtensor.offload.param_offload import ParamOffload
from vtensor.offload.report import ParamOffloadReport
from vtensor.planner.trace import Phase, Trace, TraceStep, TraceTensor
from vtensor.sizes import format_bytes, parse_bytes

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "BudgetFormatError",
    "BudgetKind",
    "BudgetSpec",
    "ChunkState",
    "DemandLayering",
    "Granularity",
    "IllegalMoveError",
    "InPlaceModificationError",
    "InfeasibleBudgetError",
    "IterationReport",
    "LayeringError",
    "LayeringReport",
    "MemoryManager",
    "ParamOffload",
    "ParamOffloadError",
    "ParamOffloadReport",
    "PeakSource",
    "Phase",
    "PlanSource",
    "Policy",
    "StepStats",
    "StorageTierError",
    "SwapAuthenticationError",
    "Tier",
    "Trace",
    "TraceStep",
    "TraceTensor",
    "UnmeasurableMemoryError",
    "VTensorError",
    "WeightFile",
    "WeightFileChecksumError",
    "WeightFileError",
    "WeightFileFormatError",
    "WeightFileMismatchError",
    "WeightFileTruncatedError",
    "WeightFileVersionError",
    "device_budget",
    "evict_page_cache",
    "format_bytes",
    "parse_budget",
    "parse_bytes",
    "share_of_peak",
    "write_weights",
]
