"""The CPU counter sees torch's tensors under any allocator, or the manager refuses to start.

These tests run in the suite's own process (glibc's malloc) and again under ``LD_PRELOAD`` of
mimalloc and jemalloc (``scripts/test.sh``), where glibc's heap counter is blind: whichever
counter the process chose must read at least the live tensor bytes, less ``TOLERANCE``.
Children started with an allocator that keeps freed memory must be refused, naming it and the
option that fixes it.
"""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vtensor
from vtensor.errors import UnmeasurableMemoryError
from vtensor.io.pages import PAGE_BYTES, release
from vtensor.measure.counter import (
    CpuCounter,
    allocator_name,
    cpu_counter,
    make_device_tracker,
    unmeasurable_message,
)

MIB = 1 << 20
# A reading may fall short of the live tensor bytes by at most this. Under the heap counter:
# allocator headers, a free of some earlier object between two readings. Under the resident
# counter, also the free space inside pages the allocator holds resident for objects still
# alive (of other threads, of earlier tests): small tensors fill it without a new page, and a
# long test process leaves a few MiB of it (NOTE [CPU counter]).
TOLERANCE = 0.05
TOLERANCE_BYTES = 4 * MIB
LIBS = Path("/usr/lib/x86_64-linux-gnu")
MIMALLOC, JEMALLOC = LIBS / "libmimalloc.so.2", LIBS / "libjemalloc.so.2"
# Sizes of a step's tensors, small to large: 24.4 MiB in all.
SIZES = (4 * 1024,) * 64 + (64 * 1024,) * 64 + (1 * MIB,) * 8 + (12 * MIB,)


def _live(tensors: list[torch.Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def test_cpu_tracker_reads_at_least_the_live_tensor_bytes() -> None:
    tracker = make_device_tracker(torch.device("cpu"))
    torch.ones(1024)  # first-use allocations of torch's CPU path stay out of the measurement
    tracker.settle()  # as at a step's entry
    before = tracker.current_bytes()
    tensors = [torch.ones(n // 4) for n in SIZES]
    live = _live(tensors)
    grown = tracker.current_bytes() - before
    del tensors
    dropped = before + grown - tracker.current_bytes()
    short = TOLERANCE * live + TOLERANCE_BYTES
    assert grown >= live - short, (cpu_counter(), grown, live)
    assert dropped >= live - short, (cpu_counter(), dropped, live)


def test_released_pages_leave_the_count_once() -> None:
    tracker = make_device_tracker(torch.device("cpu"))
    tensor = torch.ones(8 * MIB // 4)
    before = tracker.current_bytes()
    released = release(tensor.data_ptr(), tensor.untyped_storage().nbytes())
    assert released >= 8 * MIB - 2 * PAGE_BYTES
    dropped = before - tracker.current_bytes()
    if tracker.counts_released_pages:
        assert dropped >= released * (1 - TOLERANCE)
    else:
        assert abs(dropped) < released * TOLERANCE  # the manager subtracts its own releases


def test_the_counter_is_the_heap_under_glibc_and_resident_pages_elsewhere() -> None:
    # Another allocator preloaded, or PyTorch's aarch64 wheel, whose libc10 holds mimalloc.
    elsewhere = "malloc" in os.environ.get("LD_PRELOAD", "") or platform.machine() == "aarch64"
    expected = CpuCounter.RESIDENT if elsewhere else CpuCounter.HEAP
    assert cpu_counter() is expected


def _child(preload: Path, env: dict[str, str], code: str) -> subprocess.CompletedProcess[str]:
    if not preload.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{preload} is missing: .ci/run installs libmimalloc2.0 and libjemalloc2")
        pytest.skip(f"{preload} is missing (apt-get install libmimalloc2.0 libjemalloc2)")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MIMALLOC_", "MALLOC_"))}
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, "LD_PRELOAD": str(preload), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


_CONSTRUCT = "import vtensor; vtensor.MemoryManager('64MiB', device='cpu'); print('started')"


@pytest.mark.parametrize(
    ("preload", "named", "option"),
    [
        (MIMALLOC, "mimalloc", "MIMALLOC_RESET_DELAY=0"),
        (JEMALLOC, "jemalloc", "MALLOC_CONF=dirty_decay_ms:0,muzzy_decay_ms:0"),
    ],
)
def test_an_allocator_that_keeps_freed_memory_is_refused_at_construction(
    preload: Path, named: str, option: str
) -> None:
    done = _child(preload, {}, _CONSTRUCT)
    assert done.returncode != 0 and "started" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("vtensor.errors.UnmeasurableMemoryError"), done.stderr
    assert named in last and option in last, last


@pytest.mark.parametrize(
    ("preload", "env"),
    [
        (MIMALLOC, {"MIMALLOC_RESET_DELAY": "0"}),
        (JEMALLOC, {"MALLOC_CONF": "dirty_decay_ms:0,muzzy_decay_ms:0"}),
    ],
)
def test_the_allocator_option_named_in_the_error_lets_the_manager_start(
    preload: Path, env: dict[str, str]
) -> None:
    code = _CONSTRUCT + "; from vtensor.measure.counter import cpu_counter; print(cpu_counter())"
    done = _child(preload, env, code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["started", "resident"]


def test_the_message_names_the_allocator_and_the_fix() -> None:
    message = unmeasurable_message("jemalloc")
    assert "jemalloc" in message and "MALLOC_CONF=dirty_decay_ms:0" in message
    assert "LD_PRELOAD" in unmeasurable_message("an allocator other than glibc's malloc")
    assert isinstance(allocator_name(), str)
    assert issubclass(UnmeasurableMemoryError, vtensor.VTensorError)
