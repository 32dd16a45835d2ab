"""vtensor: train PyTorch models under a hard memory budget by swapping chunks of activations."""

from vtensor.budget import format_bytes, parse_bytes
from vtensor.chunk import DEFAULT_CHUNK_BYTES, ChunkState
from vtensor.errors import (
    BudgetFormatError,
    IllegalMoveError,
    InfeasibleBudgetError,
    InPlaceModificationError,
    StorageTierError,
    VTensorError,
)
from vtensor.report import IterationReport, StepStats
from vtensor.session import Granularity, MemoryManager
from vtensor.trace import Phase, Trace, TraceStep, TraceTensor

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "BudgetFormatError",
    "ChunkState",
    "Granularity",
    "IllegalMoveError",
    "InPlaceModificationError",
    "InfeasibleBudgetError",
    "IterationReport",
    "MemoryManager",
    "Phase",
    "StepStats",
    "StorageTierError",
    "Trace",
    "TraceStep",
    "TraceTensor",
    "VTensorError",
    "format_bytes",
    "parse_bytes",
]
