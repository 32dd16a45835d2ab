"""Asynchronous transfer engines: a background thread for file I/O, a side stream for CUDA."""

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from vtensor.chunk import Chunk
from vtensor.sealing import DEFAULT_CIPHER, Cipher, Piece, Sealer
from vtensor.tiers import HostTier, StorageTier

logger = logging.getLogger(__name__)

READ_AHEAD_BYTES = 16 << 20  # most swap-file bytes read ahead of their restores at a time


class Transfer(Protocol):
    """A copy in flight. ``wait`` makes its result visible to the compute that follows."""

    nbytes: int

    def done(self) -> bool:
        """True once the copy has finished (successfully or not)."""
        ...

    def wait(self) -> None:
        """Block (or make the compute stream wait) until the copy is complete; re-raise failures."""
        ...

    def busy_s(self) -> float:
        """Seconds the transfer itself took (valid once done)."""
        ...


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


@dataclass
class CudaTransfer:
    """A copy on the side stream, fenced by events; holds its operands until complete."""

    start: torch.cuda.Event
    end: torch.cuda.Event
    nbytes: int
    keepalive: list[torch.Tensor] = field(default_factory=list)

    def done(self) -> bool:  # noqa: D102
        finished = bool(self.end.query())  # type: ignore[no-untyped-call]
        if finished:
            self.keepalive.clear()
        return finished

    def wait(self) -> None:  # noqa: D102
        # Wait-on-use without blocking the host: the compute stream waits for the side stream.
        torch.cuda.current_stream().wait_event(self.end)

    def busy_s(self) -> float:  # noqa: D102
        return float(self.start.elapsed_time(self.end)) / 1000.0 if self.done() else 0.0


class TransferEngine(Protocol):
    """Moves chunk bytes between a storage's memory and a slower tier."""

    def evict(self, storage: torch.UntypedStorage, chunks: Sequence[Chunk]) -> Transfer:
        """Start copying ``chunks`` of ``storage`` out; assigns each chunk a slot."""
        ...

    def restore(self, storage: torch.UntypedStorage, chunks: Sequence[Chunk]) -> Transfer:
        """Start copying ``chunks`` back into ``storage`` (already at full size)."""
        ...

    def release(self, chunks: Sequence[Chunk]) -> None:
        """Free the slots of chunks whose transfers have completed."""
        ...

    def close(self) -> None:
        """Wait for outstanding work and release the tier."""
        ...


class FileTransferEngine:
    """Storage-tier transfers on one background thread (raw syscalls and AEAD release the GIL).

    With ``encrypt`` (the default) every chunk is sealed before it reaches the file and
    authenticated when it comes back (NOTE [sealed swap] in ``vtensor/sealing.py``).
    """

    def __init__(
        self, tier: StorageTier, *, encrypt: bool = True, cipher: Cipher | str = DEFAULT_CIPHER
    ) -> None:
        self.tier = tier
        self.sealer = Sealer(cipher) if encrypt else None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vtensor-io")
        self._ahead_lock = threading.Lock()
        self._ahead_bytes = 0  # read ahead by restores whose jobs have not finished
        # (slot, bytes) to read ahead; appended by the compute thread, taken by the I/O thread.
        self._ahead_requests: collections.deque[tuple[int, int]] = collections.deque()

    def _submit(self, job: Callable[[], None], nbytes: int) -> ThreadTransfer:
        def timed() -> float:
            begin = time.perf_counter()
            self._issue_read_ahead()
            job()
            return time.perf_counter() - begin

        return ThreadTransfer(self._pool.submit(timed), nbytes)

    def _read_ahead(self, runs: list[tuple[int, int, int]]) -> int:
        """Start the disk reading the first bytes of ``runs``; returns the bytes asked for.

        NOTE [read-ahead]: the disk starts reading a restore when it is issued, while the I/O
        thread is still busy with earlier jobs (sealing, writing, other restores), so the job
        finds its first bytes in the page cache. Pages read ahead sit in the page cache until
        their job copies them out and drops them, so the bytes read ahead and not yet consumed
        are capped at ``READ_AHEAD_BYTES``.
        """
        asked: list[tuple[int, int]] = []
        with self._ahead_lock:
            room = READ_AHEAD_BYTES - self._ahead_bytes
            for slot, _, nbytes in runs:
                take = min(nbytes, room)
                if take <= 0:
                    break
                asked.append((slot, take))
                room -= take
            total = sum(take for _, take in asked)
            self._ahead_bytes += total
        self._ahead_requests.extend(asked)
        return total

    def _issue_read_ahead(self) -> None:
        """On the I/O thread, before each job: ask the kernel for the bytes restores requested.

        ``posix_fadvise(WILLNEED)`` blocks while it queues the reads (~0.6 ms per call here), so
        the compute thread only records the request. A restore's request is queued before its
        job, so it is issued before that job reads (never after the job has dropped the pages,
        which would leave them cached); requests made while a long job runs are issued at the
        start of the next one, still ahead of the restores queued behind it.
        """
        while self._ahead_requests:
            slot, take = self._ahead_requests.popleft()
            try:
                self.tier.read_ahead(slot, take)
            except OSError:  # advisory: the restore reads the bytes itself, only later
                logger.debug("read-ahead of %d bytes at %d failed", take, slot, exc_info=True)

    # NOTE [page-cache bound]: sealed transfers move one staging buffer (at most 4 MiB) per
    # vectored call and drop its pages from the page cache right after it, so the swap file
    # holds at most about one staging buffer of page cache on the I/O thread's account, instead
    # of a whole eviction run or restore (tens of MiB for a large activation).
    def _write_dropped(self, offset: int, views: list[memoryview]) -> None:
        self.tier.writev(offset, views)
        self.tier.release_cache(offset, sum(len(v) for v in views), dirty=True)

    def _read_dropped(self, offset: int, views: list[memoryview]) -> None:
        self.tier.readv(offset, views)
        self.tier.release_cache(offset, sum(len(v) for v in views), dirty=False)

    def evict(self, storage: torch.UntypedStorage, chunks: Sequence[Chunk]) -> Transfer:  # noqa: D102
        # The chunks of one eviction are contiguous in memory (a tail of the storage): give them
        # one contiguous extent so the whole run is one write (sealed: one per staging buffer)
        # and one cache drop.
        total = sum(c.nbytes for c in chunks)
        start = self.tier.extents.alloc(total)
        slot = start
        for chunk in chunks:
            chunk.slot = slot
            slot += chunk.nbytes
        address = storage.data_ptr() + chunks[0].offset_bytes
        sealer = self.sealer
        pieces = _pieces(storage, chunks) if sealer is not None else []

        def job() -> None:
            if sealer is None:
                self.tier.write(start, address, total)
                self.tier.release_cache(start, total, dirty=True)
            else:
                sealer.seal(pieces, self._write_dropped)

        return self._submit(job, total)

    def restore(self, storage: torch.UntypedStorage, chunks: Sequence[Chunk]) -> Transfer:  # noqa: D102
        base = storage.data_ptr()
        runs = _contiguous_runs(chunks)
        sealer = self.sealer
        pieces = _pieces(storage, chunks) if sealer is not None else []
        ahead = self._read_ahead(runs)

        def job() -> None:
            try:
                if sealer is not None:
                    sealer.open(pieces, self._read_dropped)
                    return
                for slot, offset, nbytes in runs:
                    self.tier.read(slot, base + offset, nbytes)
                    self.tier.release_cache(slot, nbytes, dirty=False)
            finally:
                with self._ahead_lock:
                    self._ahead_bytes -= ahead

        return self._submit(job, sum(c.nbytes for c in chunks))

    def release(self, chunks: Sequence[Chunk]) -> None:  # noqa: D102
        held = [c for c in chunks if c.slot is not None]
        for slot, _, nbytes in _contiguous_runs(held):
            self.tier.extents.free(slot, nbytes)
        for chunk in held:
            if self.sealer is not None:
                assert chunk.slot is not None
                self.sealer.forget(chunk.slot, chunk.nbytes)
            chunk.slot = None

    def close(self) -> None:  # noqa: D102
        self._pool.shutdown(wait=True)
        self.tier.close()
        if self.sealer is not None:
            self.sealer.close()


def _pieces(storage: torch.UntypedStorage, chunks: Sequence[Chunk]) -> list[Piece]:
    """The chunks as sealing sees them: file slot, memory address, identity."""
    base = storage.data_ptr()
    pieces = []
    for chunk in chunks:
        assert chunk.slot is not None, "chunk has no slot"
        # The storage's address identifies the vTensor: the store keys its records by it too.
        pieces.append(
            Piece(chunk.slot, base + chunk.offset_bytes, chunk.nbytes, storage._cdata, chunk.index)
        )
    return pieces


def _contiguous_runs(chunks: Sequence[Chunk]) -> list[tuple[int, int, int]]:
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


class CudaTransferEngine:
    """Host-tier transfers on a side CUDA stream into a pool of pinned buffers.

    NOTE [cuda transfers]
    Copies are ordered after the compute stream's pending work (``wait_stream``), fenced by an
    event, and the operands are held by the transfer until its event has completed, instead of
    ``record_stream``, whose deferred frees make allocation non-deterministic. A restore waits on
    the compute stream (``wait_event``), so an unpack never sees partial data and the host never
    blocks.
    """

    def __init__(self, device: torch.device, tier: HostTier) -> None:
        self.device = device
        self.tier = tier
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._buffers: dict[int, torch.Tensor] = {}
        self._next_slot = 0
        self._retiring: list[tuple[CudaTransfer, list[torch.Tensor]]] = []

    def _bytes_of(self, storage: torch.UntypedStorage) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)

    def _copy(
        self, storage: torch.UntypedStorage, chunks: Sequence[Chunk], out: bool
    ) -> CudaTransfer:
        flat = self._bytes_of(storage)
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        keep = [flat]
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            for chunk in chunks:
                window = flat[chunk.offset_bytes : chunk.offset_bytes + chunk.nbytes]
                if out:
                    buffer = self.tier.take(chunk.nbytes)
                    chunk.slot = self._next_slot
                    self._next_slot += 1
                    self._buffers[chunk.slot] = buffer
                    buffer.copy_(window, non_blocking=True)
                else:
                    assert chunk.slot is not None, "restoring a chunk that has no slot"
                    buffer = self._buffers[chunk.slot]
                    window.copy_(buffer, non_blocking=True)
                keep.append(buffer)
            end.record(self.stream)
        return CudaTransfer(start, end, sum(c.nbytes for c in chunks), keep)

    def evict(self, storage: torch.UntypedStorage, chunks: Sequence[Chunk]) -> Transfer:  # noqa: D102
        return self._copy(storage, chunks, out=True)

    def restore(self, storage: torch.UntypedStorage, chunks: Sequence[Chunk]) -> Transfer:  # noqa: D102
        return self._copy(storage, chunks, out=False)

    def release(self, chunks: Sequence[Chunk]) -> None:  # noqa: D102
        held = [chunk for chunk in chunks if chunk.slot is not None]
        if not held:
            return
        # The copies that used these pinned buffers were issued on the side stream; they may be
        # reused once it has passed them.
        self.stream.synchronize()
        for chunk in held:
            assert chunk.slot is not None
            self.tier.give_back(self._buffers.pop(chunk.slot))
            chunk.slot = None

    def close(self) -> None:  # noqa: D102
        self.stream.synchronize()
        self._buffers.clear()
        self.tier.close()
