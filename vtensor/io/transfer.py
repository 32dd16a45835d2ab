"""Asynchronous transfer engines: a background thread for file I/O, a side stream for CUDA."""

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from vtensor.io.chunk import Chunk, ChunkState
from vtensor.io.file_io import SwapFileIo, contiguous_runs, place_run
from vtensor.io.sealing import DEFAULT_CIPHER, Cipher, Piece, Sealer
from vtensor.io.tiers import HostTier, StorageTier


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
class CudaTransfer:
    """A copy on the side stream, fenced by events; holds its operands until complete."""

    start: torch.cuda.Event
    end: torch.cuda.Event
    nbytes: int
    device: torch.device
    keepalive: list[torch.Tensor] = field(default_factory=list)

    def done(self) -> bool:  # noqa: D102
        finished = bool(self.end.query())  # type: ignore[no-untyped-call]
        if finished:
            self.keepalive.clear()
        return finished

    def wait(self) -> None:  # noqa: D102
        # Wait-on-use without blocking the host: the compute stream waits for the side stream.
        torch.cuda.current_stream(self.device).wait_event(self.end)

    def busy_s(self) -> float:  # noqa: D102
        return float(self.start.elapsed_time(self.end)) / 1000.0 if self.done() else 0.0


class TransferEngine(Protocol):
    """Moves chunk bytes between a storage's memory and a slower tier.

    Attributes:
        lands_in: an evicted chunk's state once its transfer completed: ``HOST`` or ``STORAGE``.
        host_pages: it moves host memory, whose pages may be released in place (NOTE [release
            in place]).
    """

    lands_in: ChunkState
    host_pages: bool

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
    """Storage-tier transfers on one background thread; ``encrypt`` seals (NOTE [sealed swap])."""

    lands_in = ChunkState.STORAGE
    host_pages = True

    def __init__(
        self, tier: StorageTier, *, encrypt: bool = True, cipher: Cipher | str = DEFAULT_CIPHER
    ) -> None:
        self.tier = tier
        self.sealer = Sealer(cipher) if encrypt else None
        self.io = SwapFileIo(tier, "vtensor-io", self.sealer)

    def evict(self, storage: torch.UntypedStorage, chunks: Sequence[Chunk]) -> Transfer:  # noqa: D102
        _, total = place_run(self.tier, chunks)
        pieces = _pieces(storage, chunks, sealed=self.sealer is not None)
        return self.io.submit_write(functools.partial(self.io.write, pieces), total)

    def restore(self, storage: torch.UntypedStorage, chunks: Sequence[Chunk]) -> Transfer:  # noqa: D102
        pieces = _pieces(storage, chunks, sealed=self.sealer is not None)
        job = functools.partial(self.io.read, pieces)
        return self.io.submit_read(contiguous_runs(chunks), job, sum(c.nbytes for c in chunks))

    def release(self, chunks: Sequence[Chunk]) -> None:  # noqa: D102
        self.io.release(chunks)

    def close(self) -> None:  # noqa: D102
        self.io.close()


def _pieces(storage: torch.UntypedStorage, chunks: Sequence[Chunk], sealed: bool) -> list[Piece]:
    """The chunks as sealing sees them: file slot, memory address, identity.

    Not ``sealed``: one piece per run of ``contiguous_runs``, so each run is one write or read.
    """
    base = storage.data_ptr()
    # The storage's address identifies the vTensor: the store keys its records by it too.
    owner = storage._cdata
    if not sealed:
        runs = contiguous_runs(chunks)
        return [Piece(slot, base + offset, nbytes, owner, 0) for slot, offset, nbytes in runs]
    pieces = []
    for chunk in chunks:
        assert chunk.slot is not None, "chunk has no slot"
        pieces.append(
            Piece(chunk.slot, base + chunk.offset_bytes, chunk.nbytes, owner, chunk.index)
        )
    return pieces


def bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class CudaTransferEngine:
    """Host-tier transfers on a side CUDA stream into a pool of pinned buffers.

    NOTE [cuda transfers]
    Copies follow the compute stream's pending work (``wait_stream``) and end in an event. The
    store waits on every transfer before it shrinks, grows or frees the storage, so the allocator
    never hands the bytes out under a copy (``record_stream``'s deferred frees would make
    allocation non-deterministic). A transfer holds no reference to the storage: the store counts
    its references (``ChunkStore._finish``). Pinned buffers are used only on the one side stream,
    so one given back is reused by a later copy there without host synchronisation.
    """

    lands_in = ChunkState.HOST
    host_pages = False

    def __init__(self, device: torch.device, tier: HostTier) -> None:
        self.device = device
        self.tier = tier
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._buffers: dict[int, torch.Tensor] = {}
        self._next_slot = 0

    def _copy(
        self, storage: torch.UntypedStorage, chunks: Sequence[Chunk], out: bool
    ) -> CudaTransfer:
        flat = bytes_of(storage)
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        keep = []  # the pinned buffers; never the storage (NOTE [cuda transfers])
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
        return CudaTransfer(start, end, sum(c.nbytes for c in chunks), self.device, keep)

    def evict(self, storage: torch.UntypedStorage, chunks: Sequence[Chunk]) -> Transfer:  # noqa: D102
        return self._copy(storage, chunks, out=True)

    def restore(self, storage: torch.UntypedStorage, chunks: Sequence[Chunk]) -> Transfer:  # noqa: D102
        return self._copy(storage, chunks, out=False)

    def release(self, chunks: Sequence[Chunk]) -> None:  # noqa: D102
        # Reused only by later copies on the same side stream (NOTE [cuda transfers]).
        for chunk in chunks:
            if chunk.slot is not None:
                self.tier.give_back(self._buffers.pop(chunk.slot))
                chunk.slot = None

    def close(self) -> None:  # noqa: D102
        self.stream.synchronize()
        self._buffers.clear()
        self.tier.close()
