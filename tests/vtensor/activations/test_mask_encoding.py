"""Clamps save their output, not their input (NOTE [mask encoding]); gradients stay identical."""

import math
from pathlib import Path

import pytest
import torch
from clamp_models import bits_of, clamp_model, train_clamps
from torch import nn

import vtensor
from vtensor.activations.encode import MaskedHardtanh, masked_hardtanh, masks_encoded
from vtensor.errors import VTensorError

BOUNDS = [(0.0, 6.0), (-1.0, 1.0), (-0.3, 0.7), (-2.0, 1e-3)]


def _encode(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    out: torch.Tensor = MaskedHardtanh.apply(x, low, high, "clamp")  # type: ignore[no-untyped-call]
    return out


def _edge_values(low: float, high: float, dtype: torch.dtype, nan: bool) -> torch.Tensor:
    """The bounds, their neighbours in ``dtype``, infinities, signed zeros, noise (a NaN)."""
    lo, hi = torch.tensor(low, dtype=dtype), torch.tensor(high, dtype=dtype)
    inf = torch.tensor(math.inf, dtype=dtype)
    edges = [
        lo,
        hi,
        torch.nextafter(lo, -inf),
        torch.nextafter(lo, inf),
        torch.nextafter(hi, -inf),
        torch.nextafter(hi, inf),
    ]
    special = torch.tensor([math.nan if nan else 1.0, math.inf, -math.inf, 0.0, -0.0], dtype=dtype)
    noise = torch.randn(4093, generator=torch.Generator().manual_seed(0), dtype=dtype) * 4
    return torch.cat([torch.stack(edges), special, noise]).reshape(-1, 8)


@pytest.mark.parametrize("nan", [False, True], ids=["finite", "a NaN"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("low", "high"), BOUNDS)
def test_the_gradient_is_bit_identical_at_and_around_the_bounds(
    low: float, high: float, dtype: torch.dtype, nan: bool
) -> None:
    values = _edge_values(low, high, dtype, nan)
    grad = torch.randn(values.shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
    grad[0, 0] = -0.0
    plain = values.clone().requires_grad_()
    nn.functional.hardtanh(plain, low, high).backward(grad)
    masked = values.clone().requires_grad_()
    out = _encode(masked, low, high)
    assert torch.equal(bits_of(out), bits_of(nn.functional.hardtanh(values, low, high)))
    out.backward(grad)
    assert plain.grad is not None and masked.grad is not None
    assert torch.equal(bits_of(masked.grad), bits_of(plain.grad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradients_stay_identical_over_the_kernels_vector_loop_and_its_scalar_tail(
    dtype: torch.dtype,
) -> None:
    # A length no vector width divides: the kernel's vectorized loop and its scalar tail.
    n = (1 << 19) + 13
    g = torch.Generator().manual_seed(2)
    values = torch.randn(n, generator=g, dtype=dtype) * 4
    values[-6:] = torch.tensor([0.0, 6.0, -0.0, math.nan, 3.0, 6.5], dtype=dtype)  # in the tail
    grad = torch.randn(n, generator=g, dtype=dtype)
    grad[:3] = torch.tensor([math.inf, -math.inf, math.nan], dtype=dtype)  # passed or zeroed
    grad[-4] = math.nan
    plain = values.clone().requires_grad_()
    nn.functional.relu6(plain).backward(grad)
    masked = values.clone().requires_grad_()
    MaskedHardtanh.apply(masked, 0.0, 6.0, "clamp").backward(grad)
    assert plain.grad is not None and masked.grad is not None
    assert torch.equal(bits_of(masked.grad), bits_of(plain.grad))


def test_a_gradient_not_contiguous_and_a_double_backward_match_the_module() -> None:
    values = torch.randn(6, 16, generator=torch.Generator().manual_seed(3)) * 4
    grads = []
    for forward in (nn.functional.relu6, lambda x: _encode(x, 0.0, 6.0)):
        torch.manual_seed(4)  # the same gradients for both
        x = values.clone().requires_grad_()
        out = forward(x)
        # a gradient that is not contiguous: the transpose of a contiguous one
        (by_t,) = torch.autograd.grad(out, x, torch.randn(16, 6).t(), retain_graph=True)
        # a graph of the backward: the gradient's own gradient, through the clamp's backward
        weight = torch.randn(6, 16, requires_grad=True)
        (first,) = torch.autograd.grad(out, x, weight, create_graph=True)
        (second,) = torch.autograd.grad(first.pow(2).sum(), weight)
        grads.append((by_t, first.detach(), second))
    for a, b in zip(*grads, strict=True):
        assert torch.equal(bits_of(a), bits_of(b))


@pytest.mark.parametrize(
    ("low", "high", "dtype"),
    [
        (1.0, 1.0, torch.float32),  # nothing strictly inside
        (0.0, math.inf, torch.float32),
        (1.0, 1.0000001, torch.float32),  # no float32 strictly between
        (0.0, 6.0, torch.bfloat16),
        (-1.0, 1.0, torch.float16),
    ],
)
def test_bounds_and_dtypes_without_a_value_inside_stay_exact(
    low: float, high: float, dtype: torch.dtype
) -> None:
    values = _edge_values(0.0, 6.0, torch.float32, nan=True).to(dtype)
    grad = torch.randn(values.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    plain = values.clone().requires_grad_()
    nn.functional.hardtanh(plain, low, high).backward(grad)
    masked = values.clone().requires_grad_()
    _encode(masked, low, high).backward(grad)
    assert plain.grad is not None and masked.grad is not None
    assert torch.equal(bits_of(masked.grad), bits_of(plain.grad))


def test_a_clamp_saves_its_output_and_not_its_input() -> None:
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    x = torch.randn(3, 5, 7, 11).index_fill_(1, torch.tensor([2]), math.nan).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = MaskedHardtanh.apply(x, 0.0, 6.0, "clamp")
    assert len(saved) == 1
    assert saved[0].untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    assert saved[0].untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_under_saved_tensor_hooks_a_clamp_runs_the_function() -> None:
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    x = torch.randn(3, 5, requires_grad=True) * 4
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = masked_hardtanh(x, 0.0, 6.0, "clamp")
    assert isinstance(out.grad_fn, torch.autograd.function.BackwardCFunction)
    assert [t.untyped_storage().data_ptr() for t in saved] == [out.untyped_storage().data_ptr()]


def test_an_output_changed_in_place_stops_the_clamps_backward() -> None:
    out = _encode(torch.randn(6, requires_grad=True) * 4, 0.0, 6.0)
    out.add_(1.0)
    with pytest.raises(VTensorError, match=r"'clamp'.*in place.*encode_masks=False"):
        out.sum().backward()


class _AddOneInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(1.0)


def test_an_output_changed_in_place_after_the_forward_stops_with_the_module_and_the_fix(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU6(), _AddOneInPlace(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    model(x).sum().backward()  # plain PyTorch allows it: the clamp saved its input
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with vtensor.MemoryManager(1 << 30, storage_dir=tmp_path, encode_masks=True) as mm:
        opt.zero_grad(set_to_none=True)
        with pytest.raises(VTensorError, match=r"'1'.*in place.*encode_masks=False"):
            with mm.step(model, opt, (x,)):
                model(x).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


class Patched(nn.ReLU6):
    """A subclass: its forward may do anything; it keeps it."""


def test_only_exact_clamps_out_of_place_are_wrapped_and_all_come_off() -> None:
    plain, six, in_place, sub = nn.Hardtanh(-1, 1), nn.ReLU6(), nn.ReLU6(inplace=True), Patched()
    own = nn.ReLU6()
    own.forward = lambda x: x  # type: ignore[method-assign]
    modules = [plain, six, in_place, sub, own]
    with masks_encoded(modules) as wrapped:
        assert wrapped == 2
        assert {m for m in modules if "forward" in m.__dict__} == {plain, six, own}
        x = torch.randn(4, 8, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            assert isinstance(six(x).grad_fn, torch.autograd.function.BackwardCFunction)
            assert isinstance(six(x.t()).grad_fn, torch.autograd.function.BackwardCFunction)
        # without saved-tensor hooks too
        assert isinstance(six(x).grad_fn, torch.autograd.function.BackwardCFunction)
        # what saves nothing runs the module's own forward
        assert six(x.detach()).grad_fn is None
        with torch.no_grad():
            assert torch.equal(six(x), nn.functional.relu6(x))
        assert "Masked" not in type(in_place(x.clone()).grad_fn).__name__
    assert [m for m in modules if "forward" in m.__dict__] == [own]


def _saved_bytes(encode: bool, tmp_path: Path) -> tuple[int, int]:
    """Bytes saved for backward in a profiled iteration, and the baseline under them."""
    model = clamp_model()
    with vtensor.MemoryManager(1 << 30, storage_dir=tmp_path, encode_masks=encode) as mm:
        train_clamps(model, mm, 3)
        assert mm.trace is not None
        saved = sum(t.nbytes for t in mm.trace.tensors) + mm.trace.unmanaged_saved_bytes
        return saved, mm.trace.baseline_bytes


def test_a_managed_model_with_clamps_saves_less_and_trains_bit_identically(
    tmp_path: Path,
) -> None:
    unmanaged = clamp_model()
    train_clamps(unmanaged, None, 6)
    plain, _ = _saved_bytes(False, tmp_path)
    encoded, baseline = _saved_bytes(True, tmp_path)
    # five clamps' inputs (8 x 16 x 12 x 12 float32 each) are no longer saved: their outputs,
    # which they save instead, the next layer saves too
    clamp = 8 * 16 * 12 * 12 * 4
    assert plain - encoded == 5 * clamp
    # a budget that never binds, and one that binds under the encoded bytes
    for budget in (1 << 30, baseline + int(encoded * 0.75)):
        model = clamp_model()
        with vtensor.MemoryManager(
            budget, storage_dir=tmp_path, recompute=True, encode_masks=True
        ) as mm:
            train_clamps(model, mm, 6)
            assert mm.report().plan_source != "profiled"
            acted = any(r.bytes_out or r.recomputed for r in mm.reports)
            assert acted == (budget < 1 << 30), mm.reports
        for a, b in zip(model.parameters(), unmanaged.parameters(), strict=True):
            assert torch.equal(bits_of(a), bits_of(b))


def test_a_block_with_an_encoded_clamp_may_still_be_recomputed(tmp_path: Path) -> None:
    model = clamp_model()
    with vtensor.MemoryManager(
        1 << 30, storage_dir=tmp_path, recompute=True, encode_masks=True
    ) as mm:
        train_clamps(model, mm, 2)
        assert mm.trace is not None
        units = {u.name: u for u in mm.trace.units}
    assert units, "nothing was profiled as a unit"
    blocks = [units[n] for n in ("1", "2", "3") if n in units]
    assert blocks and all(u.safe for u in blocks), [(u.name, u.why_unsafe) for u in blocks]


def test_the_plan_key_tells_encoded_plans_apart(tmp_path: Path) -> None:
    digests = set()
    for encode in (False, True):
        model = clamp_model()
        with vtensor.MemoryManager(
            1 << 30, storage_dir=tmp_path, plan_cache_dir=tmp_path / "plans", encode_masks=encode
        ) as mm:
            train_clamps(model, mm, 2)
        digests |= {p.name for p in (tmp_path / "plans").glob("*.json")}
    assert len(digests) == 2, digests
