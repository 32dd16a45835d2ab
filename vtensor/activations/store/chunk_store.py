"""Where each vTensor chunk lives: adoption of saved storages, evictions, restores, frees."""

import logging
import threading
import time
from collections.abc import Iterator, Sequence

import torch

from vtensor.activations.store.vtensors import Pending, StoreStats, VTensor
from vtensor.errors import SwapAuthenticationError, VTensorError
from vtensor.io.chunk import Chunk, ChunkState, split_into_chunks, split_on_pages
from vtensor.io.pages import PAGE_BYTES, populate, release
from vtensor.io.transfer import TransferEngine

__all__ = ["ChunkStore", "Pending", "StoreStats", "VTensor"]  # the records live in vtensors.py

logger = logging.getLogger(__name__)

_use_count = torch._C._storage_Use_Count
_RESIDENT = (ChunkState.DEVICE, ChunkState.EVICTING, ChunkState.RESTORING)


class ChunkStore:
    """Owns the vTensors of a session and carries out the moves a policy asks for."""

    def __init__(self, engine: TransferEngine, chunk_bytes: int | None) -> None:
        self.engine = engine
        self._offloaded = engine.lands_in
        # NOTE [release in place]: CPU storages release evicted pages where they lie; chunks
        # smaller than a page hold no whole page to release and take the copy path.
        self._in_place = engine.host_pages and (chunk_bytes is None or chunk_bytes >= PAGE_BYTES)
        # Pages released in place, not yet restored or freed: the heap counter still counts them.
        self.released_bytes = 0
        # Fault restored pages in at once, so a resident-page counter sees them as the heap does.
        self.populate_restores = False
        self.chunk_bytes = chunk_bytes
        self.records: dict[int, VTensor] = {}
        self._by_storage: dict[int, VTensor] = {}
        self.next_vid = 0  # vids rise in order of adoption
        self._owner = threading.get_ident()
        self._deferred: list[VTensor] = []  # died on another thread or with a transfer in flight
        self._lock = threading.Lock()
        # Records with a transfer in flight, by vid: asked at every hook point.
        self._in_flight: dict[int, VTensor] = {}
        self.stats = StoreStats()
        # Bumped whenever a storage is resized or dropped: an older reading is stale.
        self.memory_epoch = 0
        # Bytes of every restore started: the store's own growth (NOTE [step reserve]).
        self.restored_bytes = 0

    # -- adoption and death -------------------------------------------------------------------
    def adopt(self, storage: torch.UntypedStorage, step: int) -> VTensor:
        """The record of ``storage``, created on first sight (views and aliases share one)."""
        record = self._by_storage.get(storage._cdata)
        if record is not None and not record.dead:
            return record
        nbytes = storage.nbytes()
        # Shared-memory and file-backed pages are not private: they take the copy path.
        in_place = self._in_place and not storage.is_shared()
        if in_place:
            chunks, _ = split_on_pages(storage.data_ptr(), nbytes, self.chunk_bytes, PAGE_BYTES)
        else:
            chunks = split_into_chunks(nbytes, self.chunk_bytes)
        movable = sum(c.nbytes for c in chunks)
        record = VTensor(
            self.next_vid,
            storage,
            nbytes,
            chunks,
            step,
            resident_bytes=movable,
            movable_bytes=movable,
            in_place=in_place,
        )
        self.next_vid += 1
        self.records[record.vid] = record
        # The record holds the storage, so its StorageImpl address cannot be recycled.
        self._by_storage[storage._cdata] = record
        return record

    def known(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` has a live record."""
        record = self._by_storage.get(storage._cdata)
        return record is not None and not record.dead

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

    def collect_off_owner(self) -> None:
        """``collect`` off the owner's thread (CUDA backward runs on autograd's device thread)."""
        if threading.get_ident() != self._owner:
            self.collect()

    # -- queries ------------------------------------------------------------------------------
    def evictable(self, record: VTensor) -> bool:
        """True when no one but the store references the storage and nothing is in flight."""
        return self.evictable_bytes(record) > 0

    def evictable_bytes(self, record: VTensor) -> int:
        """Device bytes of ``record`` that an eviction could release now."""
        if record.storage is None or record.dead or record.pending is not None:
            return 0
        nbytes = record.resident_bytes
        return nbytes if nbytes and _own(record) else 0

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
        """Start evicting tail chunks of ``record`` covering at least ``nbytes``; returns bytes.

        The tail is the one choice the copy path can also make.
        """
        tail: list[Chunk] = []
        covered = 0
        for chunk in reversed(record.device_chunks()):
            if covered >= nbytes:
                break
            tail.append(chunk)
            covered += chunk.nbytes
        tail.reverse()
        return self.evict_chunks(record, tail)

    def evict_chunks(self, record: VTensor, chunks: Sequence[Chunk]) -> int:
        """Start evicting exactly ``chunks`` of ``record`` (resident and idle); returns bytes.

        Raises:
            VTensorError: a chunk is not resident and idle, or is not a tail on the copy path.
        """
        if not chunks:
            return 0
        if record.pending is not None or any(c.state != ChunkState.DEVICE for c in chunks):
            raise VTensorError(
                f"vTensor {record.vid}: only resident, idle chunks can be evicted "
                f"(asked for chunks {[c.index for c in chunks]} with a transfer in flight or "
                "away); wait for its transfer or restore it first"
            )
        if not record.in_place:
            resident = record.device_chunks()
            if list(chunks) != resident[len(resident) - len(chunks) :]:
                raise VTensorError(
                    f"vTensor {record.vid} is shrunk by copying its prefix, so only a tail of "
                    f"its resident chunks can leave, not chunks {[c.index for c in chunks]}"
                )
        covered = 0
        for chunk in chunks:
            chunk.move(ChunkState.EVICTING)
            covered += chunk.nbytes
        assert record.storage is not None
        transfer = self.engine.evict(record.storage, list(chunks))
        self._start(record, Pending(transfer, list(chunks), outgoing=True))
        record.resident_bytes -= covered
        return covered

    def restore(self, record: VTensor) -> None:
        """Start bringing every offloaded chunk of ``record`` back to the device."""
        chunks = record.offloaded_chunks()
        if not chunks or record.pending is not None:
            return
        assert record.storage is not None
        if record.in_place:
            # Counted from now, as a grown storage would be.
            if self.populate_restores:
                _populate_chunks(record.storage.data_ptr(), chunks)
            self.released_bytes -= record.released_bytes
            record.released_bytes = 0
        else:
            self.stats.copied_bytes += record.resident_bytes  # growing copies the prefix
            record.storage.resize_(record.nbytes)
        self.memory_epoch += 1
        self.restored_bytes += sum(c.nbytes for c in chunks)
        for chunk in chunks:
            chunk.move(ChunkState.RESTORING)
        self._start(record, Pending(self.engine.restore(record.storage, chunks), chunks, False))

    def reap(self, *, block: bool = False, block_restores: bool = True) -> None:
        """Complete finished transfers; ``block``: wait for evictions (and restores if asked)."""
        if not self._in_flight and not self._deferred:
            # Fast path: a lean replay asks at every boundary.
            return
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
        busy_s = pending.transfer.busy_s()
        self.stats.transfer_s += busy_s
        if not pending.outgoing:
            self._back_on_device(record, pending.chunks)
            self.stats.bytes_in += pending.transfer.nbytes
            return
        self.stats.write_s += busy_s
        assert record.storage is not None
        if cancel or record.dead or not _own(record):
            self._rollback(record, pending)
            return
        for chunk in pending.chunks:
            chunk.move(self._offloaded)
        if record.in_place:
            # NOTE [release in place]: the chunks are whole pages, so exactly their bytes go.
            released = _release_chunks(record.storage.data_ptr(), pending.chunks)
            self.released_bytes += released
            record.released_bytes += released
        else:
            prefix = pending.chunks[0].offset_bytes
            self.stats.copied_bytes += prefix  # shrinking copies the prefix
            record.storage.resize_(prefix)
        self.memory_epoch += 1
        self.stats.bytes_out += pending.transfer.nbytes

    def _rollback(
        self, record: VTensor, pending: Pending, error: BaseException | None = None
    ) -> None:
        self._settle(record)
        if pending.outgoing:
            self._back_on_device(record, pending.chunks)
            return
        if isinstance(error, SwapAuthenticationError):
            raise error  # already names the chunk and the cause
        raise VTensorError(
            f"restoring vTensor {record.vid} failed; its swapped bytes are unrecoverable"
        ) from error

    def _back_on_device(self, record: VTensor, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            chunk.move(ChunkState.DEVICE)
        self.engine.release(chunks)
        record.resident_bytes += sum(c.nbytes for c in chunks)

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


def _own(record: VTensor) -> bool:
    """Only the store references the storage: the record and one alias per handle.

    The ``_cdata`` lookup adds no reference; the record's storage object counts as one.
    """
    assert record.storage is not None
    return bool(_use_count(record.storage._cdata) == 1 + record.handles)


def _page_runs(chunks: Sequence[Chunk]) -> Iterator[tuple[int, int]]:
    """(offset, bytes) of each contiguous run of ``chunks`` in their storage, in order."""
    start = end = -1
    for chunk in sorted(chunks, key=lambda c: c.offset_bytes):
        if chunk.offset_bytes != end:
            if end > start:
                yield start, end - start
            start = chunk.offset_bytes
        end = chunk.offset_bytes + chunk.nbytes
    if end > start:
        yield start, end - start


def _populate_chunks(address: int, chunks: Sequence[Chunk]) -> None:
    """Fault in the pages of ``chunks``, one call per contiguous run."""
    for offset, nbytes in _page_runs(chunks):
        populate(address + offset, nbytes)


def _release_chunks(address: int, chunks: Sequence[Chunk]) -> int:
    """Release the pages of ``chunks``, one call per contiguous run."""
    return sum(release(address + offset, nbytes) for offset, nbytes in _page_runs(chunks))
