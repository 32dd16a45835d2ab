"""Device chunks to the sealed swap file and back, through a bounded set of pinned staging slots.

NOTE [staged swap]
On a GPU sharing its DRAM with the CPU (``is_integrated``) the host tier frees nothing, so chunks
go device -> staging slot -> file and back, in parts of at most one slot. The slots are
allocated once (``slots * slot_bytes`` of pinned memory, ever); with two or more, the device
copy of the next part runs while the I/O thread seals and writes the current one. Each part is
sealed as its own piece, at the chunk's offsets, as ``FileTransferEngine`` writes it.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vtensor.errors import VTensorError
from vtensor.io.chunk import DEFAULT_CHUNK_BYTES, Chunk, ChunkState
from vtensor.io.file_io import SwapFileIo, place_run
from vtensor.io.sealing import DEFAULT_CIPHER, Cipher, Piece, Sealer
from vtensor.io.staging import DeviceCopier, Fence
from vtensor.io.tiers import StorageTier
from vtensor.io.transfer import Transfer, bytes_of

STAGING_SLOTS = 2  # one part in a device copy while the other is sealed and written


@dataclass(frozen=True)
class Part:
    """At most one staging slot of a chunk: where it is in the file, in memory, in the chunk."""

    file_offset: int
    memory_offset: int  # within the storage
    nbytes: int
    index: int  # the chunk's
    part_offset: int  # within the chunk


# (device bytes, parts, the fence the copies follow, owner) -> moved, on the I/O thread
_Move = Callable[[torch.Tensor, list[Part], Fence, int], None]


def parts_of(chunks: Sequence[Chunk], slot_bytes: int) -> list[Part]:
    """``chunks`` (with slots) cut into parts of at most ``slot_bytes``, in order."""
    parts = []
    for chunk in chunks:
        assert chunk.slot is not None, "chunk has no slot"
        for at in range(0, chunk.nbytes, slot_bytes):
            nbytes = min(slot_bytes, chunk.nbytes - at)
            parts.append(Part(chunk.slot + at, chunk.offset_bytes + at, nbytes, chunk.index, at))
    return parts


def _piece(part: Part, buffer: torch.Tensor, owner: int) -> Piece:
    """``part``, staged in ``buffer``, as sealing sees it."""
    return Piece(
        part.file_offset, buffer.data_ptr(), part.nbytes, owner, part.index, part.part_offset
    )


def _settle(fences: list[Fence | None]) -> None:
    for fence in fences:
        if fence is not None:
            fence.synchronize()


class StagedTransferEngine:
    """Storage-tier transfers of device memory through pinned staging slots (NOTE [staged swap]).

    ``copier`` runs the device copies (``CudaCopier`` on CUDA); ``slots * slot_bytes`` is all the
    pinned memory it holds. ``encrypt`` and ``cipher`` are as for ``FileTransferEngine``.
    """

    lands_in = ChunkState.STORAGE
    host_pages = False

    def __init__(
        self,
        tier: StorageTier,
        copier: DeviceCopier,
        *,
        slot_bytes: int = DEFAULT_CHUNK_BYTES,
        slots: int = STAGING_SLOTS,
        encrypt: bool = True,
        cipher: Cipher | str = DEFAULT_CIPHER,
    ) -> None:
        if slot_bytes <= 0 or slots < 1:
            raise VTensorError(
                f"slot_bytes={slot_bytes}, slots={slots}: pass a positive slot size and at "
                "least one staging slot"
            )
        self.tier = tier
        self.copier = copier
        self.sealer = Sealer(cipher) if encrypt else None
        self.slot_bytes = slot_bytes
        self._slots = [copier.staging(slot_bytes) for _ in range(slots)]
        self.pinned_bytes = slots * slot_bytes
        self.io = SwapFileIo(tier, "vtensor-staged", self.sealer)

    def evict(self, storage: torch.UntypedStorage, chunks: Sequence[Chunk]) -> Transfer:  # noqa: D102
        _, total = place_run(self.tier, chunks)
        job = self._job(storage, self._write_parts, parts_of(chunks, self.slot_bytes))
        return self.io.submit_write(job, total)

    def restore(self, storage: torch.UntypedStorage, chunks: Sequence[Chunk]) -> Transfer:  # noqa: D102
        parts = parts_of(chunks, self.slot_bytes)
        runs = [(p.file_offset, p.memory_offset, p.nbytes) for p in parts]
        job = self._job(storage, self._read_parts, parts)
        return self.io.submit_read(runs, job, sum(c.nbytes for c in chunks))

    def _job(
        self, storage: torch.UntypedStorage, move: _Move, parts: list[Part]
    ) -> Callable[[], None]:
        """``move`` of ``parts`` for the I/O thread, after the compute work queued so far.

        The job drops the storage before it ends: the store counts its references once the
        transfer is done (NOTE [cuda transfers]).
        """
        held = [bytes_of(storage)]
        after, owner = self.copier.mark(), storage._cdata

        def job() -> None:
            try:
                move(held[0], parts, after, owner)
            finally:
                held.clear()

        return job

    def _write_parts(self, flat: torch.Tensor, parts: list[Part], after: Fence, owner: int) -> None:
        count = len(self._slots)
        fences: list[Fence | None] = [None] * count
        started = 0
        try:
            for i, part in enumerate(parts):
                # Slots of the parts before ``i`` are written out: refill them ahead.
                while started < min(len(parts), i + count):
                    ahead = parts[started]
                    window = flat[ahead.memory_offset : ahead.memory_offset + ahead.nbytes]
                    buffer = self._slots[started % count][: ahead.nbytes]
                    fences[started % count] = self.copier.copy(buffer, window, after)
                    started += 1
                fence = fences[i % count]
                assert fence is not None
                fence.synchronize()
                self.io.write([_piece(part, self._slots[i % count], owner)])
        finally:  # never leave a copy into a slot running past the transfer
            _settle(fences)

    def _read_parts(self, flat: torch.Tensor, parts: list[Part], after: Fence, owner: int) -> None:
        count = len(self._slots)
        fences: list[Fence | None] = [None] * count
        try:
            for i, part in enumerate(parts):
                fence = fences[i % count]
                if fence is not None:  # the slot's copy to the device must be done first
                    fence.synchronize()
                buffer = self._slots[i % count]
                self.io.read([_piece(part, buffer, owner)])
                window = flat[part.memory_offset : part.memory_offset + part.nbytes]
                fences[i % count] = self.copier.copy(window, buffer[: part.nbytes], after)
        finally:  # never leave a copy out of a slot running past the transfer
            _settle(fences)

    def release(self, chunks: Sequence[Chunk]) -> None:  # noqa: D102
        self.io.release(chunks, self.slot_bytes)

    def close(self) -> None:  # noqa: D102
        self.io.close()
        self.copier.close()
        self._slots.clear()
