"""Chunk states, budget parsing, and a stateful property test of the chunk store."""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import vtensor
from vtensor.activations.runtime.hooks import SavedHandle
from vtensor.activations.runtime.policy import ReactivePolicy
from vtensor.activations.store.chunk_store import ChunkStore
from vtensor.io.chunk import LEGAL_MOVES, Chunk, ChunkState, split_into_chunks
from vtensor.io.pages import PAGE_BYTES
from vtensor.io.tiers import ExtentAllocator, StorageTier
from vtensor.io.transfer import FileTransferEngine


def test_chunk_every_illegal_move_raises_and_legal_ones_pass():
    for source in ChunkState:
        for target in ChunkState:
            chunk = Chunk(0, 0, 16, state=source)
            if target in LEGAL_MOVES[source]:
                chunk.move(target)
                assert chunk.state == target
            else:
                with pytest.raises(vtensor.IllegalMoveError, match=source.value):
                    chunk.move(target)
                assert chunk.state == source


def test_chunk_split_covers_every_byte_once():
    chunks = split_into_chunks(10_000, 4096)
    assert [(c.offset_bytes, c.nbytes) for c in chunks] == [(0, 4096), (4096, 4096), (8192, 1808)]
    assert [(c.offset_bytes, c.nbytes) for c in split_into_chunks(10_000, None)] == [(0, 10_000)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("256MiB", 256 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("512 KiB", 512 * 1024),
        (4096, 4096),
        ("4096", 4096),
        ("2g", 2_000_000_000),
        (1e6, 1_000_000),
    ],
)
def test_budget_accepted_forms(text, expected):
    assert vtensor.parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "abc", "12 parsecs", "-5MiB", 0, -1, 1.5, True, None, "1e3MB"])
def test_budget_malformed_is_a_clear_error(bad):
    with pytest.raises(vtensor.BudgetFormatError, match="expected a positive number of bytes"):
        vtensor.parse_bytes(bad)
    with pytest.raises(vtensor.BudgetFormatError):
        vtensor.MemoryManager(bad)


def test_extent_allocator_reuses_and_coalesces():
    extents = ExtentAllocator()
    a, b, c = extents.alloc(4096), extents.alloc(8192), extents.alloc(100)
    assert (a, b, c) == (0, 4096, 12288)
    extents.free(a, 4096)
    extents.free(b, 8192)
    assert extents.alloc(12288) == 0  # the two freed neighbours merged
    assert extents.end_bytes == 16384


class StoreMachine(RuleBasedStateMachine):
    """Random adopt/evict/restore/use/drop sequences: bytes survive, the capacity holds."""

    capacity = 96 * 1024

    @initialize(chunk=st.sampled_from([1024, 4096, None]))
    def setup(self, chunk):
        self.tier = StorageTier(None)
        self.store = ChunkStore(FileTransferEngine(self.tier), chunk)
        self.policy = ReactivePolicy(self.store, self.capacity)
        self.handles: list[SavedHandle] = []
        self.expected: dict[int, torch.Tensor] = {}
        self.gen = torch.Generator().manual_seed(0)
        self.seen = (self.store.memory_epoch, frozenset(self.store.records), 0)

    def teardown(self):
        self.handles.clear()
        self.store.close()
        self.store.engine.close()

    @rule(nbytes=st.integers(1, 40_000), offset=st.integers(0, 16))
    def adopt(self, nbytes, offset):
        data = torch.randint(0, 256, (nbytes + offset,), dtype=torch.uint8, generator=self.gen)
        view = data[offset:]
        record = self.store.adopt(view.untyped_storage(), step=0)
        self.handles.append(SavedHandle(self.store, record, view))
        self.expected[record.vid] = data.clone()
        del data, view
        # Keep the store within capacity, as the session's policy does at every hook point.
        self.policy.evict_down_to(self.store.device_bytes(), self.capacity)
        self.store.reap(block=True)
        assert self.store.device_bytes() - self._partial_pages() <= self.capacity

    def _partial_pages(self) -> int:
        """Bytes that never leave: the partial pages at the ends of storages released in place."""
        return sum(r.nbytes - r.movable_bytes for r in self.store.records.values() if r.in_place)

    @rule(index=st.integers(0, 50), nbytes=st.integers(1, 40_000))
    def evict(self, index, nbytes):
        if self.handles:
            record = self.handles[index % len(self.handles)].record
            if self.store.evictable(record):
                self.store.evict(record, nbytes)

    @rule(block=st.booleans())
    def reap(self, block):
        self.store.reap(block=block)

    @rule(index=st.integers(0, 50))
    def use(self, index):
        if self.handles:
            handle = self.handles[index % len(self.handles)]
            self.store.ensure_resident(handle.record)
            whole = torch.empty(0, dtype=torch.uint8).set_(handle.record.storage)
            assert torch.equal(whole, self.expected[handle.record.vid])

    @rule(index=st.integers(0, 50))
    def drop(self, index):
        if self.handles:
            self.handles.pop(index % len(self.handles))

    @invariant()
    def within_capacity_after_settling(self):
        if not self.store.in_flight():
            largest = max((r.nbytes for r in self.store.records.values()), default=0)
            assert self.store.device_bytes() - self._partial_pages() <= self.capacity + largest

    @invariant()
    def memory_changes_only_with_the_epoch(self):
        # The store's own moves (shrinks, growths, frees) bump ``memory_epoch``; with the same
        # epoch and the same records, the device bytes cannot have changed.
        now = (self.store.memory_epoch, frozenset(self.store.records), self.store.device_bytes())
        if now[:2] == self.seen[:2]:
            assert now[2] == self.seen[2]
        self.seen = now

    @invariant()
    def resident_bytes_match_the_released_pages(self):
        released = 0
        for record in self.store.records.values():
            if record.pending is None and record.storage is not None:
                resident = [c for c in record.chunks if c.state == ChunkState.DEVICE]
                away = [c for c in record.chunks if c.state == ChunkState.STORAGE]
                assert record.resident_bytes == sum(c.nbytes for c in resident)
                if not record.in_place:  # chunks under a page: the copy path, tails only
                    assert resident == record.chunks[: len(resident)]
                    assert record.storage.nbytes() == record.resident_bytes
                    continue
                # NOTE [release in place]: the storage keeps its size; its chunks are whole
                # pages, exactly those of the chunks away are released, and nothing is copied.
                assert record.storage.nbytes() == record.nbytes
                base = record.storage.data_ptr()
                for chunk in record.chunks:
                    assert (base + chunk.offset_bytes) % PAGE_BYTES == 0
                    assert chunk.nbytes % PAGE_BYTES == 0
                assert record.released_bytes == sum(c.nbytes for c in away)
            released += record.released_bytes
        assert self.store.released_bytes == released
        if self.store.chunk_bytes is None or self.store.chunk_bytes >= PAGE_BYTES:
            assert self.store.stats.copied_bytes == 0


StoreMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
test_chunk_store_bytes_survive_every_move = StoreMachine.TestCase
