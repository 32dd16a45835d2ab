"""Which counter measures a device's bytes: on CPU, glibc's heap or the resident pages.

NOTE [CPU counter]
The CPU counter is read many times per iteration: it must be cheap and never read less than the
tensors alive. glibc's heap counter (``mallinfo2``) is exact but blind when torch allocates
through another allocator; the anonymous resident pages (``/proc/self/statm``) work under any
allocator and see pages released in place, but follow live bytes only where freed memory goes
back at once; counting storages through torch (``measure/dispatch.py``) costs every op.

So the heap counter is used where a torch allocation moves it; elsewhere the resident pages,
once a probe shows allocations raise them and frees lower them at once, with the allocator's
kept pages handed back before each step (``allocator_calls.py``). Where neither holds the manager
refuses to start (``UnmeasurableMemoryError``), naming the allocator's option that returns memory
at once: a budget it cannot measure is one it cannot keep.
"""

import contextlib
import ctypes
import functools
import logging
import platform
from enum import StrEnum
from pathlib import Path

import torch

from vtensor.errors import UnmeasurableMemoryError, VTensorError
from vtensor.measure.allocator_calls import allocator_collect, purge_at_once
from vtensor.measure.trackers import CudaTracker, DeviceTracker, MallocTracker, ResidentTracker

logger = logging.getLogger(__name__)

MIB = 1 << 20
# Pieces of the sizes a step's tensors have: large blocks and many small ones, 16 MiB in all.
PROBE_PIECES_BYTES = (4 * MIB,) * 3 + (64 * 1024,) * 64
PROBE_BYTES = sum(PROBE_PIECES_BYTES)
# A probe passes when the counter moves by at least this share of the bytes allocated or freed.
PROBE_SHARE = 0.9
PROBE_TRIES = 3


class CpuCounter(StrEnum):
    """The counter a CPU tracker reads (NOTE [CPU counter])."""

    HEAP = "glibc-heap"  # glibc's mallinfo2: live heap bytes
    RESIDENT = "resident"  # /proc/self/statm: anonymous resident bytes


# The option of each allocator that hands freed memory back to the kernel at once.
_RETURN_AT_ONCE = {
    "jemalloc": "MALLOC_CONF=dirty_decay_ms:0,muzzy_decay_ms:0",
    "mimalloc": "MIMALLOC_PURGE_DELAY=0",
    "mimalloc 2.0": "MIMALLOC_RESET_DELAY=0",
    "tcmalloc": "TCMALLOC_AGGRESSIVE_DECOMMIT=t",
}


def allocator_name() -> str:
    """The allocator that serves malloc in this process, as far as it can be told."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    for name in ("jemalloc", "tcmalloc", "mimalloc"):
        if f"lib{name}" in maps:
            if name == "mimalloc" and _mimalloc_version() < 210:
                return "mimalloc 2.0"
            return name
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "mimalloc"  # PyTorch's aarch64 builds link it into libc10 as the CPU allocator
    return "an allocator other than glibc's malloc"


def _mimalloc_version() -> int:
    try:
        version = ctypes.CDLL(None).mi_version
    except (AttributeError, OSError):
        return 1_000
    version.restype = ctypes.c_int
    return int(version())


def _moves(tracker: DeviceTracker, *, freed_too: bool) -> bool:
    """Whether allocating the probe raises the reading and, with ``freed_too``, freeing lowers it.

    At once, without ``settle``: inside a step nothing settles.
    """
    read = tracker.current_bytes
    for _ in range(PROBE_TRIES):
        tracker.settle()
        before = read()
        pieces = [torch.ones(n // 4) for n in PROBE_PIECES_BYTES]  # written: pages are touched
        grown = read() - before
        del pieces
        left = read() - before
        if grown >= PROBE_SHARE * PROBE_BYTES and (
            not freed_too or left <= (1 - PROBE_SHARE) * PROBE_BYTES
        ):
            return True
    return False


@functools.cache
def cpu_counter() -> CpuCounter:
    """The counter that sees torch's CPU tensors in this process, probed once (NOTE [CPU counter]).

    Raises:
        UnmeasurableMemoryError: neither counter follows torch's allocations and frees.
    """
    with contextlib.suppress(VTensorError):  # no mallinfo2()
        if _moves(MallocTracker(), freed_too=False):
            return CpuCounter.HEAP
    purge_at_once()  # the mimalloc inside PyTorch's aarch64 libc10, which users do not choose
    with contextlib.suppress(VTensorError):  # no /proc/self/statm
        if _moves(ResidentTracker(allocator_collect()), freed_too=True):
            logger.info("CPU bytes are read from the resident pages: torch allocates outside glibc")
            return CpuCounter.RESIDENT
    raise UnmeasurableMemoryError(unmeasurable_message(allocator_name()))


def unmeasurable_message(allocator: str) -> str:
    """Why no CPU budget can be kept under ``allocator``, and the fix."""
    option = _RETURN_AT_ONCE.get(allocator)
    fix = (
        f"start Python with {option} in the environment (it hands freed memory back at once) or "
        "without LD_PRELOAD (glibc's malloc)"
        if option
        else "start Python without LD_PRELOAD, so torch allocates through glibc's malloc"
    )
    return (
        f"vtensor cannot measure this process's CPU memory: torch allocates through {allocator}, "
        "which glibc's heap counter does not see and which keeps freed memory resident, so no "
        f"budget could be enforced. Fix: {fix}."
    )


def make_device_tracker(device: torch.device) -> DeviceTracker:
    """Returns the cheap allocation counter for ``device``.

    Raises:
        UnmeasurableMemoryError: on CPU, no counter follows torch's allocations here.
        VTensorError: the device type has no tracker, or its backend is unavailable.
    """
    if device.type == "cpu":
        if cpu_counter() is CpuCounter.HEAP:
            return MallocTracker()
        return ResidentTracker(allocator_collect())
    if device.type == "cuda":
        return CudaTracker(device)
    raise VTensorError(f"no device tracker for {device}: use a cpu or cuda device.")
