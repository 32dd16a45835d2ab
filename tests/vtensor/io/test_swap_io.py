"""Swap-file I/O: what the page cache holds of the swap file during and after transfers."""

import ctypes
import mmap
from pathlib import Path

import pytest
import torch

from vtensor.io.chunk import split_into_chunks
from vtensor.io.file_io import READ_AHEAD_BYTES, ReadAhead
from vtensor.io.pages import PAGE_BYTES
from vtensor.io.tiers import StorageTier
from vtensor.io.transfer import FileTransferEngine

CHUNK_BYTES = 1 << 20
TENSOR_BYTES = 8 << 20
TENSORS = 4  # more bytes queued for restore than READ_AHEAD_BYTES


def _cached_pages(fd: int, nbytes: int) -> int:
    """Pages of the file's first ``nbytes`` held in the page cache (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-nbytes // PAGE_BYTES)
    vec = (ctypes.c_ubyte * pages)()
    mapped = mmap.mmap(fd, nbytes, access=mmap.ACCESS_WRITE)  # never written: mincore only
    try:
        anchor = ctypes.c_char.from_buffer(mapped)
        status = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), nbytes, vec)
        del anchor  # the exported buffer must go before the mapping can close
        assert status == 0, ctypes.get_errno()
    finally:
        mapped.close()
    return sum(v & 1 for v in vec)


@pytest.mark.parametrize("encrypt", [True, False])
def test_swap_file_leaves_page_cache_and_read_ahead_is_capped(
    tmp_storage_dir: Path, encrypt: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = FileTransferEngine(StorageTier(tmp_storage_dir), encrypt=encrypt)
    asked: list[int] = []
    read_ahead = engine.tier.read_ahead

    def recording(offset: int, nbytes: int) -> None:
        asked.append(nbytes)
        assert engine.io.read_ahead.ahead_bytes <= READ_AHEAD_BYTES
        read_ahead(offset, nbytes)

    monkeypatch.setattr(engine.tier, "read_ahead", recording)
    gen = torch.Generator().manual_seed(0)
    datas = [
        torch.randint(0, 256, (TENSOR_BYTES,), dtype=torch.uint8, generator=gen)
        for _ in range(TENSORS)
    ]
    expected = [d.clone() for d in datas]
    chunks = [split_into_chunks(TENSOR_BYTES, CHUNK_BYTES) for _ in datas]
    try:
        for data, cs in zip(datas, chunks, strict=True):
            engine.evict(data.untyped_storage(), cs).wait()
        size = engine.tier.extents.end_bytes
        assert _cached_pages(engine.tier.fd, size) == 0  # written, flushed and dropped
        for data in datas:
            data.zero_()
        restores = [
            engine.restore(data.untyped_storage(), cs)
            for data, cs in zip(datas, chunks, strict=True)
        ]
        for transfer in restores:
            transfer.wait()
        assert all(map(torch.equal, datas, expected))
        assert READ_AHEAD_BYTES < TENSORS * TENSOR_BYTES  # the cap was exercised
        # The window slid past the cap: more than it was asked for over the restores.
        assert sum(asked) > READ_AHEAD_BYTES
        assert engine.io.read_ahead.ahead_bytes == 0
        assert _cached_pages(engine.tier.fd, size) == 0  # read pages dropped, no kernel read-ahead
    finally:
        engine.close()


class _AskedRanges:
    """A stand-in tier that logs the ranges read ahead."""

    def __init__(self, log: list[tuple[str, int, int]]) -> None:
        self.log = log

    def read_ahead(self, offset: int, nbytes: int) -> None:
        self.log.append(("ask", offset, offset + nbytes))


def test_read_ahead_window_slides_and_never_asks_for_bytes_already_read() -> None:
    log: list[tuple[str, int, int]] = []
    window = ReadAhead(_AskedRanges(log), limit_bytes=4)  # type: ignore[arg-type]
    window.want([(0, 0, 10)])  # one restore larger than the cap
    window.want([(20, 0, 3)])  # and one queued behind it
    window.top_up()
    assert log == [("ask", 0, 4)] and window.ahead_bytes == 4
    for start, nbytes in ((0, 3), (3, 3), (6, 4), (20, 3)):  # the jobs read in order
        window.claim(start, nbytes)
        log.append(("read", start, start + nbytes))
        window.top_up()
        assert window.ahead_bytes <= 4
    assert window.ahead_bytes == 0
    asked = [(a, b) for kind, a, b in log if kind == "ask"]
    assert asked == [(0, 4), (4, 7), (7, 10), (20, 23)]  # each byte once, in read order
    for i, (kind, a, b) in enumerate(log):
        if kind == "ask":  # nothing asked for had been read already
            assert not any(k == "read" and a < e and s < b for k, s, e in log[:i])


def test_read_ahead_claim_drops_ranges_not_asked_for_yet() -> None:
    log: list[tuple[str, int, int]] = []
    window = ReadAhead(_AskedRanges(log), limit_bytes=2)  # type: ignore[arg-type]
    window.want([(0, 0, 8)])
    window.top_up()
    window.claim(0, 8)  # the job read everything (or failed) before the window reached it
    window.top_up()
    assert log == [("ask", 0, 2)] and window.ahead_bytes == 0


def test_an_eviction_writes_each_range_back_behind_the_next_and_ends_with_none_cached(
    tmp_storage_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NOTE [write behind]: each staging buffer's write-back starts at once; the one before is
    # waited for and dropped after it, the last before the eviction ends.
    engine = FileTransferEngine(StorageTier(tmp_storage_dir))
    events: list[tuple[str, int]] = []
    cached: list[int] = []
    start, release = engine.tier.start_write_back, engine.tier.release_cache

    def started(offset: int, nbytes: int) -> bool:
        events.append(("start", offset))
        return start(offset, nbytes)

    def released(offset: int, nbytes: int, *, dirty: bool) -> None:
        release(offset, nbytes, dirty=dirty)
        events.append(("done", offset))
        cached.append(_cached_pages(engine.tier.fd, engine.tier.extents.end_bytes))

    monkeypatch.setattr(engine.tier, "start_write_back", started)
    monkeypatch.setattr(engine.tier, "release_cache", released)
    data = torch.randint(0, 256, (TENSOR_BYTES,), dtype=torch.uint8)
    expected = data.clone()
    chunks = split_into_chunks(TENSOR_BYTES, CHUNK_BYTES)
    try:
        engine.evict(data.untyped_storage(), chunks).wait()
        first, second = sorted({offset for _, offset in events})[:2]
        assert events[:3] == [("start", first), ("start", second), ("done", first)]
        assert [kind for kind, _ in events].count("start") >= 2  # more than one staging buffer
        assert all(kind == "done" for kind, _ in events[-2:])  # the last range, after its start
        staging = 4 * (CHUNK_BYTES + 16)
        assert max(cached) * PAGE_BYTES <= 2 * staging  # two ranges at most, while it ran
        assert cached[-1] == 0 and _cached_pages(engine.tier.fd, TENSOR_BYTES) == 0
        data.zero_()
        engine.restore(data.untyped_storage(), chunks).wait()
        assert torch.equal(data, expected)
    finally:
        engine.close()


def test_a_write_back_that_fails_fails_the_eviction_that_wrote_it(
    tmp_storage_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = FileTransferEngine(StorageTier(tmp_storage_dir))
    release = engine.tier.release_cache
    failing: list[int] = []

    def released(offset: int, nbytes: int, *, dirty: bool) -> None:
        if dirty and failing and offset >= failing[0]:
            raise OSError(5, "Input/output error")
        release(offset, nbytes, dirty=dirty)

    monkeypatch.setattr(engine.tier, "release_cache", released)
    chunks = split_into_chunks(TENSOR_BYTES, CHUNK_BYTES)
    try:
        good = torch.zeros(TENSOR_BYTES, dtype=torch.uint8)
        engine.evict(good.untyped_storage(), chunks).wait()
        failing.append(engine.tier.extents.end_bytes)  # every range of the next eviction
        bad = torch.zeros(TENSOR_BYTES, dtype=torch.uint8)
        transfer = engine.evict(bad.untyped_storage(), split_into_chunks(TENSOR_BYTES, CHUNK_BYTES))
        with pytest.raises(OSError, match="Input/output"):
            transfer.wait()
    finally:
        engine.close()
