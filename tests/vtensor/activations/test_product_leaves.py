"""Product leaves: linear layers, products outside them, autocast (NOTE [cached products])."""

from pathlib import Path

import pytest
import torch
from test_cached_products import (
    STEPS,
    Dense,
    Functional,
    Host,
    Inverted,
    Reflected,
    _answered,
    _batch,
    _grads,
    _loss,
    _model,
    _units,
)
from torch import nn

import vtensor
from benchmarks.zoo.language import CharGPTBlock
from vtensor.activations.recompute import recompute_modules


class Mlp(nn.Module):
    """A transformer's MLP block on (batch, tokens, width): layer norm, two linears, GELU."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


@pytest.mark.parametrize("by_grad", [False, True], ids=["backward", "autograd.grad"])
def test_linear_products_answered_give_the_gradients_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, by_grad: bool
) -> None:
    # A matrix product's backward takes branches on its operands' strides: answered below
    # autograd, the op is recorded as without recomputation, and its backward is the same.
    # Contiguous tokens (a 3-d input) and a transposed image (Dense: a 4-d strided input).
    answered = _answered(monkeypatch)

    def tokens(step: int) -> torch.Tensor:
        return torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(step))

    for make, batch, units in (
        (lambda: nn.Sequential(Mlp(), Mlp()), tokens, ["0", "1"]),
        (lambda: _model(Dense, Dense), lambda step: _batch(step)[0], ["1", "2"]),
    ):
        torch.manual_seed(0)
        model = make()
        torch.manual_seed(0)
        twin = make()
        for step in range(STEPS):
            answered[0] = 0
            twin.zero_grad(set_to_none=True)
            twin(batch(step)).square().sum().backward()  # type: ignore[no-untyped-call]
            model.zero_grad(set_to_none=True)
            with recompute_modules(model, units, Host(), units, one_node=units):  # type: ignore[arg-type]
                loss = model(batch(step)).square().sum()
                if by_grad:
                    params = list(model.parameters())
                    for p, g in zip(params, torch.autograd.grad(loss, params), strict=True):
                        p.grad = g
                else:
                    loss.backward()  # type: ignore[no-untyped-call]
            assert answered[0] == sum(
                isinstance(m, nn.Linear) for u in units for m in model.get_submodule(u).modules()
            )
            assert all(map(torch.equal, _grads(twin), _grads(model))), f"step {step}"


@pytest.mark.parametrize(
    ("kinds", "products"), [((Inverted,), 3), ((Reflected, Dense), 4)], ids=["conv", "linear"]
)
def test_under_autocast_kept_outputs_answer_with_the_same_gradients(
    monkeypatch: pytest.MonkeyPatch, kinds: tuple[type[nn.Module], ...], products: int
) -> None:
    # Autocast casts a product op's operands inside the module's call: the mode, below
    # autograd, answers the op on the cast operands, and autograd records the casts and the op
    # as it does without recomputation.
    answered = _answered(monkeypatch)
    model, twin = _model(*kinds), _model(*kinds)
    names = [str(i + 1) for i in range(len(kinds))]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _loss(twin, 0).backward()  # type: ignore[no-untyped-call]
        with recompute_modules(model, names, Host(), names, one_node=names):  # type: ignore[arg-type]
            _loss(model, 0).backward()  # type: ignore[no-untyped-call]
    assert answered[0] == products  # every product op of the units in backward
    assert all(map(torch.equal, _grads(twin), _grads(model)))


def test_under_autocast_the_profile_keeps_products(tmp_path: Path) -> None:
    model = _model(Inverted)
    with vtensor.MemoryManager("1GiB", storage_dir=tmp_path, recompute=True) as mm:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with mm.step(model, opt, inputs=_batch(0)), torch.autocast("cpu", dtype=torch.bfloat16):
            _loss(model, 0).backward()  # type: ignore[no-untyped-call]
        assert mm.trace is not None
        unit = next(u for u in mm.trace.units if u.name == "1")
    assert unit.selective_safe and unit.cached_products


def test_products_outside_the_leaves_run_again_and_the_gradients_agree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The depthwise convolution by F.conv2d and a char GPT block's attention products (the
    # scores and the weighted values) run outside any product leaf: they run again, and the
    # leaves' products are answered.
    answered = _answered(monkeypatch)

    def tokens(step: int) -> torch.Tensor:
        return torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(step))

    for make, batch, units, leaf_products in (
        (lambda: _model(Functional, Functional), lambda step: _batch(step)[0], ["1", "2"], 4),
        (lambda: nn.Sequential(CharGPTBlock(16, 2), CharGPTBlock(16, 2)), tokens, ["0", "1"], 8),
    ):
        torch.manual_seed(0)
        model = make()
        torch.manual_seed(0)
        twin = make()
        for step in range(STEPS):
            answered[0] = 0
            twin.zero_grad(set_to_none=True)
            twin(batch(step)).square().sum().backward()  # type: ignore[no-untyped-call]
            model.zero_grad(set_to_none=True)
            with recompute_modules(model, units, Host(), units, one_node=units):  # type: ignore[arg-type]
                model(batch(step)).square().sum().backward()  # type: ignore[no-untyped-call]
            assert answered[0] == leaf_products
            assert all(map(torch.equal, _grads(twin), _grads(model))), f"step {step}"


def test_the_profile_keeps_only_what_the_leaves_make_and_prices_the_rest(tmp_path: Path) -> None:
    units = _units(_model(Inverted, Functional), tmp_path)
    whole, partial = units["1"], units["2"]
    assert whole.cached_products and partial.cached_products
    # The same block but for its depthwise convolution, which the cache does not keep: its
    # output is freed with the rest, and running it again is part of the cost.
    assert len(partial.product_vids) < len(whole.product_vids)
    assert len(partial.selective_vids) > len(whole.selective_vids)
    assert partial.selective_s > whole.selective_s - whole.overhead_s


def test_a_char_gpt_block_keeps_its_linear_outputs_and_frees_its_attention(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(32, 32), CharGPTBlock(32, 2), nn.Linear(32, 5))
    x = torch.randn(4, 32, 32, generator=torch.Generator().manual_seed(0))
    with vtensor.MemoryManager("1GiB", storage_dir=tmp_path, recompute=True) as mm:
        with mm.step(model, None, inputs=(x,)):
            model(x).square().sum().backward()  # type: ignore[no-untyped-call]
        assert mm.trace is not None
        trace = mm.trace
    block = next(u for u in trace.units if u.name == "1")
    assert block.selective_safe and block.cached_products
    freed = {trace.tensors[v].nbytes for v in block.selective_vids}
    probs = 4 * 2 * 32 * 32 * 4  # (batch, heads, tokens, tokens) float32: softmax's output
    assert probs in freed
