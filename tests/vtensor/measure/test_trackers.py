"""The byte counters keep the GIL while they read (NOTE [readings hold the GIL])."""

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from vtensor.io.pages import PAGE_BYTES, release
from vtensor.measure.trackers import MallocTracker

SWITCH_S = 0.5  # the interpreter's switch interval during these tests (default 5 ms)
CALLS = 4


@contextmanager
def busy_python_thread() -> Iterator[None]:
    """Another thread running Python throughout, under a long switch interval.

    A call that gives up the GIL waits for the interval to take it back from that thread.
    """
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_S)
    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        time.sleep(0.01)  # the spinning thread holds the GIL from here on
        yield
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        thread.join()


def _seconds(call: Callable[[], object]) -> float:
    begin = time.perf_counter()
    for _ in range(CALLS):
        call()
    return time.perf_counter() - begin


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's heap counter")
def test_a_heap_reading_does_not_wait_for_a_thread_running_python() -> None:
    tracker = MallocTracker()
    with busy_python_thread():
        elapsed = _seconds(tracker.current_bytes)
    # Giving up the GIL, each reading would wait about one switch interval for it.
    assert elapsed < SWITCH_S, f"{CALLS} readings took {elapsed:.2f} s"


@pytest.mark.skipif(sys.platform != "linux", reason="madvise")
def test_releasing_pages_does_not_wait_for_a_thread_running_python() -> None:
    storage = torch.empty(8 * PAGE_BYTES, dtype=torch.uint8).untyped_storage()
    with busy_python_thread():
        elapsed = _seconds(lambda: release(storage.data_ptr(), storage.nbytes()))
    assert elapsed < SWITCH_S, f"{CALLS} releases took {elapsed:.2f} s"
