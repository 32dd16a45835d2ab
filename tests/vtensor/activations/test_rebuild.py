"""A unit recomputed whole through one autograd node (NOTE [one-node recomputation]).

Each test runs steps with the units recomputed (``recompute_modules``, a stand-in host) beside the
same model without recomputation, through one node or through torch's checkpointing.
"""

import contextlib
from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

import vtensor.activations.rebuild
from vtensor.activations.hooks import install_module_hooks
from vtensor.activations.rebuild import Rebuild, one_node
from vtensor.activations.recompute import recompute_modules

STEPS = 3


class Host:
    """What ``recompute_modules`` and the module hooks tell (no manager): the steps seen."""

    def __init__(self) -> None:
        self.recomputing = 0
        self.steps: list[str] = []
        self.boundaries: Any = None

    def recompute_began(self, regrowth_bytes: int) -> None:
        pass

    def recompute_ended(self) -> None:
        pass

    def begin_step(self, name: str) -> None:
        self.steps.append(name)

    def after_node(self) -> None:
        pass


class Block(nn.Module):
    """Convolution, batch norm, dropout: randomness and buffers that a second run must repeat."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.relu(self.norm(self.conv(x))))


class Residual(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + super().forward(x)


class Pair(Block):
    """Returns a dict: no one node can stand for it."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        y = super().forward(x)
        return {"out": y, "aux": y.mean()}


class FromPair(nn.Module):
    def forward(self, pair: dict[str, torch.Tensor]) -> torch.Tensor:
        return pair["out"] + pair["aux"]


class Borrower(Block):
    """Uses a parameter it does not own (an attribute outside its modules)."""

    def __init__(self, shared: nn.Parameter) -> None:
        super().__init__()
        self.__dict__["shared"] = shared  # not registered: not among its parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.__dict__["shared"]


def _models(make: Any) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = make()
    twin = make()
    twin.load_state_dict(model.state_dict())
    return model, twin


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out.square().mean() + out.sum() * 1e-3


def _train(
    make: Any,
    names: list[str],
    *,
    by_grad: bool = False,
    hooked: bool = False,
    through_checkpoint: bool = False,
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]], Host, nn.Module]:
    """STEPS steps recomputed and plain, from the same weights, batches and RNG states.

    Recomputed through one node, or with ``through_checkpoint`` through torch's checkpointing.
    """
    model, twin = _models(make)
    host = Host()
    names_by_id = {id(m): n for n, m in model.named_modules()}
    seen: list[list[torch.Tensor]] = []
    expected: list[list[torch.Tensor]] = []
    for step in range(STEPS):
        x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(step))
        for which, net in (("plain", twin), ("recomputed", model)):
            torch.manual_seed(100 + step)
            net.zero_grad(set_to_none=True)
            if which == "plain":
                loss = _loss(net, x)
            else:
                host.steps.clear()
                whole = () if through_checkpoint else names
                with recompute_modules(net, names, host, one_node=whole):  # type: ignore[arg-type]
                    host.boundaries = install_module_hooks(names_by_id, host) if hooked else None
                    try:
                        loss = _loss(net, x)
                        if by_grad:
                            grads = torch.autograd.grad(loss, list(net.parameters()))
                            for p, g in zip(net.parameters(), grads, strict=True):
                                p.grad = g
                        else:
                            loss.backward()  # type: ignore[no-untyped-call]
                    finally:
                        if host.boundaries is not None:
                            host.boundaries.remove()
                seen.append(_grads(net))
                continue
            loss.backward()  # type: ignore[no-untyped-call]
            expected.append(_grads(net))
    return seen, expected, host, model


def _assert_same(seen: list[list[torch.Tensor]], expected: list[list[torch.Tensor]]) -> None:
    assert len(seen) == len(expected) == STEPS
    for step, (a, b) in enumerate(zip(seen, expected, strict=True)):
        assert len(a) == len(b)
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True)), f"step {step} differs"


def _stack(block: Any) -> nn.Sequential:
    return nn.Sequential(block(), Residual(), block(), nn.Flatten(), nn.Linear(256, 3))


def _judged(model: nn.Module, name: str, x: torch.Tensor) -> bool:
    """``one_node``'s verdict on module ``name`` of ``model`` as the profile gives it."""
    verdict: list[bool] = []

    def post(module: nn.Module, args: Any, output: Any) -> None:
        verdict.append(one_node(module, output, [a for a in args if isinstance(a, torch.Tensor)]))

    handle = dict(model.named_modules())[name].register_forward_hook(post)
    try:
        _loss(model, x)
    finally:
        handle.remove()
    return verdict[0]


def _batch() -> torch.Tensor:
    return torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("by_grad", [False, True], ids=["backward", "autograd.grad"])
def test_one_node_gives_the_gradients_of_training_without_recomputation(by_grad: bool) -> None:
    # Block 0 takes the batch itself (nothing that requires grad comes in: its parameters'
    # gradients must still flow); torch.autograd.grad, which torch's reentrant checkpointing
    # cannot follow, gets every gradient too.
    seen, expected, _, model = _train(lambda: _stack(Block), ["0", "1", "2"], by_grad=by_grad)
    assert all(_judged(model, n, _batch()) for n in ("0", "1", "2"))
    _assert_same(seen, expected)


def test_the_units_run_through_one_node() -> None:
    calls: list[int] = []
    apply = Rebuild.apply

    def counted(*args: Any) -> Any:
        calls.append(1)
        return apply(*args)

    Rebuild.apply = counted  # type: ignore[method-assign]
    try:
        _train(lambda: _stack(Block), ["0", "2"])
        assert len(calls) == 2 * STEPS  # two blocks, every step
        _train(lambda: _stack(Block), ["0", "2"], through_checkpoint=True)
        assert len(calls) == 2 * STEPS
    finally:
        Rebuild.apply = apply  # type: ignore[method-assign]


def test_the_module_hooks_see_the_same_steps_through_one_node_as_through_checkpointing() -> None:
    # A replay follows its plan's steps: the graph rebuilt in backward must give the same
    # backward boundaries as checkpointing's, where the last inner module's output is the
    # block's own (Block: its dropout's) and where the block adds its own op (Residual).
    _, _, checkpointed, _ = _train(
        lambda: _stack(Block), ["0", "1", "2"], hooked=True, through_checkpoint=True
    )
    _, _, rebuilt, _ = _train(lambda: _stack(Block), ["0", "1", "2"], hooked=True)
    steps = checkpointed.steps
    assert any(s.startswith("backward:0.") for s in steps), steps
    assert "backward:1" in steps and "backward:0" not in steps
    assert rebuilt.steps == steps


def test_a_unit_with_a_dict_output_is_not_one_node() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Pair(), FromPair(), nn.Flatten(), nn.Linear(256, 3))
    assert _judged(model, "0", _batch()) and not _judged(model, "1", _batch())


def test_a_unit_that_uses_a_parameter_not_its_own_is_not_one_node() -> None:
    torch.manual_seed(1)
    shared = nn.Parameter(torch.full((1,), 1.5))
    model = nn.Sequential(Block(), Borrower(shared), nn.Flatten(), nn.Linear(256, 3))
    model.register_parameter("shared", shared)
    assert _judged(model, "0", _batch()) and not _judged(model, "1", _batch())


def test_a_unit_that_returns_its_input_is_not_one_node() -> None:
    class Passthrough(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Passthrough(), nn.Flatten(), nn.Linear(256, 3))
    assert not _judged(model, "1", _batch())


@pytest.mark.parametrize("outer", [False, True], ids=["no hooks", "under hooks"])
def test_the_rebuilt_graph_takes_hooks_of_its_own_only_in_front_of_others(
    monkeypatch: pytest.MonkeyPatch, outer: bool
) -> None:
    # NOTE [own hooks]: with no saved-tensor hooks in force (a quiet replay) the rebuilt graph
    # saves as autograd does; under others (the manager's), its own stand in front of them, so
    # the others see the node's inputs only, never the rebuilt graph's tensors.
    held: list[int] = []
    own = vtensor.activations.rebuild._hold
    monkeypatch.setattr(vtensor.activations.rebuild, "_hold", lambda t: (held.append(1), own(t))[1])
    packed: list[torch.Size] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(tensor.shape)
        return tensor

    hooks = saved_tensors_hooks(pack, lambda t: t) if outer else contextlib.nullcontext()
    with hooks:
        seen, expected, _, _ = _train(lambda: _stack(Block), ["0", "1", "2"])
    _assert_same(seen, expected)  # the same gradients either way
    if not outer:
        assert not held
    else:
        assert held  # the rebuilt graph's saves went to the node's own hooks
        # The outer hooks saw what the plain twin saves and the few tensors of the units' nodes
        # and the head (39 a step against 33); the rebuilt graphs' 30 more never reached them.
        plain = _saved_by(lambda: _stack(Block))
        assert len(packed) < STEPS * (plain + plain // 2), (len(packed), plain)


def _saved_by(make: Any) -> int:
    """How many tensors one plain forward of ``make()`` saves."""
    count: list[int] = []
    with saved_tensors_hooks(lambda t: (count.append(1), t)[1], lambda t: t):
        _loss(make(), _batch())
    return len(count)
