"""Edge cases of saved-tensor virtualization, each trained with and without the manager."""

import os

import pytest
import torch
from torch import nn

import vtensor


def _manager(tmp_path: object, budget: int | str = "1GiB", **kw: object) -> vtensor.MemoryManager:
    kw.setdefault("min_tensor_bytes", 1)
    return vtensor.MemoryManager(budget, chunk_bytes=4096, storage_dir=str(tmp_path), **kw)  # type: ignore[arg-type]


def _tight_budget(model: nn.Module, x: torch.Tensor, tmp_path: object, frac: float = 0.3) -> int:
    """A budget ``frac`` of the way from the smallest feasible one to the unmanaged peak."""
    model.zero_grad()
    with _manager(tmp_path, budget="1GiB") as mm, mm.step(model):
        model(x).sum().backward()
    model.zero_grad()
    rep = mm.report()
    return int(rep.min_budget_bytes + frac * (rep.peak_device_bytes - rep.min_budget_bytes))


def _grads_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class _Probe(nn.Module):
    """Runs ``fn`` on its input so a test controls exactly what autograd saves."""

    def __init__(self, fn: object, width: int = 256) -> None:
        super().__init__()
        self.fn = fn
        self.weight = nn.Parameter(torch.randn(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self, x)  # type: ignore[operator,no-any-return]


def _grad_with_and_without(fn: object, x: torch.Tensor, tmp_path: object, **kw: object):
    torch.manual_seed(0)
    model = _Probe(fn)
    if kw.get("budget") == "tight":
        kw["budget"] = _tight_budget(model, x, tmp_path)
    grads = []
    for managed in (False, True):
        model.zero_grad()
        if managed:
            with _manager(tmp_path, **kw) as mm, mm.step(model):
                model(x).sum().backward()
        else:
            model(x).sum().backward()
        grads.append([model.weight.grad.clone()])
    return grads, mm


def test_parameters_saved_for_backward_are_not_copied(tmp_path):
    # Linear saves weight.t(), a view that is not a Parameter: it must be recognised by storage.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
    x = torch.randn(64, 256)
    with _manager(tmp_path, budget=1) as mm:
        with pytest.raises(vtensor.InfeasibleBudgetError), mm.step(model):
            model(x).sum().backward()
    with _manager(tmp_path, budget="64MiB") as mm, mm.step(model):
        model(x).sum().backward()
        store = mm._store
        assert store is not None
        param_storages = {p.untyped_storage()._cdata for p in model.parameters()}
        assert all(
            r.storage is None or r.storage._cdata not in param_storages
            for r in store.records.values()
        )
    assert mm.trace is not None
    weight_bytes = 256 * 256 * 4
    assert all(t.nbytes != weight_bytes for t in mm.trace.tensors)


def test_views_of_one_storage_are_one_vtensor_moved_once(tmp_path):
    def fn(m, x):
        h = torch.cat([x @ m.weight, x @ m.weight], dim=1)  # (512, 512): a unique size
        a, b = h[:, :256], h[:, 256:]  # saved by the ops below, through views of h
        return (a * a).sum() + (b * b).sum() + (h.t() * h.t()).sum()

    x = torch.randn(512, 256)
    grads, mm = _grad_with_and_without(fn, x, tmp_path, budget="1GiB")
    assert _grads_equal(*grads)
    sizes = sorted(t.nbytes for t in mm.trace.tensors)
    assert sizes.count(512 * 512 * 4) == 1  # h, a, b and h.t() share one vTensor


def test_views_restore_exactly_after_eviction(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(8)])
    x = torch.randn(2048, 64)  # activations (512 KiB each) dominate the parameters
    model.zero_grad()
    model(x).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    for granularity in ("chunk", "tensor"):
        model.zero_grad()
        budget = _tight_budget(model, x, tmp_path)
        with _manager(tmp_path, budget=budget, granularity=granularity) as mm:
            with mm.step(model):
                model(x).sum().backward()
            assert mm.report().bytes_out > 0
        assert _grads_equal(ref, [p.grad for p in model.parameters()])


def test_inplace_change_after_save_raises_instead_of_stale_data(tmp_path):
    def fn(m, x):
        h = x @ m.weight
        y = h.sigmoid()  # sigmoid saves its output y
        z = y * 3
        y.mul_(2)  # modifies a saved tensor in place
        return z

    x = torch.randn(64, 256)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _Probe(fn)(x).sum().backward()  # autograd's own check, without the manager
    with _manager(tmp_path) as mm:
        with pytest.raises(vtensor.InPlaceModificationError, match="modified in place"):
            with mm.step(_Probe(fn)):
                _Probe(fn)(x).sum().backward()


def test_a_tiny_saved_tensor_changed_in_place_raises_too(tmp_path):
    # Below min_tensor_bytes the manager leaves a saved tensor to autograd, whose own check the
    # saved-tensor hooks switch off: the hooks check its version instead.
    def fn(m, x):
        y = (x @ m.weight[:, :8]).sigmoid()  # 4 x 8 float32: 128 bytes, saved by sigmoid
        z = y * 3
        y.mul_(2)
        return z

    x = torch.randn(4, 256)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _Probe(fn)(x).sum().backward()
    with _manager(tmp_path, min_tensor_bytes=4096) as mm:
        with pytest.raises(vtensor.InPlaceModificationError, match="modified in place"):
            with mm.step(_Probe(fn)):
                _Probe(fn)(x).sum().backward()


def test_non_contiguous_saved_tensors(tmp_path):
    def fn(m, x):
        h = (x @ m.weight).t()[::2]  # transposed and strided
        return (h * h.exp()).sum(dim=0)

    grads, _ = _grad_with_and_without(fn, torch.randn(64, 256), tmp_path, budget="1GiB")
    assert _grads_equal(*grads)


def test_mixed_dtypes_fp32_bf16_int64_bool(tmp_path):
    def fn(m, x):
        h = x @ m.weight
        low = h.to(torch.bfloat16)
        low = (low * low).float()  # bf16 saved
        idx = torch.argsort(h, dim=1)[:, :64]  # int64 indices saved by gather
        g = torch.gather(low, 1, idx)
        mask = h > 0  # bool mask saved by where
        return torch.where(mask[:, :64], g, -g)

    x = torch.randn(128, 256)
    grads, mm = _grad_with_and_without(fn, x, tmp_path, budget="1GiB")
    assert _grads_equal(*grads)
    dtypes = {d for t in mm.trace.tensors for d in t.dtypes}
    assert {"bfloat16", "int64", "bool"} <= dtypes


def test_mixed_dtypes_survive_eviction(tmp_path):
    def fn(m, x):
        h = x @ m.weight
        low = h.to(torch.bfloat16)
        low = (low * low).float()
        idx = torch.argsort(h, dim=1)[:, :64]
        g = torch.gather(low, 1, idx)
        mask = h > 0
        return torch.where(mask[:, :64], g, -g) @ m.weight[:64]

    x = torch.randn(512, 256)
    grads, mm = _grad_with_and_without(fn, x, tmp_path, budget="tight")
    assert _grads_equal(*grads)
    assert mm.report().bytes_out > 0


def test_retain_graph_and_double_backward(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    )
    x = torch.randn(4096, 32, requires_grad=True)

    def run(mm: vtensor.MemoryManager | None) -> list[torch.Tensor]:
        model.zero_grad()
        x.grad = None
        ctx = mm.step(model) if mm else torch.enable_grad()
        with ctx:
            out = model(x).sum()
            (gx,) = torch.autograd.grad(out, x, create_graph=True)  # double backward
            penalty = gx.pow(2).sum()
            penalty.backward(retain_graph=True)
            penalty.backward()  # the retained graph is used twice
        grads = [p.grad for p in model.parameters()] + [x.grad]
        return [torch.zeros(0) if g is None else g.clone() for g in grads]

    ref = run(None)
    with _manager(tmp_path) as mm:
        run(mm)
        rep = mm.report()
    budget = int(rep.min_budget_bytes + 0.3 * (rep.peak_device_bytes - rep.min_budget_bytes))
    with _manager(tmp_path, budget=budget) as mm:
        got = run(mm)
        assert mm.report().bytes_out > 0
    assert _grads_equal(ref, got)


def test_no_grad_regions_and_ops_that_save_nothing(tmp_path):
    def fn(m, x):
        with torch.no_grad():
            scale = (x @ m.weight).abs().mean()  # nothing saved
        h = x + 1.0  # add saves nothing
        return (h @ m.weight) * scale

    grads, mm = _grad_with_and_without(fn, torch.randn(64, 256), tmp_path, budget="1GiB")
    assert _grads_equal(*grads)
    # Only mm's saved input, and the 4-byte scalar that mul saved (min_tensor_bytes=1 here).
    assert sorted(t.nbytes for t in mm.trace.tensors) == [4, 64 * 256 * 4]


def test_swap_file_is_gone_after_normal_exit_and_after_exception(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)])
    x = torch.randn(2048, 64)
    budget = _tight_budget(model, x, tmp_path)
    with _manager(tmp_path, budget=budget) as mm, mm.step(model):
        model(x).sum().backward()
        fd = mm._store.engine.tier.fd  # type: ignore[union-attr]
        assert os.fstat(fd).st_nlink == 0  # unlinked: invisible and removed by the kernel
        assert os.fstat(fd).st_size > 0  # and really used
        assert list(tmp_path.iterdir()) == []
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="boom"):
        with _manager(tmp_path, budget=budget) as mm, mm.step(model):
            model(x).sum()
            raise ValueError("boom")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OSError):
        os.fstat(fd)


def test_unwritable_storage_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    model = nn.Linear(4, 4)
    mm = vtensor.MemoryManager("1MiB", storage_dir=str(blocker / "sub"))
    with pytest.raises(vtensor.StorageTierError, match="storage_dir"), mm.step(model):
        pass


FULL_DISK_SCRIPT = r"""
import resource, signal, sys, torch, vtensor
from torch import nn
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(8)])
x = torch.randn(2048, 64)
before = [p.detach().clone() for p in model.parameters()]
try:
    with vtensor.MemoryManager(3 * 2**20, chunk_bytes=4096, storage_dir=sys.argv[1]) as mm:
        with mm.step(model):
            model(x).sum().backward()
except vtensor.StorageTierError as err:
    print("ERROR", err)
assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
model.zero_grad()
with vtensor.MemoryManager(3 * 2**20, chunk_bytes=4096, storage_dir=sys.argv[1]) as mm:
    with mm.step(model):
        model(x).sum().backward()
print("RECOVERED", mm.report().bytes_out)
"""


def test_full_disk_is_a_clear_error_and_loses_nothing(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", FULL_DISK_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "to the swap file in" in proc.stdout and "storage_dir" in proc.stdout
    recovered = [line for line in proc.stdout.splitlines() if line.startswith("RECOVERED")]
    assert recovered and int(recovered[0].split()[1]) > 0
