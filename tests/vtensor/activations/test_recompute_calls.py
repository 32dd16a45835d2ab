"""Recomputed units called the ways models call modules (NOTE [call snapshot] in recompute.py).

Keyword arguments, a dict and tuple output with a 0-dim tensor in it, non-tensor arguments, a
view of another argument, nested containers, a statistic taken under ``torch.no_grad``, and
``nn.MultiheadAttention`` with a padding mask returning its weights: every such unit is found
safe, recomputed whole, and training stays bit-identical.
"""

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from recompute_models import recomputing, train
from torch import nn

import vtensor
from vtensor.planner.trace import Trace

WIDTH = 128
UNITS = ("keywords", "dict_out", "non_tensor", "views", "nested", "no_grad_stat", "attention")


class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm, self.drop = (
            nn.Linear(WIDTH, WIDTH),
            nn.BatchNorm1d(WIDTH),
            nn.Dropout(0.1),
        )

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.tanh(self.norm(self.fc(x))))


class Keywords(_Base):
    def forward(
        self, x: torch.Tensor, *, scale: float = 1.0, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return x + self.inner(x) * scale * (mask if mask is not None else 1.0)


class DictOut(_Base):
    def forward(self, x: torch.Tensor) -> dict[str, object]:
        y = self.inner(x)
        return {"out": x + y, "aux": (y * 2, y.square().mean())}


class NonTensor(_Base):
    def forward(self, x: torch.Tensor, n: int, mode: str, unused: None = None) -> torch.Tensor:
        y = self.inner(x)
        return x + (y * n if mode == "mul" else y + n)


class Views(_Base):
    def forward(self, x: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x) + F.pad(part, (0, WIDTH - part.shape[1]))


class Nested(_Base):
    def forward(self, call: dict[str, list[torch.Tensor]]) -> torch.Tensor:
        a, b = call["pair"]
        return a + self.inner(b)


class NoGradStat(_Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = x.abs().mean()
        return x + self.inner(x / (scale + 1))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 4, dropout=0.1, batch_first=True)

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        out, weights = self.attn(h, h, h, key_padding_mask=padding, need_weights=True)
        return x + out + weights.mean()


class Calls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(64, WIDTH), nn.Linear(WIDTH, 10)
        self.keywords, self.dict_out, self.non_tensor = Keywords(), DictOut(), NonTensor()
        self.views, self.nested, self.no_grad_stat = Views(), Nested(), NoGradStat()
        self.attention = Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        h = self.keywords(h, scale=0.5, mask=(h > 0).float())
        d = self.dict_out(h)
        h = d["out"] + d["aux"][0] * 0.1 + d["aux"][1]
        h = self.non_tensor(h, 3, "mul")
        h = self.views(h, h[:, :32])
        h = self.nested({"pair": [h, h * 0.5]})
        h = self.no_grad_stat(h)
        seq = h.view(-1, 8, WIDTH)
        padding = torch.zeros(seq.shape[0], 8, dtype=torch.bool)
        padding[:, -1] = True
        return self.last(self.attention(seq, padding).reshape(-1, WIDTH))


def test_units_called_every_way_recompute_bit_identically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    profiled: dict[str, str] = {}

    def every_top_unit(trace: Trace, _budget_bytes: int) -> tuple[str, ...]:
        profiled.update({u.name: u.why_unsafe for u in trace.units})
        return tuple(sorted(n for n in UNITS if n in profiled and not profiled[n]))

    recomputing(monkeypatch, every_top_unit, keep=True)
    torch.manual_seed(0)
    reference = Calls()
    model = copy.deepcopy(reference)
    want = train(reference, None)
    with vtensor.MemoryManager("1TiB", storage_dir=tmp_path) as probe:
        train(copy.deepcopy(model), probe)
        peak = max(r.peak_device_bytes for r in probe.reports)
    with vtensor.MemoryManager(int(peak * 0.6), storage_dir=tmp_path, recompute=True) as mm:
        got = train(model, mm)
        recomputed = {name for r in mm.reports for name in r.recomputed}
    assert {n: profiled.get(n, "not profiled") for n in UNITS} == dict.fromkeys(UNITS, "")
    assert recomputed == set(UNITS)
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"step {step}"
