"""The staged engine (NOTE [staged swap] in vtensor/io/staged.py), with CPU tensors as the device.

The copier is injected: ``HostCopier`` copies at once, ``LaggingCopier`` copies later on its own
thread, in order, as a side stream would, so a slot read before its copy ended shows up as
wrong bytes.
"""

import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from vtensor.errors import SwapAuthenticationError, VTensorError
from vtensor.io.chunk import ChunkState, split_into_chunks
from vtensor.io.staged import StagedTransferEngine, parts_of
from vtensor.io.tiers import StorageTier

KIB = 1 << 10


class Done:
    """A fence already reached."""

    def synchronize(self) -> None:
        pass


class HostCopier:
    """Copies between CPU "device" tensors and plain staging buffers, at once.

    Checks that every copy has one end inside a staging buffer and fits it.
    """

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.staged_bytes = 0  # every staging byte ever allocated
        self.copies = 0

    def staging(self, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.buffers.append(buffer)
        self.staged_bytes += nbytes
        return buffer

    def mark(self) -> Done:
        return Done()

    def _check(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        def staged(t: torch.Tensor) -> bool:
            return any(
                b.data_ptr() <= t.data_ptr()
                and t.data_ptr() + t.numel() <= b.data_ptr() + b.numel()
                for b in self.buffers
            )

        assert staged(dst) != staged(src), "a copy must go through exactly one staging slot"
        assert dst.numel() == src.numel()
        self.copies += 1

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Done) -> Done:
        self._check(dst, src)
        dst.copy_(src)
        return Done()

    def close(self) -> None:
        pass


class Later:
    """A fence reached once the lagging copier's thread has run the copy."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def synchronize(self) -> None:
        assert self.event.wait(10), "a copy never ran"


class LaggingCopier(HostCopier):
    """Runs copies on its own thread, in order and late, as a side stream would."""

    def __init__(self) -> None:
        super().__init__()
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (work := self._queue.get()) is not None:
            time.sleep(0.002)
            work()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Done) -> Later:  # type: ignore[override]
        self._check(dst, src)
        fence = Later()

        def work() -> None:
            dst.copy_(src)
            fence.event.set()

        self._queue.put(work)
        return fence

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


def _engine(
    directory: Path, copier: HostCopier, *, encrypt: bool = True, slots: int = 2
) -> StagedTransferEngine:
    return StagedTransferEngine(
        StorageTier(directory), copier, slot_bytes=64 * KIB, slots=slots, encrypt=encrypt
    )


def _round_trip(engine: StagedTransferEngine, nbytes: int, chunk_bytes: int | None) -> None:
    """Evict the tail chunks of a random tensor, shrink it, grow it, restore, compare."""
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator())
    expected = data.clone()
    storage = data.untyped_storage()
    chunks = split_into_chunks(nbytes, chunk_bytes)
    tail = chunks[1:] or chunks
    for chunk in tail:
        chunk.move(ChunkState.EVICTING)
    engine.evict(storage, tail).wait()
    for chunk in tail:
        chunk.move(ChunkState.STORAGE)
    storage.resize_(tail[0].offset_bytes)
    storage.resize_(nbytes)
    for chunk in tail:
        chunk.move(ChunkState.RESTORING)
    engine.restore(storage, tail).wait()
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
    assert torch.equal(whole, expected)
    engine.release(tail)


@pytest.mark.parametrize("encrypt", [True, False])
@pytest.mark.parametrize("slots", [1, 2, 3])
@pytest.mark.parametrize("lagging", [False, True], ids=["at-once", "lagging"])
def test_staged_engine_round_trips_bytes(
    tmp_storage_dir: Path, encrypt: bool, slots: int, lagging: bool
) -> None:
    copier = LaggingCopier() if lagging else HostCopier()
    engine = _engine(tmp_storage_dir, copier, encrypt=encrypt, slots=slots)
    try:
        _round_trip(engine, 1000 * KIB + 123, 256 * KIB)  # chunks of 4 parts, a short last one
        _round_trip(engine, 40 * KIB, None)  # one chunk, smaller than a slot
        _round_trip(engine, 300 * KIB + 1, 100 * KIB)  # chunks not a whole number of slots
        assert engine.tier.extents.used_bytes == 0
        if engine.sealer is not None:
            assert engine.sealer.sealed_segments == 0
    finally:
        engine.close()


def test_staged_engine_never_holds_more_staging_than_its_slots(tmp_storage_dir: Path) -> None:
    copier = HostCopier()
    engine = _engine(tmp_storage_dir, copier, slots=2)
    try:
        assert engine.pinned_bytes == copier.staged_bytes == 2 * 64 * KIB
        for _ in range(3):
            _round_trip(engine, 4 << 20, 1 << 20)  # 64 parts of one slot each per transfer
        assert copier.staged_bytes == engine.pinned_bytes  # the slots were reused, never grown
        assert copier.copies == 3 * 2 * (3 << 20) // (64 * KIB)
    finally:
        engine.close()


def test_staged_swap_file_holds_no_plaintext(tmp_storage_dir: Path) -> None:
    pattern = b"vtensor-plaintext-marker-"
    nbytes = 512 * KIB
    payload = (pattern * (nbytes // len(pattern) + 1))[:nbytes]
    seen = {}
    for encrypt in (True, False):
        engine = _engine(tmp_storage_dir, HostCopier(), encrypt=encrypt)
        try:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            chunks = split_into_chunks(nbytes, 128 * KIB)
            engine.evict(data.untyped_storage(), chunks).wait()
            seen[encrypt] = os.pread(engine.tier.fd, engine.tier.extents.end_bytes, 0)
            engine.release(chunks)
        finally:
            engine.close()
    assert pattern in seen[False]  # the check can see plaintext where there is some
    assert pattern not in seen[True]
    assert len(seen[True]) >= nbytes


def test_staged_engine_rejects_a_tampered_part(tmp_storage_dir: Path) -> None:
    engine = _engine(tmp_storage_dir, HostCopier())
    try:
        data = torch.randint(0, 256, (256 * KIB,), dtype=torch.uint8, generator=torch.Generator())
        storage = data.untyped_storage()
        chunks = split_into_chunks(data.numel(), None)
        engine.evict(storage, chunks).wait()
        second = parts_of(chunks, engine.slot_bytes)[1]
        first = parts_of(chunks, engine.slot_bytes)[0]
        # The second part's extent replaced by the first's: another part of the same chunk.
        os.pwrite(
            engine.tier.fd,
            os.pread(engine.tier.fd, 64 * KIB, first.file_offset),
            second.file_offset,
        )
        with pytest.raises(SwapAuthenticationError, match=f"at {64 * KIB} in the chunk"):
            engine.restore(storage, chunks).wait()
    finally:
        engine.close()


def test_staged_engine_rejects_a_bad_slot_setting(tmp_storage_dir: Path) -> None:
    tier = StorageTier(tmp_storage_dir)
    try:
        with pytest.raises(VTensorError, match="slots=0"):
            StagedTransferEngine(tier, HostCopier(), slots=0)
        with pytest.raises(VTensorError, match="slot_bytes=0"):
            StagedTransferEngine(tier, HostCopier(), slot_bytes=0)
    finally:
        tier.close()
