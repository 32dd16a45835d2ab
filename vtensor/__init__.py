"""vtensor: train PyTorch models under a hard memory budget by swapping chunks of activations."""

from vtensor.budget import format_bytes, parse_bytes
from vtensor.chunk import DEFAULT_CHUNK_BYTES, ChunkState
from vtensor.errors import (
    BudgetFormatError,
    IllegalMoveError,
    InfeasibleBudgetError,
    InPlaceModificationError,
    StorageTierError,
    SwapAuthenticationError,
    VTensorError,
)
from vtensor.layering import DemandLayering, LayeringError, LayeringReport
from vtensor.param_report import ParamOffloadReport
from vtensor.param_units import ParamOffloadError
from vtensor.params import ParamOffload
from vtensor.report import IterationReport, StepStats
from vtensor.session import Granularity, MemoryManager
from vtensor.trace import Phase, Trace, TraceStep, TraceTensor
from vtensor.weightfile import (
    WeightFile,
    WeightFileChecksumError,
    WeightFileError,
    WeightFileFormatError,
    WeightFileMismatchError,
    WeightFileTruncatedError,
    WeightFileVersionError,
    evict_page_cache,
    write_weights,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "BudgetFormatError",
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
    "Phase",
    "StepStats",
    "StorageTierError",
    "SwapAuthenticationError",
    "Trace",
    "TraceStep",
    "TraceTensor",
    "VTensorError",
    "WeightFile",
    "WeightFileChecksumError",
    "WeightFileError",
    "WeightFileFormatError",
    "WeightFileMismatchError",
    "WeightFileTruncatedError",
    "WeightFileVersionError",
    "evict_page_cache",
    "format_bytes",
    "parse_bytes",
    "write_weights",
]
