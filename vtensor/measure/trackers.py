"""The manager's own byte counters: glibc's heap counter on CPU, the CUDA allocator's on GPU.

They are cheap enough to read on every chunk move (``mallinfo2()``: in-use heap chunks plus
mmapped blocks, ~0.3-0.4 us per call) and count every malloc user, not only tensors. The
independent checks are ``measure/dispatch.py`` (live storages, for tests and profiling) and
``measure/rss.py`` (what the operating system charges the process).
"""

import ctypes
import gc
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

import torch

from vtensor.errors import VTensorError

logger = logging.getLogger(__name__)


@runtime_checkable
class DeviceTracker(Protocol):
    """Anything that reports the bytes currently allocated on one device."""

    def current_bytes(self) -> int:
        """Returns the bytes currently allocated on the device."""
        ...


class _MallInfo2(ctypes.Structure):
    # Field order of glibc's `struct mallinfo2` (malloc.h, glibc >= 2.33); every field is a size_t.
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


class MallocTracker:
    """Live heap bytes of this process from glibc ``mallinfo2()`` (in-use chunks + mmapped blocks).

    Counts every malloc user, not only tensors; use differences between two calls. Meaningless if
    another allocator (jemalloc, tcmalloc) was preloaded, since glibc's heap is then unused.
    """

    def __init__(self) -> None:
        try:
            mallinfo2 = ctypes.CDLL(None).mallinfo2
        except (AttributeError, OSError) as exc:
            raise VTensorError(
                "MallocTracker needs glibc's mallinfo2() (glibc >= 2.33), which this process does "
                "not provide. On another C library, measure with LiveStorageTracker or "
                "vtensor.measure.rss.RssMeter."
            ) from exc
        mallinfo2.restype = _MallInfo2
        mallinfo2.argtypes = []
        self._mallinfo2: Callable[[], _MallInfo2] = mallinfo2

    def current_bytes(self) -> int:
        """Returns the bytes in allocated heap chunks plus mmapped blocks, over all arenas."""
        info = self._mallinfo2()
        return int(info.uordblks + info.hblkhd)


class CudaTracker:
    """Bytes held by tensors on one CUDA device, from the caching allocator's own statistics.

    Counts tensor bytes (rounded up to the allocator's 512 B blocks), not reserved segments.
    """

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise VTensorError(f"CudaTracker needs a cuda device, got {device}; use MallocTracker.")
        if not torch.cuda.is_available():
            raise VTensorError(
                f"CudaTracker for {device}: CUDA is not available in this process (CPU-only torch "
                "build or no visible GPU). Use a cpu device."
            )
        # Pin the index now: a bare "cuda" would follow whatever device is current at call time.
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)

    def current_bytes(self) -> int:
        """Returns the bytes currently allocated to tensors on the device."""
        return torch.cuda.memory_allocated(self.device)

    def peak_bytes(self) -> int:
        """Returns the most bytes allocated to tensors on the device since the last reset."""
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        """Starts a new peak window at the current allocation (resets all the device's peaks)."""
        torch.cuda.reset_peak_memory_stats(self.device)


def make_device_tracker(device: torch.device) -> DeviceTracker:
    """Returns the cheap allocation counter for ``device``.

    Raises:
        VTensorError: the device type has no tracker, or its backend is unavailable.
    """
    if device.type == "cpu":
        return MallocTracker()
    if device.type == "cuda":
        return CudaTracker(device)
    raise VTensorError(f"no device tracker for {device}: use a cpu or cuda device.")


@contextmanager
def quiet_heap() -> Iterator[None]:
    """Hold the cycle collector for the block (NOTE [quiet heap])."""
    # NOTE [quiet heap]: on CPU the tracker reads the process-wide heap counter, so garbage of
    # earlier code freed by the cycle collector mid-step would look like the step freeing
    # memory. Hold the collector until the step ends (a full collection here would cost
    # ~0.15 s per step in a process that has imported torch).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
