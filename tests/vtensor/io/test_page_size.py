"""Page computations follow the system's page size (16 KiB on Raspberry Pi 5 kernels).

The page size is one shared value, ``vtensor.io.pages.PAGE_BYTES``; these tests set it to 16 KiB.
A 16 KiB-aligned range is also 4 KiB-aligned, so on a 4 KiB-page machine the real system calls
(``madvise``, ``posix_fadvise``) still run.
"""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from vtensor.io import pages
from vtensor.io.chunk import ChunkState, split_on_pages
from vtensor.io.tiers import ExtentAllocator, StorageTier
from vtensor.io.transfer import FileTransferEngine

PAGE_16K = 16 << 10


@pytest.fixture
def page_16k(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """The system page size, as vtensor sees it, set to 16 KiB for the test."""
    if PAGE_16K % os.sysconf("SC_PAGE_SIZE"):
        pytest.skip("the system page does not divide 16 KiB")
    monkeypatch.setattr(pages, "PAGE_BYTES", PAGE_16K)
    yield PAGE_16K


def test_page_size_is_the_systems() -> None:
    assert os.sysconf("SC_PAGE_SIZE") == pages.PAGE_BYTES
    assert ExtentAllocator().page_bytes == pages.PAGE_BYTES


def test_extents_are_aligned_to_a_16k_page(page_16k: int) -> None:
    extents = ExtentAllocator()
    offsets = [extents.alloc(n) for n in (1, 5000, page_16k, page_16k + 1, 3)]
    assert all(offset % page_16k == 0 for offset in offsets)
    assert offsets == [0, page_16k, 2 * page_16k, 3 * page_16k, 5 * page_16k]
    assert extents.end_bytes == 6 * page_16k
    extents.free(offsets[1], 5000)  # a freed extent is the whole 16 KiB page
    assert extents.used_bytes == 5 * page_16k
    assert extents.alloc(page_16k) == offsets[1]


def test_whole_pages_are_16k_pages(page_16k: int) -> None:
    base = 10 * page_16k
    assert pages.whole_pages(base, 3 * page_16k) == (base, 3 * page_16k)
    assert pages.whole_pages(base + 4096, 3 * page_16k) == (base + page_16k, 2 * page_16k)
    assert pages.whole_pages(base + 1, page_16k) == (base + page_16k, 0)


def test_chunks_split_on_the_16k_page_grid(page_16k: int) -> None:
    address = 7 * page_16k + 4096  # 4 KiB-aligned, not 16 KiB-aligned
    nbytes = 1 << 20
    chunks, kept = split_on_pages(address, nbytes, 100_000, pages.PAGE_BYTES)
    assert chunks[0].offset_bytes == page_16k - 4096
    for chunk in chunks:
        assert (address + chunk.offset_bytes) % page_16k == 0
        assert chunk.nbytes % page_16k == 0
    assert chunks[0].nbytes == 7 * page_16k  # 100 000 bytes rounded up to whole 16 KiB pages
    assert kept == nbytes - sum(c.nbytes for c in chunks)
    assert kept < 2 * page_16k


def test_cache_drops_cover_whole_16k_pages(
    page_16k: int, tmp_storage_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dropped: list[tuple[int, int]] = []
    advise = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_DONTNEED:
            dropped.append((offset, length))
        advise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    tier = StorageTier(tmp_storage_dir)
    try:
        data = torch.arange(5000, dtype=torch.uint8)
        offset = tier.extents.alloc(data.numel())
        tier.write(offset, data.data_ptr(), data.numel())
        tier.release_cache(offset, data.numel(), dirty=True)
    finally:
        tier.close()
    assert dropped == [(0, page_16k)]


@pytest.mark.parametrize("encrypt", [True, False])
def test_bytes_round_trip_released_in_place_with_a_16k_page(
    page_16k: int, tmp_storage_dir: Path, encrypt: bool
) -> None:
    nbytes = 2 << 20
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator())
    expected = data.clone()
    storage = data.untyped_storage()
    chunks, _ = split_on_pages(storage.data_ptr(), nbytes, 256 << 10, pages.PAGE_BYTES)
    engine = FileTransferEngine(StorageTier(tmp_storage_dir), encrypt=encrypt)
    try:
        engine.tier.extents.alloc(5000)  # a small extent first: the next starts a page later
        for chunk in chunks:
            chunk.move(ChunkState.EVICTING)
        engine.evict(storage, chunks).wait()
        assert chunks[0].slot == page_16k
        assert engine.tier.extents.end_bytes % page_16k == 0
        released = 0
        for chunk in chunks:
            chunk.move(ChunkState.STORAGE)
            released += pages.release(storage.data_ptr() + chunk.offset_bytes, chunk.nbytes)
        assert released == sum(c.nbytes for c in chunks)
        first = chunks[0].offset_bytes
        assert torch.all(data[first : first + chunks[0].nbytes] == 0)  # really released
        for chunk in chunks:
            chunk.move(ChunkState.RESTORING)
        engine.restore(storage, chunks).wait()
        assert torch.equal(data, expected)
        engine.release(chunks)
        assert engine.tier.extents.used_bytes == page_16k
    finally:
        engine.close()
