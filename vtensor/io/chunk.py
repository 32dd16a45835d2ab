"""vTensor chunks: identity, sizes, residency states and the legal moves between them."""

import math
from dataclasses import dataclass
from enum import StrEnum

from vtensor.errors import IllegalMoveError

# NOTE [default chunk size]
# 1 MiB: smaller chunks barely cut the bytes swapped but make every transfer syscall-bound. It is
# a multiple of every page size in use (4, 16 and 64 KiB), so file offsets stay page-aligned.
DEFAULT_CHUNK_BYTES = 1 << 20


class ChunkState(StrEnum):
    """Where a chunk's bytes are."""

    DEVICE = "device"  # resident in the budgeted tier
    EVICTING = "evicting"  # copy to a slower tier in flight; device bytes still valid
    HOST = "host"  # in pinned host memory (CUDA only)
    STORAGE = "storage"  # in the swap file
    RESTORING = "restoring"  # copy back in flight; device bytes not valid yet
    FREED = "freed"  # the vTensor died; terminal


# NOTE [chunk residency]
# DEVICE -> EVICTING -> {HOST, STORAGE} -> RESTORING -> DEVICE is the swap cycle.
# EVICTING -> DEVICE cancels an eviction (the bytes were needed before the write finished, or the
# write failed): the device copy was never released, so nothing is lost.
# FREED is reachable only from states where no transfer is in flight: a dying vTensor first waits
# for its transfers.
LEGAL_MOVES: dict[ChunkState, frozenset[ChunkState]] = {
    ChunkState.DEVICE: frozenset({ChunkState.EVICTING, ChunkState.FREED}),
    ChunkState.EVICTING: frozenset({ChunkState.HOST, ChunkState.STORAGE, ChunkState.DEVICE}),
    ChunkState.HOST: frozenset({ChunkState.RESTORING, ChunkState.FREED}),
    ChunkState.STORAGE: frozenset({ChunkState.RESTORING, ChunkState.FREED}),
    ChunkState.RESTORING: frozenset({ChunkState.DEVICE}),
    ChunkState.FREED: frozenset(),
}


@dataclass
class Chunk:
    """One fixed-size piece of a vTensor's bytes.

    Attributes:
        offset_bytes: start within the vTensor's storage.
        slot: where the bytes are in the slower tier while not on the device, else None.
    """

    index: int
    offset_bytes: int
    nbytes: int
    state: ChunkState = ChunkState.DEVICE
    slot: int | None = None

    def move(self, new_state: ChunkState) -> None:
        """Change residency, raising if the transition is not legal."""
        if new_state not in LEGAL_MOVES[self.state]:
            raise IllegalMoveError(
                f"chunk {self.index} (offset {self.offset_bytes}, {self.nbytes} bytes) cannot move "
                f"from {self.state.value!r} to {new_state.value!r}; legal: "
                f"{sorted(s.value for s in LEGAL_MOVES[self.state]) or 'none (terminal)'}"
            )
        self.state = new_state


def split_into_chunks(nbytes: int, chunk_bytes: int | None) -> list[Chunk]:
    """Cut ``nbytes`` into chunks of ``chunk_bytes`` (None: one chunk, the whole tensor)."""
    if nbytes <= 0:
        return []
    size = nbytes if chunk_bytes is None else chunk_bytes
    count = math.ceil(nbytes / size)
    return [Chunk(i, i * size, min(size, nbytes - i * size)) for i in range(count)]


def split_on_pages(
    address: int, nbytes: int, chunk_bytes: int | None, page_bytes: int
) -> tuple[list[Chunk], int]:
    """Cut the whole pages of ``[address, address + nbytes)`` into page-aligned chunks.

    A chunk released in place must be whole pages (NOTE [release in place]): the partial end
    pages never leave, and ``chunk_bytes`` is rounded up to whole pages.

    Returns:
        The chunks (offsets relative to ``address``) and the bytes that never leave.
    """
    lead = -address % page_bytes
    interior = max(0, (nbytes - lead) // page_bytes * page_bytes)
    if interior == 0:
        return [], nbytes
    size = interior if chunk_bytes is None else -(-chunk_bytes // page_bytes) * page_bytes
    count = math.ceil(interior / size)
    chunks = [Chunk(i, lead + i * size, min(size, interior - i * size)) for i in range(count)]
    return chunks, nbytes - interior
