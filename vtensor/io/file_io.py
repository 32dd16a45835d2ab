"""The one I/O thread of a swap file, with read-ahead and write-behind."""

import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from vtensor.io.chunk import Chunk
from vtensor.io.sealing import Piece, Sealer
from vtensor.io.tiers import StorageTier, buffer_at

logger = logging.getLogger(__name__)

READ_AHEAD_BYTES = 16 << 20  # most swap-file bytes read ahead of their restores at a time


@dataclass
class ThreadTransfer:
    """A file transfer running on the engine's I/O thread."""

    future: concurrent.futures.Future[float]
    nbytes: int

    def done(self) -> bool:  # noqa: D102
        return self.future.done()

    def wait(self) -> None:  # noqa: D102
        self.future.result()

    def busy_s(self) -> float:  # noqa: D102
        return self.future.result() if self.future.done() else 0.0


class ReadAhead:
    """Swap-file ranges that queued restores will read, asked of the kernel ahead of the reads.

    NOTE [read-ahead]: the disk reads a restore's bytes while the I/O thread is busy with earlier
    jobs. Pages read ahead stay cached until read and dropped, so the bytes asked for and not yet
    read are capped (``limit_bytes``). Only the I/O thread asks, and it takes a range out of the
    queue before reading it, so no range is asked for after its job dropped it.
    """

    def __init__(self, tier: StorageTier, limit_bytes: int = READ_AHEAD_BYTES) -> None:
        self.tier = tier
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()
        # [start, end) file ranges in the order restores will read them: not asked for yet,
        # and asked for but not read yet. ``want`` appends from the compute thread.
        self._wanted: collections.deque[list[int]] = collections.deque()
        self._asked: list[list[int]] = []
        self.ahead_bytes = 0  # bytes of ``_asked``

    def want(self, runs: Sequence[tuple[int, int, int]]) -> None:
        """Queue the (slot, memory offset, bytes) runs of a restore just issued."""
        with self._lock:
            self._wanted.extend([slot, slot + nbytes] for slot, _, nbytes in runs)

    def claim(self, start: int, nbytes: int) -> None:
        """On the I/O thread, before reading ``[start, start + nbytes)``: it is no longer ahead."""
        end = start + nbytes
        with self._lock:
            self._wanted = collections.deque(_cut(self._wanted, start, end))
            self._asked = list(_cut(self._asked, start, end))
            self.ahead_bytes = sum(b - a for a, b in self._asked)

    def top_up(self) -> None:
        """On the I/O thread: ask for the next wanted bytes, up to the cap."""
        asked: list[tuple[int, int]] = []
        with self._lock:
            room = self.limit_bytes - self.ahead_bytes
            while room > 0 and self._wanted:
                head = self._wanted[0]
                take = min(head[1] - head[0], room)
                asked.append((head[0], take))
                self._asked.append([head[0], head[0] + take])
                head[0] += take
                if head[0] == head[1]:
                    self._wanted.popleft()
                room -= take
                self.ahead_bytes += take
        for offset, nbytes in asked:
            try:
                self.tier.read_ahead(offset, nbytes)
            except OSError:  # advisory: the restore reads the bytes itself, only later
                logger.debug("read-ahead of %d bytes at %d failed", nbytes, offset, exc_info=True)


def _cut(ranges: Iterable[list[int]], start: int, end: int) -> Iterator[list[int]]:
    """``ranges`` less ``[start, end)``, in order."""
    for a, b in ranges:
        if b <= start or a >= end:
            yield [a, b]
            continue
        if a < start:
            yield [a, start]
        if b > end:
            yield [end, b]


def place_run(tier: StorageTier, chunks: Sequence[Chunk]) -> tuple[int, int]:
    """Give one eviction's chunks (a tail, contiguous in memory) one contiguous extent.

    So the run is one write (sealed: one per staging buffer) and one cache drop. Returns the
    extent's start and bytes.
    """
    total = sum(c.nbytes for c in chunks)
    start = slot = tier.extents.alloc(total)
    for chunk in chunks:
        chunk.slot = slot
        slot += chunk.nbytes
    return start, total


def contiguous_runs(chunks: Sequence[Chunk]) -> list[tuple[int, int, int]]:
    """(slot, memory offset, bytes) runs of chunks adjacent both in the file and in memory."""
    runs: list[list[int]] = []
    for chunk in sorted(chunks, key=lambda c: c.offset_bytes):
        assert chunk.slot is not None, "chunk has no slot"
        last = runs[-1] if runs else None
        if last and last[0] + last[2] == chunk.slot and last[1] + last[2] == chunk.offset_bytes:
            last[2] += chunk.nbytes
        else:
            runs.append([chunk.slot, chunk.offset_bytes, chunk.nbytes])
    return [(slot, offset, nbytes) for slot, offset, nbytes in runs]


class SwapFileIo:
    """An engine's swap-file side: jobs on one thread, each topping up read-ahead; write-behind.

    It closes ``tier`` and ``sealer`` (None: the file holds plaintext) with itself.
    """

    def __init__(self, tier: StorageTier, thread_name: str, sealer: Sealer | None) -> None:
        self.tier = tier
        self.sealer = sealer
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=thread_name)
        self.read_ahead = ReadAhead(tier)
        self._behind: tuple[int, int] | None = None  # NOTE [write behind] in io/tiers.py

    def submit(self, job: Callable[[], None], nbytes: int) -> ThreadTransfer:
        """Run ``job`` on the I/O thread; the transfer it stands for moves ``nbytes``."""

        def timed() -> float:
            begin = time.perf_counter()
            self.read_ahead.top_up()
            job()
            return time.perf_counter() - begin

        return ThreadTransfer(self._pool.submit(timed), nbytes)

    def submit_write(self, job: Callable[[], None], nbytes: int) -> ThreadTransfer:
        """``submit`` a job that writes: it ends with its bytes out of the page cache."""

        def settled() -> None:
            try:
                job()
            except BaseException:
                with contextlib.suppress(OSError):  # the first error is the one to report
                    self._settle()
                raise
            self._settle()

        return self.submit(settled, nbytes)

    def submit_read(
        self, runs: Sequence[tuple[int, int, int]], job: Callable[[], None], nbytes: int
    ) -> ThreadTransfer:
        """``submit`` a job that reads the (slot, memory offset, bytes) ``runs``, read ahead."""
        self.read_ahead.want(runs)

        def claimed() -> None:
            try:
                job()
            finally:
                for slot, _, run_bytes in runs:  # a failed restore reads no further
                    self.read_ahead.claim(slot, run_bytes)

        return self.submit(claimed, nbytes)

    # NOTE [page-cache bound]: each staging buffer's pages are dropped right after its call (a
    # write once the next one's write-back began), so the cache holds about two staging buffers.
    def write_dropped(self, offset: int, views: list[memoryview]) -> None:
        """Write ``views`` at ``offset``; their pages leave the cache once the next write began."""
        nbytes = sum(len(v) for v in views)
        self.tier.writev(offset, views)
        started = self.tier.start_write_back(offset, nbytes)
        self._settle()
        if started:
            self._behind = (offset, nbytes)
        else:
            self.tier.release_cache(offset, nbytes, dirty=True)
        self.read_ahead.top_up()

    def _settle(self) -> None:
        """Wait for the range still being written back and drop it from the page cache."""
        if self._behind is not None:
            offset, nbytes = self._behind
            self._behind = None
            self.tier.release_cache(offset, nbytes, dirty=True)

    def read_dropped(self, offset: int, views: list[memoryview]) -> None:
        """Read ``views`` from ``offset`` and drop their pages from the cache."""
        nbytes = sum(len(v) for v in views)
        self.read_ahead.claim(offset, nbytes)
        self.tier.readv(offset, views)
        self.tier.release_cache(offset, nbytes, dirty=False)
        self.read_ahead.top_up()

    def write(self, pieces: Sequence[Piece]) -> None:
        """Write ``pieces``, sealed if there is a sealer (NOTE [sealed swap])."""
        if self.sealer is not None:
            self.sealer.seal(pieces, self.write_dropped)
            return
        for piece in pieces:
            self.write_dropped(piece.file_offset, [buffer_at(piece.address, piece.nbytes)])

    def read(self, pieces: Sequence[Piece]) -> None:
        """Read ``pieces`` back into memory, opening them if there is a sealer."""
        if self.sealer is not None:
            self.sealer.open(pieces, self.read_dropped)
            return
        for piece in pieces:
            self.read_dropped(piece.file_offset, [buffer_at(piece.address, piece.nbytes)])

    def release(self, chunks: Sequence[Chunk], part_bytes: int | None = None) -> None:
        """Free the extents of ``chunks``; forget their seals, in parts of ``part_bytes`` if set."""
        held = [c for c in chunks if c.slot is not None]
        for slot, _, nbytes in contiguous_runs(held):
            self.tier.extents.free(slot, nbytes)
        for chunk in held:
            assert chunk.slot is not None
            if self.sealer is not None:
                step = part_bytes or chunk.nbytes
                for at in range(0, chunk.nbytes, step):
                    self.sealer.forget(chunk.slot + at, min(step, chunk.nbytes - at))
            chunk.slot = None

    def close(self) -> None:
        """Wait for the jobs queued, then close the swap file and drop the sealer's key."""
        self._pool.shutdown(wait=True)
        self.tier.close()
        if self.sealer is not None:
            self.sealer.close()
