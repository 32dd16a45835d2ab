"""The records of the chunk store: a vTensor, a transfer in flight, the transfer counters."""

from dataclasses import dataclass, field

import torch

from vtensor.io.chunk import Chunk, ChunkState
from vtensor.io.transfer import Transfer


@dataclass
class Pending:
    """A transfer in flight for some chunks of one vTensor."""

    transfer: Transfer
    chunks: list[Chunk]
    outgoing: bool


@dataclass(eq=False, slots=True)
class VTensor:
    """One saved storage, virtualized into chunks. Views of it share this one record.

    Attributes:
        storage: full size when released in place (NOTE [release in place]), the resident
            prefix on the copy path.
        chunks: the chunks that can leave (in place: whole pages; else the storage, by its tail).
        handles: live pack handles (autograd's references to it).
        resident_bytes: bytes of the chunks on the device and idle (what an eviction can take).
        movable_bytes: bytes of all chunks (``nbytes`` less the partial end pages in place).
    """

    vid: int
    storage: torch.UntypedStorage | None
    nbytes: int
    chunks: list[Chunk]
    saved_step: int
    handles: int = 0
    pending: Pending | None = None
    dead: bool = False
    uses: list[int] = field(default_factory=list)
    resident_bytes: int = 0
    movable_bytes: int = 0
    released_bytes: int = 0
    in_place: bool = False

    def device_chunks(self) -> list[Chunk]:
        """Chunks resident and idle on the device."""
        return [c for c in self.chunks if c.state == ChunkState.DEVICE]

    def offloaded_chunks(self) -> list[Chunk]:
        """Chunks held by a slower tier."""
        return [c for c in self.chunks if c.state in (ChunkState.HOST, ChunkState.STORAGE)]

    def fully_resident(self) -> bool:
        """True when every chunk is on the device and idle."""
        return all(c.state == ChunkState.DEVICE for c in self.chunks)


@dataclass
class StoreStats:
    """Transfer counters, accumulated until read and reset by the session."""

    bytes_out: int = 0
    bytes_in: int = 0
    transfer_s: float = 0.0
    write_s: float = 0.0  # of ``transfer_s``, the evictions'
    stall_s: float = 0.0
    copied_bytes: int = 0  # resident prefixes copied by resize_ (the copy path only)
