"""The manager's own byte counters: on CPU glibc's heap or the resident pages, on GPU CUDA's.

On CPU they count every allocation of the process, not only tensors (NOTE [CPU counter]).

NOTE [readings hold the GIL]
The counters are read through ``ctypes.PyDLL``, which keeps the GIL during the call: taking it
back after ``ctypes.CDLL`` gave it up can wait a whole switch interval (5 ms) per reading while
another thread runs Python. The calls block on nothing but the allocator's own locks.
"""

import ctypes
import gc
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from vtensor.errors import VTensorError

logger = logging.getLogger(__name__)

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


@runtime_checkable
class DeviceTracker(Protocol):
    """Anything that reports the bytes currently allocated on one device."""

    counts_released_pages: bool
    """Whether pages released in place (NOTE [release in place]) leave the count by themselves."""

    def current_bytes(self) -> int:
        """Returns the bytes currently allocated on the device."""
        ...

    def pool_bytes(self) -> int:
        """Process memory that no step owns, left out of :meth:`current_bytes`."""
        ...

    def settle(self) -> None:
        """Make the next reading exact before a step's entry reading (a no-op where it is)."""
        ...


# Field order of glibc's `struct mallinfo2` (malloc.h, glibc >= 2.33); every field is a size_t.
_MALLINFO2_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS.split()]


def _no_pool() -> int:
    return 0


def _mkl_pool_reader() -> Callable[[], int]:
    """Bytes held by MKL's memory manager now (NOTE [MKL buffer pool]); always 0 without MKL."""
    # NOTE [MKL buffer pool]: MKL's GEMM mallocs packing buffers in the first GEMM that needs
    # them and keeps them for the process's life; counted, a first iteration would see them as a
    # step's growth. So they are left out and reported apart (``pool_bytes``).
    torch_cpu = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"  # MKL linked statically
    for library in (None, str(torch_cpu)):
        try:
            handle = ctypes.PyDLL(library)  # NOTE [readings hold the GIL]
        except OSError:  # no such file
            continue
        for name in ("mkl_serv_mem_stat", "MKL_Mem_Stat", "mkl_mem_stat"):
            mem_stat = getattr(handle, name, None)
            if mem_stat is None:
                continue
            mem_stat.restype = ctypes.c_int64
            mem_stat.argtypes = [ctypes.POINTER(ctypes.c_int)]

            def read(mem_stat: Callable[..., int] = mem_stat) -> int:
                buffers = ctypes.c_int(0)
                return max(0, int(mem_stat(ctypes.byref(buffers))))

            return read
    return _no_pool


class MallocTracker:
    """Live heap bytes of this process from glibc ``mallinfo2()``, less MKL's buffer pool."""

    counts_released_pages = False  # a released page is still allocated for the heap

    def __init__(self) -> None:
        try:
            mallinfo2 = ctypes.PyDLL(None).mallinfo2  # NOTE [readings hold the GIL]
        except (AttributeError, OSError) as exc:
            raise VTensorError(
                "MallocTracker needs glibc's mallinfo2() (glibc >= 2.33), which this process does "
                "not provide. On another C library, measure with LiveStorageTracker or "
                "vtensor.measure.rss.RssMeter."
            ) from exc
        mallinfo2.restype = _MallInfo2
        mallinfo2.argtypes = []
        self._mallinfo2: Callable[[], _MallInfo2] = mallinfo2
        self._mkl_pool = _mkl_pool_reader()

    def current_bytes(self) -> int:
        """Returns the bytes in heap chunks plus mmapped blocks, less MKL's pool."""
        info = self._mallinfo2()
        return int(info.uordblks + info.hblkhd) - self._mkl_pool()

    def pool_bytes(self) -> int:
        """Bytes of MKL's buffer pool, left out of :meth:`current_bytes` (0 without MKL)."""
        return self._mkl_pool()

    def settle(self) -> None:
        """Nothing to do: the heap counter reads live bytes."""


class ResidentTracker:
    """Anonymous resident bytes of this process, less MKL's buffer pool (NOTE [CPU counter]).

    ``/proc/self/statm``'s resident less shared pages; honest only where the allocator hands
    freed memory back at once, which ``cpu_counter`` checks first.
    """

    counts_released_pages = True  # a page released in place leaves the resident set at once

    def __init__(self, collect: Callable[[], None] | None = None) -> None:
        """``collect``: makes the allocator hand back the freed memory it keeps (``settle``)."""
        self._pid = -1
        self._fd = -1
        self._open()
        self._mkl_pool = _mkl_pool_reader()
        self._collect = collect

    def _open(self) -> None:
        # /proc/self is resolved when opened: a forked child must open its own.
        try:
            fd = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise VTensorError(
                f"ResidentTracker reads /proc/self/statm, which this system lacks ({exc})"
            ) from exc
        if self._fd >= 0:
            os.close(self._fd)
        self._pid, self._fd = os.getpid(), fd

    def current_bytes(self) -> int:
        """Returns the anonymous resident bytes less MKL's pool."""
        if self._pid != os.getpid():
            self._open()
        fields = os.pread(self._fd, 256, 0).split()
        return (int(fields[1]) - int(fields[2])) * _PAGE_BYTES - self._mkl_pool()

    def pool_bytes(self) -> int:
        """Bytes of MKL's buffer pool, left out of :meth:`current_bytes` (0 without MKL)."""
        return self._mkl_pool()

    def settle(self) -> None:
        """Have the allocator hand back the freed pages a step could grow into unseen."""
        if self._collect is not None:
            self._collect()

    def __del__(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)


class CudaTracker:
    """Bytes held by tensors on one CUDA device (not reserved segments), from the allocator."""

    counts_released_pages = False  # device memory is never released in place

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
        """``torch.cuda.memory_allocated``, without its flattening of every statistic per call."""
        return _allocated(self.device, "current")

    def pool_bytes(self) -> int:
        """Nothing is left out of the allocator's count of tensor bytes."""
        return 0

    def settle(self) -> None:
        """Nothing to do: the allocator counts tensor bytes."""

    def peak_bytes(self) -> int:
        """Returns the most bytes allocated to tensors on the device since the last reset."""
        return _allocated(self.device, "peak")

    def reset_peak(self) -> None:
        """Starts a new peak window at the current allocation (resets all the device's peaks)."""
        torch.cuda.reset_peak_memory_stats(self.device)


def _allocated(device: torch.device, which: str) -> int:
    """``allocated_bytes.all.<which>`` of ``torch.cuda.memory_stats``, without the flattening."""
    stats = torch.cuda.memory.memory_stats_as_nested_dict(device)
    return int(stats.get("allocated_bytes", {}).get("all", {}).get(which, 0))


@contextmanager
def quiet_heap() -> Iterator[None]:
    """Hold the cycle collector for the block (NOTE [quiet heap])."""
    # NOTE [quiet heap]: the CPU counter is process-wide, so other code's garbage collected
    # mid-step would look like the step freeing memory; a collection per step would be costly.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
