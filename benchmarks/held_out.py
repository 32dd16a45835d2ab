"""Models no test uses, at a fraction of their peak: the hybrid manager against checkpointing.

Six small models built here and nowhere else, each with a pattern the zoo lacks: a DenseNet
(each layer takes the list of all earlier features, which its caller then extends), squeeze-and-
excitation gating (SiLU, Hardswish, sigmoid scales), a ConvNeXt (depthwise 7x7, LayerNorm over
channels-last, GELU, layer scale, stochastic depth drawn from torch's generator), a ViT with
``nn.MultiheadAttention`` (self-attention: the same tensor as query, key and value; dropout), a
two-layer GRU language model, and a small U-Net (skip concatenation, transposed convolution,
in-place ReLU). Per model, in one process and in turns step by step from the same weights:
unmanaged; ``MemoryManager(budget, recompute=True, encode_masks="auto")`` at the fraction of
the model's peak (tracked bytes, measured by a manager whose budget never binds); and
``torch.utils.checkpoint`` (non-reentrant) on every block, one line of code a user would write
instead. Per model: the budget, the managed iteration's highest tracked peak against it,
whether every gradient is bit-identical to the unmanaged one, the median managed step over the
steps that replayed the kept plan (profiling, trials and races left out) against the unmanaged
median over the same steps, checkpointing's the same way with its tracked peak against the
budget (a checkpointed copy under a budget that never binds), and the modules recomputed and
MiB moved by the last managed step. A budget below the model's floor is reported with the
minimum the manager states. The process keeps glibc's default allocator settings, as a user's
would. Run from the repository root::

    python -m benchmarks.held_out --out held_out.jsonl
    python -m benchmarks.held_out --quick    # CI-sized; its rows are not results
"""

import argparse
import copy
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import vtensor
from benchmarks.common import (
    add_out,
    add_quick,
    describe,
    environment,
    tagged,
    write_json_lines,
)

MIB = 1 << 20


class DenseLayer(nn.Module):
    def __init__(self, c: int, growth: int) -> None:
        super().__init__()
        self.bn, self.conv = nn.BatchNorm2d(c), nn.Conv2d(c, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        return self.conv(F.relu(self.bn(torch.cat(features, 1))))


class DenseNet(nn.Module):
    def __init__(self, layers: int = 6, growth: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.blocks = nn.ModuleList(DenseLayer(32 + growth * i, growth) for i in range(layers))
        self.head = nn.Linear(32 + growth * layers, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [self.stem(x)]
        for layer in self.blocks:
            features.append(layer(features))  # the list the layer was given grows afterwards
        return self.head(torch.cat(features, 1).mean((2, 3)))


class SEBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.fc1, self.fc2 = nn.Linear(c, c // 4), nn.Linear(c // 4, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.silu(self.bn(self.conv(x)))
        scale = torch.sigmoid(self.fc2(F.silu(self.fc1(y.mean((2, 3))))))
        return x + y * scale[:, :, None, None]


class SENet(nn.Module):
    def __init__(self, c: int = 48, depth: int = 6) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, stride=2, padding=1)
        self.blocks = nn.ModuleList(SEBlock(c) for _ in range(depth))
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.hardswish(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


class NeXtBlock(nn.Module):
    def __init__(self, c: int, drop: float) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(c), nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(torch.full((c,), 0.1))
        self.drop = drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw(x).permute(0, 2, 3, 1)
        y = (self.fc2(F.gelu(self.fc1(self.norm(y)))) * self.gamma).permute(0, 3, 1, 2)
        if self.training and self.drop > 0:  # stochastic depth, from torch's generator
            keep = (torch.rand(x.shape[0], 1, 1, 1) > self.drop).to(y.dtype) / (1 - self.drop)
            y = y * keep
        return x + y


class ConvNeXt(nn.Module):
    def __init__(self, c: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 4, stride=4)
        self.blocks = nn.ModuleList(NeXtBlock(c, 0.1) for _ in range(depth))
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


class ViTBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * d, d)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]  # self-attention: query is key
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, d: int = 96, depth: int = 4) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, d, 8, stride=8)
        self.pos = nn.Parameter(torch.zeros(1, 64, d))
        self.blocks = nn.ModuleList(ViTBlock(d) for _ in range(depth))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


class GRUNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 64)
        self.gru = nn.GRU(64, 128, 2, batch_first=True, dropout=0.1)
        self.head = nn.Linear(128, 64)
        self.blocks = nn.ModuleList([self.gru])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.emb(x))[0])


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down1 = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=True))
        self.down2 = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(inplace=True))
        self.mid = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(32, 16, 2, stride=2)
        self.out = nn.Conv2d(32, 10, 3, padding=1)
        self.blocks = nn.ModuleList([self.down1, self.down2, self.mid, self.up, self.out])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.down1(x)
        u = F.interpolate(self.up(self.mid(self.down2(a))), size=a.shape[-2:])
        return self.out(torch.cat([a, u], 1)).mean((2, 3))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "densenet": DenseNet,
    "senet": SENet,
    "convnext": ConvNeXt,
    "vit": ViT,
    "gru": GRUNet,
    "unet": UNet,
}


def _batch(name: str, step: int, batch: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    if name == "gru":
        x = torch.randint(0, 64, (batch, size), generator=g)
        return x, torch.randint(0, 64, (batch, size), generator=g)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(
        0, 10, (batch,), generator=g
    )


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _checkpointed_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss with every block under ``torch.utils.checkpoint``, as a user would wrap them."""
    blocks = list(model.blocks)  # type: ignore[arg-type]
    for block in blocks:
        forward = block.forward

        def wrapped(*args: Any, forward: Callable[..., Any] = forward) -> Any:
            # A list argument is copied: checkpointing would see the caller's later appends.
            copied = [list(a) if isinstance(a, list) else a for a in args]
            return checkpoint(forward, *copied, use_reentrant=False)

        block.forward = wrapped  # type: ignore[method-assign]
    try:
        return _loss(model, x, y)
    finally:
        for block in blocks:
            del block.forward


def _peak(name: str, model: nn.Module, batch: int, size: int, checkpointed: bool = False) -> int:
    """The tracked peak of two steps of a copy of ``model``, under a budget that never binds."""
    probe = copy.deepcopy(model)
    opt = torch.optim.SGD(probe.parameters(), lr=0.01, momentum=0.9)
    loss = _checkpointed_loss if checkpointed else _loss
    with vtensor.MemoryManager("1TiB", storage_dir=tempfile.mkdtemp()) as mm:
        for step in range(2):
            x, y = _batch(name, step, batch, size)
            with mm.step(probe, opt, (x, y)):
                loss(probe, x, y).backward()
            opt.step()
            opt.zero_grad()
        return max(r.peak_device_bytes for r in mm.reports)


def run_model(name: str, steps: int, fraction: float, batch: int, size: int) -> dict[str, Any]:
    """One model: unmanaged, managed and checkpointed, in turns step by step."""
    torch.manual_seed(0)
    ref = MODELS[name]()
    managed, checkpointed = copy.deepcopy(ref), copy.deepcopy(ref)
    models = (ref, managed, checkpointed)
    opts = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in models]
    peak = _peak(name, ref, batch, size)
    budget = int(fraction * peak)
    row: dict[str, Any] = {"model": name, "peak_bytes": peak, "budget_bytes": budget}
    times: dict[str, list[float]] = {"unmanaged": [], "managed": [], "checkpoint": []}
    identical, worst = True, 0
    mm = vtensor.MemoryManager(
        budget, storage_dir=tempfile.mkdtemp(), recompute=True, encode_masks="auto"
    )
    try:
        for step in range(steps):
            x, y = _batch(name, step, batch, size)
            for variant, model in zip(times, models, strict=True):
                torch.manual_seed(100 + step)  # dropout and stochastic depth alike
                begin = time.perf_counter()
                if variant == "managed":
                    with mm.step(model, opts[1], (x, y)):
                        _loss(model, x, y).backward()
                elif variant == "checkpoint":
                    _checkpointed_loss(model, x, y).backward()
                else:
                    _loss(model, x, y).backward()
                times[variant].append(time.perf_counter() - begin)
            worst = max(worst, mm.report().peak_device_bytes)
            identical &= all(
                torch.equal(a.grad, b.grad)
                for a, b in zip(ref.parameters(), managed.parameters(), strict=True)
                if a.grad is not None
            )
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
    except vtensor.InfeasibleBudgetError as err:
        row["min_budget_bytes"] = err.min_budget_bytes
        return row
    finally:
        mm.close()
    last = mm.reports[-1]
    # Steady steps only: the profiled, trial and race iterations are the decision's, not the plan's.
    steady = [i for i, r in enumerate(mm.reports) if r.plan_source.value in ("planned", "cached")]
    if not steady:
        row["error"] = "no steady step: raise --steps"
        return row
    medians = {v: statistics.median(t[i] for i in steady) for v, t in times.items()}
    row.update(
        steady_steps=len(steady),
        checkpoint_peak_bytes=_peak(name, ref, batch, size, checkpointed=True),
        worst_peak_bytes=worst,
        grads_identical=identical,
        managed_vs_unmanaged=medians["managed"] / medians["unmanaged"],
        checkpoint_vs_unmanaged=medians["checkpoint"] / medians["unmanaged"],
        unmanaged_step_s=medians["unmanaged"],
        recomputed_modules=len(last.recomputed),
        mib_out_last_step=last.bytes_out / MIB,
        plan_sources=[r.plan_source.value for r in mm.reports],
    )
    return row


def _table(rows: list[dict[str, Any]], fraction: float) -> str:
    lines = [
        f"| model | peak MiB | budget MiB ({fraction:.0%}) | managed peak / budget | grads "
        "identical | managed step | checkpoint peak / budget | checkpoint step | steady steps "
        "| modules recomputed | MiB out |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['model']} | {r['peak_bytes'] / MIB:.1f} | {r['budget_bytes'] / MIB:.1f} |"
        if "min_budget_bytes" in r:
            lines.append(f"{head} infeasible: minimum {r['min_budget_bytes'] / MIB:.1f} MiB |")
            continue
        if "error" in r:
            lines.append(f"{head} {r['error']} |")
            continue
        lines.append(
            f"{head} {r['worst_peak_bytes'] / r['budget_bytes']:.2f} | "
            f"{'yes' if r['grads_identical'] else 'NO'} | {r['managed_vs_unmanaged']:.2f}x | "
            f"{r['checkpoint_peak_bytes'] / r['budget_bytes']:.2f} | "
            f"{r['checkpoint_vs_unmanaged']:.2f}x | {r['steady_steps']} | "
            f"{r['recomputed_modules']} | {r['mib_out_last_step']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run each model, print the table, write the JSON lines."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_quick(p, "two models, 16 steps, batch 4")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--steps", type=int, default=30, help="steps per model (default 30)")
    p.add_argument("--fraction", type=float, default=0.5, help="budget / peak (default 0.5)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    add_out(p)
    args = p.parse_args(argv)
    batch, size = (4, 64) if args.quick else (16, 64)
    if args.quick:
        args.models, args.steps = ["senet", "vit"], 16
    torch.set_num_threads(args.threads)
    env = environment(script="held_out", steps=args.steps, fraction=args.fraction)
    print(describe(env), flush=True)
    rows = []
    for name in args.models:
        rows.append(run_model(name, args.steps, args.fraction, batch, size))
        print(f"# {name} done", flush=True)
    print(_table(rows, args.fraction))
    if args.out:
        write_json_lines(args.out, env, tagged("held_out", rows))


if __name__ == "__main__":
    main()
