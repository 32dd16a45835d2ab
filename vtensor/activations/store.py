"""Where each vTensor chunk lives: adoption of saved storages, evictions, restores, frees."""

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from vtensor.errors import SwapAuthenticationError, VTensorError
from vtensor.io.chunk import Chunk, ChunkState, split_into_chunks
from vtensor.io.pages import PAGE_BYTES, release
from vtensor.io.transfer import CudaTransferEngine, Transfer, TransferEngine

logger = logging.getLogger(__name__)

_use_count = torch._C._storage_Use_Count
_RESIDENT = (ChunkState.DEVICE, ChunkState.EVICTING, ChunkState.RESTORING)


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
        vid: identity within the session, in pack order.
        storage: the storage. Released in place (NOTE [release in place] in ``io/pages.py``)
            it keeps its full size; on the copy path its size is the resident prefix.
        nbytes: full size of the storage.
        chunks: its chunks; the resident ones always form a prefix (eviction takes the tail).
        saved_step: step index at which it was first packed.
        handles: live pack handles (autograd's references to it).
        prefix_bytes: bytes of the resident prefix (the chunks before the first one away).
        released_bytes: bytes of the whole pages handed back to the kernel in place.
        in_place: evicted chunks release their pages in place instead of shrinking the storage.
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
    prefix_bytes: int = 0
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
    stall_s: float = 0.0
    copied_bytes: int = 0  # resident prefixes copied by resize_ (the copy path only)


class ChunkStore:
    """Owns the vTensors of a session and carries out the moves a policy asks for."""

    def __init__(self, engine: TransferEngine, chunk_bytes: int | None) -> None:
        self.engine = engine
        # Where evicted chunks land: pinned host memory on CUDA, the swap file otherwise.
        cuda = isinstance(engine, CudaTransferEngine)
        self._offloaded = ChunkState.HOST if cuda else ChunkState.STORAGE
        # NOTE [release in place]: CPU storages release evicted pages where they lie; chunks
        # smaller than a page hold no whole page to release and take the copy path.
        self._in_place = not cuda and (chunk_bytes is None or chunk_bytes >= PAGE_BYTES)
        # Bytes of pages released in place and not yet restored or freed, over all records:
        # the heap counter still counts them as allocated, so the tracked bytes subtract them.
        self.released_bytes = 0
        self.chunk_bytes = chunk_bytes
        self.records: dict[int, VTensor] = {}
        self._by_storage: dict[int, VTensor] = {}
        self._next_vid = 0
        self._owner = threading.get_ident()
        self._deferred: list[VTensor] = []  # died on another thread or with a transfer in flight
        self._lock = threading.Lock()
        # Records with a transfer in flight, by vid: asked at every hook point, so kept apart
        # instead of found by scanning every record.
        self._in_flight: dict[int, VTensor] = {}
        self.stats = StoreStats()
        # Bumped whenever the store resizes or drops a storage, so a caller can tell that a
        # reading of the tracked bytes taken since (with no op run in between) is still current.
        self.memory_epoch = 0

    # -- adoption and death -------------------------------------------------------------------
    def adopt(self, storage: torch.UntypedStorage, step: int) -> VTensor:
        """The record of ``storage``, created on first sight (views and aliases share one)."""
        record = self._by_storage.get(storage._cdata)
        if record is not None and not record.dead:
            return record
        nbytes = storage.nbytes()
        record = VTensor(
            self._next_vid,
            storage,
            nbytes,
            split_into_chunks(nbytes, self.chunk_bytes),
            step,
            prefix_bytes=nbytes,
            # Shared-memory and file-backed pages are not private: they take the copy path.
            in_place=self._in_place and not storage.is_shared(),
        )
        self._next_vid += 1
        self.records[record.vid] = record
        # Keyed by the StorageImpl address: safe because the record holds the storage, so the
        # address cannot be recycled while the key exists.
        self._by_storage[storage._cdata] = record
        return record

    def drop_handle(self, record: VTensor) -> None:
        """Called when autograd releases one handle; frees the record with its last handle."""
        record.handles -= 1
        if record.handles > 0:
            return
        if threading.get_ident() != self._owner or record.pending is not None:
            with self._lock:
                self._deferred.append(record)
            return
        self._free(record)

    def _free(self, record: VTensor) -> None:
        if record.dead:
            return
        record.dead = True
        self.engine.release([c for c in record.chunks if c.slot is not None])
        for chunk in record.chunks:
            if chunk.state in (ChunkState.DEVICE, ChunkState.HOST, ChunkState.STORAGE):
                chunk.move(ChunkState.FREED)
        if record.storage is not None:
            self._by_storage.pop(record.storage._cdata, None)
        record.storage = None
        self.released_bytes -= record.released_bytes
        record.released_bytes = 0
        self.memory_epoch += 1
        self.records.pop(record.vid, None)

    def collect(self) -> None:
        """Free records that died on another thread or while a transfer was in flight."""
        with self._lock:
            deferred, self._deferred = self._deferred, []
        for record in deferred:
            if record.pending is not None:
                self._finish(record)
            self._free(record)

    # -- queries ------------------------------------------------------------------------------
    def own_references(self, record: VTensor) -> int:
        """References to the storage held by this store: the record and one alias per handle."""
        return 1 + record.handles

    def evictable(self, record: VTensor) -> bool:
        """True when no one but the store references the storage and nothing is in flight."""
        return self.evictable_bytes(record) > 0

    def evictable_bytes(self, record: VTensor) -> int:
        """Device bytes of ``record`` that an eviction could release now."""
        # With nothing in flight the resident prefix is exactly its DEVICE chunks; reading it
        # is O(1). This is asked of every record at every hook point, so the checks of
        # ``evictable`` and ``own_references`` are written out here.
        storage = record.storage
        if storage is None or record.dead or record.pending is not None:
            return 0
        nbytes = record.prefix_bytes
        # Only the store's own references (the record and one alias per handle, see
        # ``own_references``): the temporary reference of this call's own ``_cdata`` lookup
        # is not counted, but the record's Python storage object is.
        if nbytes == 0 or _use_count(storage._cdata) != 1 + record.handles:
            return 0
        return nbytes

    def device_bytes(self) -> int:
        """Bytes the managed storages occupy on the device now."""
        return sum(
            r.storage.nbytes() - r.released_bytes
            for r in self.records.values()
            if r.storage is not None
        )

    def in_flight(self) -> list[VTensor]:
        """Records with a transfer in flight, in vid order."""
        if len(self._in_flight) < 2:
            return list(self._in_flight.values())
        return sorted(self._in_flight.values(), key=_vid)

    def outgoing_bytes(self) -> int:
        """Bytes of the evictions in flight (still resident until their writes complete)."""
        total = 0
        for record in self._in_flight.values():
            pending = record.pending
            if pending is not None and pending.outgoing:
                total += sum(c.nbytes for c in pending.chunks)
        return total

    def _start(self, record: VTensor, pending: Pending) -> None:
        record.pending = pending
        self._in_flight[record.vid] = record

    def _settle(self, record: VTensor) -> None:
        record.pending = None
        self._in_flight.pop(record.vid, None)

    # -- moves --------------------------------------------------------------------------------
    def evict(self, record: VTensor, nbytes: int) -> int:
        """Start evicting tail chunks of ``record`` covering at least ``nbytes``; returns bytes."""
        tail: list[Chunk] = []
        covered = 0
        for chunk in reversed(record.device_chunks()):
            if covered >= nbytes:
                break
            tail.append(chunk)
            covered += chunk.nbytes
        if not tail:
            return 0
        tail.reverse()
        for chunk in tail:
            chunk.move(ChunkState.EVICTING)
        assert record.storage is not None
        self._start(record, Pending(self.engine.evict(record.storage, tail), tail, outgoing=True))
        return covered

    def restore(self, record: VTensor) -> None:
        """Start bringing every offloaded chunk of ``record`` back to the device."""
        chunks = record.offloaded_chunks()
        if not chunks or record.pending is not None:
            return
        assert record.storage is not None
        if record.in_place:
            # The released pages come back as the reads fill them: counted from now, as a
            # grown storage would be.
            self.released_bytes -= record.released_bytes
            record.released_bytes = 0
        else:
            self.stats.copied_bytes += record.prefix_bytes  # growing copies the prefix
            record.storage.resize_(record.nbytes)
        record.prefix_bytes = record.nbytes
        self.memory_epoch += 1
        for chunk in chunks:
            chunk.move(ChunkState.RESTORING)
        self._start(record, Pending(self.engine.restore(record.storage, chunks), chunks, False))

    def reap(self, *, block: bool = False, block_restores: bool = True) -> None:
        """Complete finished transfers (all in-flight ones when ``block``).

        With ``block_restores=False`` a blocking reap waits for evictions only: restores finish
        when they are done or when their vTensor is used.
        """
        for record in self.in_flight():
            pending = record.pending
            assert pending is not None
            must = block and (pending.outgoing or block_restores)
            if must or pending.transfer.done():
                self._finish(record)
        self.collect()

    def ensure_resident(self, record: VTensor) -> None:
        """Make every chunk of ``record`` valid on the device, waiting on transfers if needed."""
        if record.pending is not None and record.pending.outgoing:
            self._finish(record, cancel=True)
        if record.offloaded_chunks():
            self.restore(record)
        if record.pending is not None:
            self._finish(record)

    def _finish(self, record: VTensor, *, cancel: bool = False) -> None:
        pending = record.pending
        assert pending is not None
        begin = time.perf_counter()
        already_done = pending.transfer.done()
        try:
            pending.transfer.wait()
        except Exception as error:
            self._rollback(record, pending, error)
            raise
        finally:
            if not already_done:  # compute waited on this transfer
                self.stats.stall_s += time.perf_counter() - begin
        self._settle(record)
        self.stats.transfer_s += pending.transfer.busy_s()
        if not pending.outgoing:
            for chunk in pending.chunks:
                chunk.move(ChunkState.DEVICE)
            self.engine.release(pending.chunks)
            self.stats.bytes_in += pending.transfer.nbytes
            return
        assert record.storage is not None
        still_ours = torch._C._storage_Use_Count(record.storage._cdata) == self.own_references(
            record
        )
        if cancel or record.dead or not still_ours:
            self._rollback(record, pending)
            return
        for chunk in pending.chunks:
            chunk.move(self._offloaded)
        prefix = pending.chunks[0].offset_bytes
        if record.in_place:
            # NOTE [release in place]: every page of the tail from the new prefix on; pages of
            # an earlier cut are released again (harmless) and counted once.
            storage = record.storage
            released = release(storage.data_ptr() + prefix, record.nbytes - prefix)
            self.released_bytes += released - record.released_bytes
            record.released_bytes = released
        else:
            self.stats.copied_bytes += prefix  # shrinking copies the prefix
            record.storage.resize_(prefix)
        record.prefix_bytes = prefix
        self.memory_epoch += 1
        self.stats.bytes_out += pending.transfer.nbytes

    def _rollback(
        self, record: VTensor, pending: Pending, error: BaseException | None = None
    ) -> None:
        self._settle(record)
        if pending.outgoing:
            for chunk in pending.chunks:
                chunk.move(ChunkState.DEVICE)
            self.engine.release(pending.chunks)
            return
        if isinstance(error, SwapAuthenticationError):
            raise error  # already names the chunk and the cause
        raise VTensorError(
            f"restoring vTensor {record.vid} failed; its swapped bytes are unrecoverable"
        ) from error

    def close(self) -> None:
        """Wait for transfers and drop every record."""
        for record in list(self.records.values()):
            if record.pending is not None:
                try:
                    self._finish(record)
                except Exception:  # closing anyway: the error was already raised once
                    logger.debug("transfer failed during close", exc_info=True)
            self._free(record)
        self._deferred.clear()


def _vid(record: VTensor) -> int:
    return record.vid
