"""One tensor kept whole in the storage tier between uses, with exact accounting of its bytes.

NOTE [write-back residency]
Parameters, optimizer state and accumulated gradients change only at known points (an update, an
accumulation) but are read many times in between. So a tensor keeps the copy it last wrote to
the tier: while that copy is *clean*, leaving memory is only ``UntypedStorage.resize_(0)``, and
only a *dirty* tensor is written. The storage object stays the same through every move, so
autograd's saved views of it (``weight.t()``) see the bytes again once read back. A tensor
moves whole (a layer uses all its weights), in ``chunk_bytes`` chunks through the session's
sealed ``FileTransferEngine``.
"""

import time
from dataclasses import dataclass
from enum import StrEnum

import torch

from vtensor.errors import IllegalMoveError, VTensorError
from vtensor.io.chunk import split_into_chunks
from vtensor.io.transfer import Transfer, TransferEngine
from vtensor.planner.trace import TensorKind


class Residency(StrEnum):
    """Where an offloaded tensor's bytes are."""

    RESIDENT = "resident"  # in memory (the tier may also hold them: see ``clean``)
    WRITING = "writing"  # a write to the tier is in flight; memory still valid
    STORED = "stored"  # only in the tier; the storage holds no bytes
    READING = "reading"  # a read is in flight; memory allocated, not valid yet


_LEGAL: dict[Residency, frozenset[Residency]] = {
    Residency.RESIDENT: frozenset({Residency.WRITING, Residency.STORED}),
    Residency.WRITING: frozenset({Residency.RESIDENT}),
    Residency.STORED: frozenset({Residency.READING}),
    Residency.READING: frozenset({Residency.RESIDENT}),
}


@dataclass
class ResidentMeter:
    """Exact bytes of parameters, gradients and optimizer state in memory, and their peak."""

    resident_bytes: int = 0
    peak_bytes: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    stall_s: float = 0.0

    def add(self, nbytes: int) -> None:
        """``nbytes`` more are held in memory."""
        self.resident_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.resident_bytes)

    def sub(self, nbytes: int) -> None:
        """``nbytes`` were released."""
        self.resident_bytes -= nbytes
        assert self.resident_bytes >= 0, "resident bytes went negative"

    def reset_peak(self) -> None:
        """Start a new peak from the bytes held now."""
        self.peak_bytes = self.resident_bytes


class OffloadedTensor:
    """A tensor whose storage moves whole between memory and the storage tier.

    ``pins`` counts the uses that need it in memory now (only an unpinned one may leave);
    ``wanted`` marks a prefetch that a coming use will pin.
    """

    def __init__(
        self,
        tensor: torch.Tensor,
        name: str,
        engine: TransferEngine,
        meter: ResidentMeter,
        chunk_bytes: int,
        kind: TensorKind,
    ) -> None:
        self.tensor = tensor
        self.name = name
        self.kind = kind
        self.storage = tensor.untyped_storage()
        self.nbytes = self.storage.nbytes()
        self.chunks = split_into_chunks(self.nbytes, chunk_bytes)
        self.engine = engine
        self.meter = meter
        self.state = Residency.RESIDENT
        self.clean = False
        self.pins = 0
        self.wanted = False
        self._transfer: Transfer | None = None
        meter.add(self.nbytes)

    def _move(self, new: Residency) -> None:
        if new not in _LEGAL[self.state]:
            raise IllegalMoveError(
                f"offloaded tensor {self.name!r} cannot move from {self.state.value!r} to "
                f"{new.value!r}; legal: {sorted(s.value for s in _LEGAL[self.state])}"
            )
        self.state = new

    @property
    def in_memory(self) -> bool:
        """True when its bytes are allocated (resident, being written or being read)."""
        return self.state is not Residency.STORED

    def start_write(self) -> None:
        """Start writing the (dirty) bytes to the tier; they stay valid in memory meanwhile."""
        if self.clean:
            raise IllegalMoveError(f"{self.name!r} is clean: its tier copy is already current")
        self._move(Residency.WRITING)
        self.engine.release(self.chunks)  # the stale copy's extents and tags
        self._transfer = self.engine.evict(self.storage, self.chunks)

    def done(self) -> bool:
        """True when no transfer is in flight or the one in flight has finished."""
        return self._transfer is None or self._transfer.done()

    def complete(self) -> None:
        """Wait for the transfer in flight, if any; afterwards the tensor is resident and clean."""
        transfer = self._transfer
        if transfer is None:
            return
        begin = time.perf_counter()
        waited = not transfer.done()
        try:
            transfer.wait()
        except Exception as error:
            self._transfer = None
            self.state = Residency.RESIDENT
            if self.clean:  # a failed read: the memory holds no valid bytes
                raise VTensorError(
                    f"reading {self.name!r} back failed; its bytes are lost"
                ) from error
            raise  # a failed write: the bytes are still in memory, dirty
        finally:
            if waited:
                self.meter.stall_s += time.perf_counter() - begin
        self._transfer = None
        if self.state is Residency.WRITING:
            self.meter.bytes_out += self.nbytes
        else:
            self.meter.bytes_in += self.nbytes
        self._move(Residency.RESIDENT)
        self.clean = True

    def fetch(self) -> None:
        """If the bytes are only in the tier, allocate the storage again and start reading."""
        if self.state is Residency.STORED:
            self._move(Residency.READING)
            self.storage.resize_(self.nbytes)
            self.meter.add(self.nbytes)
            self._transfer = self.engine.restore(self.storage, self.chunks)

    def drop(self) -> None:
        """Release the memory of a clean, unpinned, resident tensor (the tier keeps its bytes)."""
        if self.pins or not self.clean:
            raise IllegalMoveError(
                f"{self.name!r} cannot leave memory: pins={self.pins}, clean={self.clean}"
            )
        self._move(Residency.STORED)
        self.storage.resize_(0)
        self.meter.sub(self.nbytes)
        self.wanted = False

    def mark_dirty(self) -> None:
        """The bytes in memory were changed (an update): the tier copy is stale."""
        if self.state is not Residency.RESIDENT:
            raise IllegalMoveError(f"{self.name!r} changed while {self.state.value}")
        self.clean = False

    def discard(self) -> None:
        """Forget the tensor (a gradient after its update): free its extents, stop counting it."""
        if self._transfer is not None:
            self._transfer.wait()
            self._transfer = None
        self.engine.release(self.chunks)
        if self.in_memory:
            self.meter.sub(self.nbytes)
        self.state = Residency.STORED
        self.pins = 0
