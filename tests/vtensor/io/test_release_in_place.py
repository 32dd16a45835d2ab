"""Chunks leave memory in place (NOTE [release in place] in vtensor/io/pages.py): no copies."""

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import vtensor
from vtensor.activations.runtime.hooks import SavedHandle
from vtensor.activations.store.chunk_store import ChunkStore, VTensor
from vtensor.errors import VTensorError
from vtensor.io.chunk import ChunkState, split_on_pages
from vtensor.io.pages import PAGE_BYTES, release, whole_pages
from vtensor.io.tiers import StorageTier
from vtensor.io.transfer import FileTransferEngine
from vtensor.measure.rss import RssMeter, rss_is_honest

MIB = 1 << 20


def test_whole_pages_are_only_those_strictly_inside_the_range() -> None:
    assert whole_pages(PAGE_BYTES, 3 * PAGE_BYTES) == (PAGE_BYTES, 3 * PAGE_BYTES)
    assert whole_pages(PAGE_BYTES + 1, 3 * PAGE_BYTES) == (2 * PAGE_BYTES, 2 * PAGE_BYTES)
    assert whole_pages(PAGE_BYTES + 1, PAGE_BYTES) == (2 * PAGE_BYTES, 0)


def test_released_pages_read_as_zeros_and_the_rest_is_untouched() -> None:
    data = torch.full((4 * MIB,), 7, dtype=torch.uint8)
    address = data.data_ptr() + 12345
    released = release(address, 2 * MIB)
    start, length = whole_pages(address, 2 * MIB)
    assert released == length > 2 * MIB - 2 * PAGE_BYTES
    first = start - data.data_ptr()
    assert torch.all(data[first : first + length] == 0)  # never the old bytes
    assert torch.all(data[:first] == 7) and torch.all(data[first + length :] == 7)


def _store(tmp_path: Path) -> ChunkStore:
    return ChunkStore(FileTransferEngine(StorageTier(tmp_path)), 1 * MIB)


@contextlib.contextmanager
def _opened(store: ChunkStore) -> Iterator[ChunkStore]:
    """``store``, closed with its engine afterwards."""
    try:
        yield store
    finally:
        store.close()
        store.engine.close()


def _adopted(store: ChunkStore, data: torch.Tensor) -> tuple[VTensor, SavedHandle]:
    """``data``'s storage in ``store``, referenced only as autograd would (one handle)."""
    record = store.adopt(data.untyped_storage(), step=0)
    return record, SavedHandle(store, record, data[:1])


def _bytes_of(record: VTensor) -> torch.Tensor:
    assert record.storage is not None
    return torch.empty(0, dtype=torch.uint8).set_(record.storage)


def test_chunks_are_the_whole_pages_inside_the_storage() -> None:
    chunks, fixed = split_on_pages(PAGE_BYTES - 100, 3 * MIB, MIB, PAGE_BYTES)
    assert chunks[0].offset_bytes == 100 and all(c.nbytes == MIB for c in chunks[:-1])
    assert sum(c.nbytes for c in chunks) + fixed == 3 * MIB
    assert fixed == 100 + (3 * MIB - 100) % PAGE_BYTES  # the two partial pages
    assert split_on_pages(PAGE_BYTES - 100, PAGE_BYTES, MIB, PAGE_BYTES) == ([], PAGE_BYTES)
    odd, _ = split_on_pages(0, 10 * PAGE_BYTES, PAGE_BYTES + 1, PAGE_BYTES)  # rounded up
    assert [c.nbytes for c in odd] == [2 * PAGE_BYTES] * 5


def test_any_chunk_leaves_in_place_and_restore_reads_it_back(tmp_path: Path) -> None:
    with _opened(_store(tmp_path)) as store:
        data = torch.randint(0, 256, (8 * MIB + 100,), dtype=torch.uint8)
        expected, address = data.clone(), data.data_ptr()
        record, handle = _adopted(store, data)
        del data
        middle = record.chunks[2:4]  # not a tail: released in place, any chunk can leave
        assert store.evict_chunks(record, middle) == 2 * MIB
        store.reap(block=True)
        assert [c.state for c in record.chunks].count(ChunkState.STORAGE) == 2
        assert _bytes_of(record).numel() == record.nbytes  # no resize_, no copy
        # Bytes out are exactly the bytes released: the chunks are whole pages.
        assert record.released_bytes == store.stats.bytes_out == 2 * MIB
        assert store.device_bytes() == record.nbytes - 2 * MIB
        first = middle[0].offset_bytes
        assert torch.all(_bytes_of(record)[first : first + 2 * MIB] == 0)  # zeros, never stale
        head = _bytes_of(record)[:first]
        assert torch.equal(head, expected[:first])  # the rest is untouched
        del head
        tail = store.evict(record, 3 * MIB)  # a second cut, from the tail
        assert 3 * MIB <= tail < 4 * MIB  # the last chunk ends at the last whole page
        store.reap(block=True)
        assert record.released_bytes == store.stats.bytes_out == 2 * MIB + tail
        store.ensure_resident(record)
        assert store.stats.bytes_in == 2 * MIB + tail
        restored = _bytes_of(record)
        assert restored.data_ptr() == address  # the same addresses
        assert torch.equal(restored, expected)
        assert store.released_bytes == 0 and store.stats.copied_bytes == 0
        del restored, handle


def test_a_chunk_in_flight_or_away_cannot_be_evicted_again(tmp_path: Path) -> None:
    with _opened(_store(tmp_path)) as store:
        record, handle = _adopted(store, torch.ones(4 * MIB, dtype=torch.uint8))
        store.evict_chunks(record, record.chunks[:1])
        store.reap(block=True)
        with pytest.raises(VTensorError, match="resident, idle"):
            store.evict_chunks(record, record.chunks[:2])
        assert record.chunks[1].state is ChunkState.DEVICE  # nothing moved
        store.ensure_resident(record)
        assert torch.all(_bytes_of(record) == 1)
        del handle


def test_the_copy_path_cuts_only_tails(tmp_path: Path) -> None:
    with _opened(ChunkStore(FileTransferEngine(StorageTier(tmp_path)), PAGE_BYTES // 2)) as store:
        record, handle = _adopted(store, torch.ones(4 * PAGE_BYTES, dtype=torch.uint8))
        assert not record.in_place
        with pytest.raises(VTensorError, match="only a tail"):
            store.evict_chunks(record, record.chunks[:1])
        assert store.evict_chunks(record, record.chunks[-2:]) == PAGE_BYTES
        store.reap(block=True)
        assert store.stats.copied_bytes == 3 * PAGE_BYTES  # the prefix, copied by resize_
        store.ensure_resident(record)
        assert torch.all(_bytes_of(record) == 1)
        del handle


def test_rss_drops_by_the_released_pages(tmp_path: Path) -> None:
    assert rss_is_honest(), "scripts/test.sh runs the suite with MALLOC_MMAP_THRESHOLD_=65536"
    store = _store(tmp_path)
    meter = RssMeter()
    try:
        record, handle = _adopted(store, torch.ones(64 * MIB, dtype=torch.uint8))
        before = meter.current_rss_bytes()
        store.evict(record, record.nbytes)
        store.reap(block=True)
        dropped = before - meter.current_rss_bytes()
        assert dropped >= record.released_bytes - 4 * MIB  # the I/O thread's buffers aside
        store.ensure_resident(record)
        assert torch.all(_bytes_of(record) == 1)
        del handle
    finally:
        meter.close()
        store.close()
        store.engine.close()


def test_a_managed_step_copies_no_prefix(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(6)])
    x = torch.randn(1024, 512)
    with vtensor.MemoryManager("1TiB", storage_dir=tmp_path) as probe:
        with probe.step(model, inputs=(x,)):
            model(x).sum().backward()
    # Halfway between the smallest workable budget and the peak, measured in this process.
    budget = (probe.report().peak_device_bytes + probe.report().min_budget_bytes) // 2
    model.zero_grad(set_to_none=True)
    with vtensor.MemoryManager(budget, storage_dir=tmp_path, policy="reactive") as mm:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with mm.step(model, inputs=(x,)):
                model(x).sum().backward()
            report = mm.report()
            assert report.bytes_out > 0 and report.copied_bytes == 0
