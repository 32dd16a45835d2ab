"""Tests of vtensor.measure: every tracker measured against tensors of known size."""

import ctypes
import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode

import vtensor
from vtensor.errors import VTensorError
from vtensor.io.pages import PAGE_BYTES, release
from vtensor.measure.counter import CpuCounter, cpu_counter, make_device_tracker
from vtensor.measure.dispatch import LiveStorageTracker
from vtensor.measure.independent import IndependentPeak
from vtensor.measure.rss import RssMeter, RssMode, rss_is_honest
from vtensor.measure.trackers import (
    CudaTracker,
    DeviceTracker,
    MallocTracker,
    ResidentTracker,
    quiet_heap,
)

MIB = 1 << 20
MB = 1_000_000
MALLOC_TOLERANCE_BYTES = 64 * 1024
REPO_ROOT = Path(vtensor.__file__).resolve().parents[1]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Where torch allocates outside glibc's malloc (a preloaded allocator, the mimalloc in PyTorch's
# aarch64 wheels), glibc's heap counter sees none of its tensors (NOTE [CPU counter]).
heap_counter_only = pytest.mark.skipif(
    cpu_counter() is not CpuCounter.HEAP, reason="torch does not allocate through glibc's malloc"
)


@pytest.fixture(autouse=True)
def _quiet_heap() -> Iterator[None]:
    # The heap counter is process-wide: garbage of earlier tests freed by the cycle collector
    # in the middle of a measurement would look like the measured code freeing memory
    # (NOTE [quiet heap] in vtensor/measure/trackers.py).
    gc.collect()
    with quiet_heap():
        yield


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64 * 16 * 16, 10),
    )


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(16, 3, 32, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)


def _train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    nn.functional.cross_entropy(model(x), y).backward()


def _storage_bytes(*tensors: torch.Tensor) -> int:
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


# --- MallocTracker -------------------------------------------------------------------------------


@heap_counter_only
def test_malloc_tracker_counts_and_releases_large_tensor() -> None:
    tracker = MallocTracker()
    torch.empty(MB)  # first-use allocations of torch's CPU path stay out of the measurement
    before = tracker.current_bytes()
    t = torch.ones(50 * MB // 4)
    with_tensor = tracker.current_bytes()
    del t
    after = tracker.current_bytes()
    assert abs(with_tensor - before - 50 * MB) < MALLOC_TOLERANCE_BYTES
    assert abs(after - before) < MALLOC_TOLERANCE_BYTES


@heap_counter_only
def test_malloc_tracker_counts_many_heap_sized_tensors() -> None:
    tracker = MallocTracker()
    torch.empty(1024)
    before = tracker.current_bytes()
    tensors = [torch.ones(16 * 1024 // 4) for _ in range(100)]  # 100 x 16 KiB, below mmap size
    with_tensors = tracker.current_bytes()
    del tensors
    assert abs(with_tensors - before - 100 * 16 * 1024) < MALLOC_TOLERANCE_BYTES
    assert abs(tracker.current_bytes() - before) < MALLOC_TOLERANCE_BYTES


# --- make_device_tracker / CudaTracker ----------------------------------------------------------


def test_make_device_tracker_returns_malloc_tracker_for_cpu() -> None:
    tracker = make_device_tracker(torch.device("cpu"))
    expected = MallocTracker if cpu_counter() is CpuCounter.HEAP else ResidentTracker
    assert isinstance(tracker, expected)
    assert isinstance(tracker, DeviceTracker)
    assert tracker.current_bytes() > 0


def test_make_device_tracker_rejects_unknown_device() -> None:
    with pytest.raises(VTensorError, match="meta"):
        make_device_tracker(torch.device("meta"))


def test_cuda_tracker_rejects_cpu_device() -> None:
    with pytest.raises(VTensorError, match="cuda device"):
        CudaTracker(torch.device("cpu"))


def test_cuda_tracker_reads_what_torch_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tracker reads the allocator's nested statistics, which torch's own memory_allocated
    # and max_memory_allocated flatten: fed the same statistics, both agree (the GPU tests
    # compare them on a device).
    stats = {"allocated_bytes": {"all": {"current": 7 * MIB, "peak": 9 * MIB}}, "num_ooms": 0}
    monkeypatch.setattr(torch.cuda.memory, "memory_stats_as_nested_dict", lambda *_, **__: stats)
    tracker = object.__new__(CudaTracker)
    tracker.device = torch.device("cuda", 0)
    assert tracker.current_bytes() == torch.cuda.memory_allocated(0) == 7 * MIB
    assert tracker.peak_bytes() == torch.cuda.max_memory_allocated(0) == 9 * MIB
    monkeypatch.setattr(torch.cuda.memory, "memory_stats_as_nested_dict", lambda *_, **__: {})
    assert tracker.current_bytes() == torch.cuda.memory_allocated(0) == 0  # not initialized


def test_workspaces_are_counted_on_a_cpu_device_only() -> None:
    # count_workspaces measures with the process's RSS, which a GPU's memory is not in.
    with pytest.raises(VTensorError, match=r"count_workspaces=True .* use it on a cpu device"):
        IndependentPeak(torch.device("cuda"), enabled=True, rss=True)
    IndependentPeak(torch.device("cuda"), enabled=False)  # measured with the allocator's peak
    IndependentPeak(torch.device("cpu"), enabled=False, rss=True).close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_tracker_rejects_missing_cuda() -> None:
    with pytest.raises(VTensorError, match="not available"):
        make_device_tracker(torch.device("cuda"))


@pytest.mark.gpu
@needs_cuda
def test_cuda_tracker_counts_allocation() -> None:
    tracker = make_device_tracker(torch.device("cuda"))
    assert isinstance(tracker, CudaTracker)
    before = tracker.current_bytes()
    # A whole number of MiB over 10 MiB: the allocator's block is exactly its size (blocks round
    # to 512 B, segments of large tensors to 2 MiB, and a remainder under 1 MiB is not split).
    t = torch.empty(50 * MIB, dtype=torch.uint8, device="cuda")
    assert tracker.current_bytes() - before == 50 * MIB
    assert tracker.current_bytes() == torch.cuda.memory_allocated()
    assert tracker.peak_bytes() == torch.cuda.max_memory_allocated()
    del t
    assert tracker.current_bytes() == before


@pytest.mark.gpu
@needs_cuda
def test_cuda_tracker_peak_and_reset() -> None:
    tracker = CudaTracker(torch.device("cuda"))
    tracker.reset_peak()
    base = tracker.current_bytes()
    torch.empty(40 * MIB, dtype=torch.uint8, device="cuda")
    assert tracker.peak_bytes() - base == 40 * MIB
    tracker.reset_peak()
    assert tracker.peak_bytes() == tracker.current_bytes() == base


# --- LiveStorageTracker --------------------------------------------------------------------------


def test_live_storage_tracker_counts_forward_outputs() -> None:
    model = _conv_net()
    x, _ = _batch()
    params = list(model.parameters())
    tracker = LiveStorageTracker()
    tracker.track(*params)
    with torch.no_grad(), tracker:
        out = model(x)
    # Intermediates died inside forward; only the output is left, and the first conv's output
    # (16 x 32 x 32 x 32 fp32) was live at some point.
    assert tracker.current_bytes == _storage_bytes(*params) + out.nbytes
    assert tracker.peak_bytes >= _storage_bytes(*params) + 16 * 32 * 32 * 32 * 4


def test_live_storage_tracker_counts_preexisting_storage_returned_by_op() -> None:
    linear = nn.Linear(100, 10)
    tracker = LiveStorageTracker()
    with torch.no_grad(), tracker:
        out = linear(torch.ones(1, 100))
    # Linear's weight.t() is a view returned by an op, so the weight storage becomes live; the
    # untracked bias never comes out of an op and stays unseen.
    assert tracker.current_bytes == linear.weight.nbytes + out.nbytes


def test_live_storage_tracker_counts_views_once() -> None:
    tracker = LiveStorageTracker()
    with tracker:
        base = torch.zeros(1000, 1000)
        views = [base.view(-1), base[::2], base.t(), base[10:20].unsqueeze(0)]
    assert tracker.current_bytes == base.nbytes == 4 * MB
    del views


def test_live_storage_tracker_forgets_freed_tensors() -> None:
    tracker = LiveStorageTracker()
    with tracker:
        a = torch.ones(1 * MB // 4)
        b = torch.ones(2 * MB // 4)
        view_of_b = b[1:]
        del a
        assert tracker.current_bytes == 2 * MB
        del b
        assert tracker.current_bytes == 2 * MB  # the view keeps b's storage alive
        del view_of_b
        assert tracker.current_bytes == 0
    assert tracker.peak_bytes == 3 * MB


def test_live_storage_tracker_sees_storage_resize() -> None:
    tracker = LiveStorageTracker()
    with tracker:
        t = torch.ones(4 * MB // 4)
        t.untyped_storage().resize_(0)  # how the manager swaps a chunk's bytes out
        assert tracker.current_bytes == 0
        t.untyped_storage().resize_(4 * MB)
        t.fill_(1.0)  # on CPU fresh pages count once touched (the tracker reads page tables)
        assert tracker.current_bytes == 4 * MB
        t.resize_(2 * MB // 4 + 1)  # aten resize_ within capacity keeps the storage as it is
        assert tracker.current_bytes == 4 * MB
        t.resize_(8 * MB // 4)  # aten resize_ beyond capacity grows it through the dispatcher
        t.fill_(1.0)
        assert tracker.current_bytes == 8 * MB


def test_live_storage_tracker_counts_resize_of_untracked_storage() -> None:
    t = torch.ones(1024)
    t.untyped_storage().resize_(0)
    tracker = LiveStorageTracker()
    with tracker:
        t.untyped_storage().resize_(4096)
    assert tracker.current_bytes == 4096


def test_live_storage_tracker_restores_resize_on_exit() -> None:
    original = torch.UntypedStorage.resize_
    tracker = LiveStorageTracker()
    with pytest.raises(RuntimeError, match="boom"), tracker:
        assert torch.UntypedStorage.resize_ is not original
        raise RuntimeError("boom")
    assert torch.UntypedStorage.resize_ is original
    assert "resize_" not in torch.UntypedStorage.__dict__
    t = torch.ones(256)
    t.untyped_storage().resize_(0)  # no longer counted once the mode is left
    assert tracker.current_bytes == 0


def test_live_storage_tracker_tracks_existing_tensors_once() -> None:
    shared = nn.Linear(100, 100)
    model = nn.Sequential(shared, nn.ReLU(), shared)  # one module used twice: parameters shared
    tracker = LiveStorageTracker()
    tracker.track(
        *model.parameters(), shared.weight, shared.weight.t(), torch.empty(10, device="meta")
    )
    assert tracker.current_bytes == (100 * 100 + 100) * 4


def test_live_storage_tracker_ignores_other_devices() -> None:
    tracker = LiveStorageTracker()
    with tracker:
        m = torch.empty(1000, device="meta")
        (m + 1).sum()
        c = torch.ones(10)
    assert tracker.current_bytes == c.nbytes


def test_live_storage_tracker_marks_peak_per_step() -> None:
    tracker = LiveStorageTracker()
    with tracker:
        a = torch.ones(3 * MB // 4)
        del a
        tracker.mark("big")
        b = torch.ones(1 * MB // 4)
        tracker.mark("small")
        tracker.mark("idle")
    assert tracker.marks == [("big", 3 * MB), ("small", 1 * MB), ("idle", 1 * MB)]
    assert tracker.peak_bytes == 3 * MB
    tracker.reset_peak()
    assert tracker.peak_bytes == tracker.current_bytes == b.nbytes


def test_live_storage_tracker_rejects_nesting_itself() -> None:
    tracker = LiveStorageTracker()
    with tracker, pytest.raises(VTensorError, match="already active"), tracker:
        pass


def test_live_storage_tracker_peak_matches_mem_tracker() -> None:
    model = _conv_net()
    x, y = _batch()
    _train_step(model, x, y)  # warm-up: lazy initialisation stays out of the measured step
    model.zero_grad(set_to_none=True)

    mem_tracker = MemTracker()
    mem_tracker.track_external(model, x, y)
    with mem_tracker:
        _train_step(model, x, y)
    torch_peak = mem_tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    model.zero_grad(set_to_none=True)

    tracker = LiveStorageTracker()
    tracker.track(*model.parameters(), x, y)
    with tracker:
        _train_step(model, x, y)
    assert tracker.peak_bytes > 10 * MB
    assert tracker.peak_bytes == pytest.approx(torch_peak, rel=0.01)


class _MallocPeakMode(TorchDispatchMode):
    """Samples mallinfo after every op: the peak of live bytes is always right after an op."""

    def __init__(self) -> None:
        super().__init__()
        self.malloc = MallocTracker()
        self.peak_bytes = self.malloc.current_bytes()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.peak_bytes = max(self.peak_bytes, self.malloc.current_bytes())
        return out


@heap_counter_only
def test_live_storage_tracker_peak_matches_mallinfo_delta() -> None:
    model = _conv_net()
    x, y = _batch()
    _train_step(model, x, y)
    model.zero_grad(set_to_none=True)

    malloc_mode = _MallocPeakMode()
    malloc_start = malloc_mode.peak_bytes
    with malloc_mode:
        _train_step(model, x, y)
    model.zero_grad(set_to_none=True)

    tracker = LiveStorageTracker()
    tracker.track(*model.parameters(), x, y)
    live_start = tracker.current_bytes
    with tracker:
        _train_step(model, x, y)
    live_rise = tracker.peak_bytes - live_start
    assert live_rise > 10 * MB
    assert malloc_mode.peak_bytes - malloc_start == pytest.approx(live_rise, rel=0.03)


def _swap_out_hooks() -> torch.autograd.graph.saved_tensors_hooks:
    """Pack copies each saved tensor, spills the copy's bytes off-torch and shrinks its storage."""

    def pack(t: torch.Tensor) -> tuple[torch.Tensor, bytes]:
        copy = t.detach().clone()
        storage = copy.untyped_storage()
        spilled = ctypes.string_at(storage.data_ptr(), storage.nbytes())
        storage.resize_(0)
        return copy, spilled

    def unpack(packed: tuple[torch.Tensor, bytes]) -> torch.Tensor:
        copy, spilled = packed
        storage = copy.untyped_storage()
        storage.resize_(len(spilled))
        ctypes.memmove(storage.data_ptr(), spilled, len(spilled))
        return copy

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def test_live_storage_tracker_keeps_saved_tensors_hooks_working() -> None:
    model = _conv_net()
    x, y = _batch()
    _train_step(model, x, y)
    expected = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)

    tracker = LiveStorageTracker()
    tracker.track(*model.parameters(), x, y)
    start = tracker.current_bytes
    with tracker:
        with _swap_out_hooks():
            loss = nn.functional.cross_entropy(model(x), y)
        # Every saved tensor was copied and its copy shrunk to 0 bytes in pack, while the mode was
        # active: nothing but the scalar loss is left of the forward pass.
        assert tracker.current_bytes == start + loss.nbytes
        loss.backward()

    got = [p.grad for p in model.parameters()]
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert tracker.peak_bytes > start + 10 * MB


# --- RssMeter ------------------------------------------------------------------------------------

_RSS_PROBE = """
import json, sys, torch
from vtensor.measure.rss import RssMeter, RssMode, rss_is_honest
result = {"honest": rss_is_honest()}
for mode in (None, RssMode.SAMPLING):
    with RssMeter(mode) as meter:
        meter.reset_peak()
        start_peak, start = meter.peak_rss_bytes(), meter.current_rss_bytes()
        t = torch.ones(50_000_000)  # 200 MB
        del t
        # 100 x 1 MiB: a size glibc by default keeps in its heap once its mmap threshold adapted.
        small = [torch.ones(256 * 1024) for _ in range(100)]
        del small
        result[str(meter.mode)] = {
            "rise": meter.peak_rss_bytes() - start_peak,
            "left": meter.current_rss_bytes() - start,
        }
json.dump(result, sys.stdout)
"""


def _run_probe(env_extra: dict[str, str]) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **env_extra}
    env.pop("MALLOC_TRIM_THRESHOLD_", None)
    done = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE], env=env, capture_output=True, text=True, check=True
    )
    result: dict[str, object] = json.loads(done.stdout)
    return result


@heap_counter_only  # its honesty is glibc's, under MALLOC_MMAP_THRESHOLD_
def test_rss_meter_peak_rises_by_tensor_size_when_honest() -> None:
    result = _run_probe({"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert result["honest"] is True
    for mode in ("clear_refs", "sampling"):
        if mode not in result:
            continue  # clear_refs unavailable here: RssMeter fell back to sampling
        stats = result[mode]
        assert isinstance(stats, dict)
        assert stats["rise"] == pytest.approx(200 * MB, rel=0.05)
        assert abs(stats["left"]) < 8 * MB  # freed small tensors went back to the system


def test_rss_meter_current_agrees_with_vmrss() -> None:
    status = Path("/proc/self/status").read_text()
    vmrss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    assert RssMeter(RssMode.SAMPLING).current_rss_bytes() == pytest.approx(vmrss * 1024, abs=4 * MB)


def test_rss_meter_reset_peak_lowers_peak() -> None:
    with RssMeter() as meter:
        torch.ones(50 * MB)  # 200 MB, mmapped: returned to the system on free
        high = meter.peak_rss_bytes()
        meter.reset_peak()
        low = meter.peak_rss_bytes()
    assert high - low > 150 * MB
    assert low == pytest.approx(meter.current_rss_bytes(), abs=8 * MB)


def test_rss_meter_sampling_mode_sees_short_peak() -> None:
    with RssMeter(RssMode.SAMPLING) as meter:
        meter.reset_peak()
        start = meter.peak_rss_bytes()
        t = torch.ones(50 * MB)  # 200 MB; filling it takes far longer than one sample interval
        torch.mul(t, 2, out=t)
        del t
        rise = meter.peak_rss_bytes() - start
    assert meter.mode is RssMode.SAMPLING
    assert rise > 150 * MB


def test_rss_is_honest_reads_glibc_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    assert not rss_is_honest()
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    assert not rss_is_honest()
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert rss_is_honest()
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert rss_is_honest()
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=4096")
    assert rss_is_honest()


def test_live_storage_tracker_sees_pages_released_in_place() -> None:
    # NOTE [release in place]: the storage keeps its size; the tracker reads the page tables.
    tracker = LiveStorageTracker()
    with tracker:
        t = torch.ones(8 * MIB, dtype=torch.uint8).add(1)
        full = tracker.current_bytes
        released = release(t.data_ptr(), t.nbytes)
        assert released > 8 * MIB - 2 * PAGE_BYTES
        assert tracker.current_bytes == full - released
        tracker.mark("released")
        t.fill_(3)  # the pages come back (resident again) on touch
        u = torch.ones(MIB, dtype=torch.uint8).add(1)  # an op that grows the count
        assert tracker.current_bytes == full + u.nbytes
    assert tracker.peak_bytes >= full + u.nbytes
