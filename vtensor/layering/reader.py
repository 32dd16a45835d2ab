"""Demand layering's reads: a layer's bytes into its buffer, and the thread that reads ahead.

Once the first forward is planned, a thread reads each forward's calls in order, at most
``lookahead`` ahead and never into ring bytes a call still holds; it and the forward share the
state under ``cond``.
"""

import threading
import time

import torch

from vtensor.io.tiers import buffer_at
from vtensor.layering.records import Call, Layer
from vtensor.layering.weightfile import ALIGN_BYTES, WeightFile


class LayerReader:
    """Reads layers from ``file``: now on the caller's thread (``fill``), or ahead (``start``)."""

    def __init__(
        self, file: WeightFile, *, lookahead: int | None, verify: str, drop_page_cache: bool
    ) -> None:
        self.file = file
        self.direct = file.direct_fd is not None
        self._lookahead = lookahead
        self._verify, self._drop_cache = verify, drop_page_cache
        self._scratch = memoryview(bytearray(ALIGN_BYTES))  # the file's padding lands here
        self._verified: set[str] = set()
        self.cond = threading.Condition()
        self.calls: list[Call] | None = None  # None until the first forward is planned
        self._live: dict[int, Call] = {}  # calls read (or being read) and not yet released
        self._thread: threading.Thread | None = None
        self._closing = self._active = self._reading = False
        self._failure: BaseException | None = None
        self.cursor, self._next_read, self._read_done = -1, 0, 0
        self.live_bytes = self.peak_live_bytes = self.bytes_read = 0
        self.read_s = self.stall_s = 0.0

    def fill(self, layer: Layer, buffer: torch.Tensor) -> None:
        """Read ``layer``'s bytes into ``buffer``, counted (any thread; preadv releases the GIL)."""
        started = time.perf_counter()
        base = buffer.data_ptr()
        nbytes = 0
        for file_offset, pieces in layer.runs:
            views = [
                self._scratch[:n] if at is None else buffer_at(base + at, n) for at, n in pieces
            ]
            self.file.read(file_offset, views, direct=self.direct)
            run_bytes = sum(n for _, n in pieces)
            if self._drop_cache and not self.direct:
                self.file.drop_cache(file_offset, run_bytes)
            nbytes += run_bytes
        for slot in layer.slots:
            name = slot.entry.name
            if self._verify == "always" or (self._verify == "first" and name not in self._verified):
                self.file.check_crc(slot.entry, buffer_at(base + slot.offset, slot.entry.nbytes))
                self._verified.add(name)
        with self.cond:
            self.bytes_read += nbytes
            self.read_s += time.perf_counter() - started

    def add_live(self, nbytes: int) -> None:
        """Count ``nbytes`` more (or fewer) held, and their peak (under the lock once started)."""
        self.live_bytes += nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def reset_stats(self, live_bytes: int) -> None:
        """Count afresh, with ``live_bytes`` (the resident modules') held."""
        with self.cond:
            self.live_bytes = self.peak_live_bytes = live_bytes
            self.bytes_read, self.read_s, self.stall_s = 0, 0.0, 0.0

    # -- the forward's side ----------------------------------------------------------------------

    def start(self, calls: list[Call]) -> None:
        """Read ``calls`` ahead of every forward from now on, on a thread of its own."""
        self.calls = calls
        self._thread = threading.Thread(
            target=self._read_loop, name="vtensor-layering", daemon=True
        )
        self._thread.start()

    def begin_forward(self) -> None:
        """A forward starts: once a read left from the last one ends, read from call 0."""
        with self.cond:
            self.cond.wait_for(lambda: not self._reading)
            self.cursor, self._next_read, self._read_done = -1, 0, 0
            self._live.clear()
            self._failure = None
            self._active = True
            self.cond.notify_all()

    def wait_for(self, j: int) -> None:
        """Call ``j`` runs: wait until it is read, or raise the error its read failed with."""
        with self.cond:
            self.cursor = j
            if self._may_read():  # wake the reader only to read: each wake-up costs GIL turns
                self.cond.notify_all()
            started = time.perf_counter()
            self.cond.wait_for(lambda: self._read_done > j or self._failure is not None)
            self.stall_s += time.perf_counter() - started
            if self._read_done <= j and self._failure is not None:
                raise self._failure

    def release(self, j: int) -> None:
        """Call ``j`` has run: its bytes are free for later reads."""
        with self.cond:
            call = self._live.pop(j, None)
            if call is not None:
                self.add_live(-call.layer.nbytes)
            if self._may_read():
                self.cond.notify_all()

    def stop_forward(self) -> None:
        """The forward ends: read no further, and wait for a read in progress to end."""
        with self.cond:
            self._active = False
            self.cond.wait_for(lambda: not self._reading)

    def drop_unused(self, live_bytes: int) -> None:
        """Forget calls read ahead but never used (after an exception); ``live_bytes`` held."""
        with self.cond:
            self._live.clear()
            self.live_bytes = live_bytes

    def close(self) -> None:
        """Stop the thread and let the calls' buffers go."""
        with self.cond:
            self._closing = True
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.calls = None

    # -- the reader thread -----------------------------------------------------------------------

    def _may_read(self) -> bool:
        """Whether the next call may be read now (under the lock)."""
        assert self.calls is not None
        j = self._next_read
        if not self._active or self._failure is not None or j >= len(self.calls):
            return False
        if self._lookahead is not None and j > self.cursor + self._lookahead:
            return False
        call = self.calls[j]
        if call.ring_offset is None:
            return True
        begin, end = call.ring_offset, call.ring_offset + call.layer.nbytes
        return not any(
            held.ring_offset is not None
            and held.ring_offset < end
            and begin < held.ring_offset + held.layer.nbytes
            for held in self._live.values()
        )

    def _read_loop(self) -> None:
        assert self.calls is not None
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self._closing or self._may_read())
                if self._closing:
                    return
                j = self._next_read
                call = self.calls[j]
                self._next_read, self._reading = j + 1, True
                self._live[j] = call
                self.add_live(call.layer.nbytes)
            failure: BaseException | None = None
            try:
                self.fill(call.layer, call.buffer)
            except Exception as exc:  # raised in the forward that needs this call
                failure = exc
            with self.cond:
                self._reading = False
                if failure is None:
                    self._read_done = j + 1
                else:
                    self._failure = failure
                self.cond.notify_all()
