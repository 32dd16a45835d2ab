"""A recomputation runs from the call as it was (NOTE [call snapshot] in recompute.py).

Each block below hands its inner unit arguments that torch's checkpointing alone would give back
changed at recomputation: a list its caller changes after the call, the same tensor twice to a
forward that branches on identity (as ``nn.MultiheadAttention`` does), a list the unit appends
to; and one whose unit returns a 0-dim tensor beside its output, which the check that a
second forward reproduces the first compares byte by byte. The plan is made to recompute that
unit; training must stay bit-identical, and the caller's list must grow once per call.
"""

from pathlib import Path

import pytest
import torch
from recompute_models import Block, assert_same, hybrid_run, recomputing

from vtensor.planner.trace import Trace, TraceUnit


class _Outer(Block):
    """A block around an inner unit of type ``INNER`` (the unit the plan recomputes)."""

    INNER: type[Block] = Block

    def __init__(self, width: int, dropout: float = 0.0) -> None:
        super().__init__(width, dropout)
        self.inner = self.INNER(width, dropout)


class _Listed(Block):
    def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return super().forward(xs[-1])


class ListChangedAfter(_Outer):
    """Its caller puts another tensor of the same shape in the list after the call."""

    INNER = _Listed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = [x]
        y = self.inner(xs)
        xs.append(y * 0.5)  # a recomputation from this list would start from another tensor
        return y


class _Twice(Block):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if a is b:  # self-attention's branch in nn.MultiheadAttention
            return super().forward(a)
        return super().forward(a + b)


class SameTensorTwice(_Outer):
    INNER = _Twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x)
        return self.inner(h, h)


class _WithScalar(Block):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        y = super().forward(x)
        return y, y.square().mean()  # a 0-dim tensor beside the output (an auxiliary loss)


class ScalarBeside(_Outer):
    """Its inner unit returns a 0-dim tensor too, which the reproduction check compares."""

    INNER = _WithScalar

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, aux = self.inner(x)
        return y + aux


class _Appending(Block):
    def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        y = super().forward(xs[-1])
        xs.append(y)
        return y


class AppendsToItsList(_Outer):
    INNER = _Appending

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = [x]
        y = self.inner(xs)
        if len(xs) != 2:
            raise AssertionError(f"the list grew by {len(xs) - 1} in one call")
        return y


@pytest.mark.parametrize(
    "kind",
    [ListChangedAfter, SameTensorTwice, AppendsToItsList, ScalarBeside],
    ids=lambda k: k.__name__,
)
def test_a_recomputed_unit_runs_from_its_call_as_it_was(
    kind: type[Block], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    profiled: list[TraceUnit] = []

    def the_inner_unit(trace: Trace, _budget_bytes: int) -> tuple[str, ...]:
        profiled.extend(trace.units)
        return ("3.inner",)

    recomputing(monkeypatch, the_inner_unit, keep=True)
    model, grads, reports, _ = hybrid_run(kind, 0.5, tmp_path)
    inner = next(u for u in profiled if u.name == "3.inner")
    assert inner.safe, inner.why_unsafe
    assert any("3.inner" in r.recomputed for r in reports), "the inner unit was not recomputed"
    assert_same(kind, model, grads)
