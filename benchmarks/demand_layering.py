"""Demand layering: parameter memory and latency against the resident model and accelerate.

Per model (``benchmarks/zoo/``: MobileNetV2, ResNet-18, the char GPT; plus a deep MLP whose
parameters dwarf its activations) it times one inference forward of:

- ``resident``: the model in memory, the reference (outputs of the others must equal it);
- ``dl-k<N>``: ``vtensor.DemandLayering`` with ``lookahead=N`` (the knob), streaming from a
  weight file written by ``vtensor.write_weights``;
- ``accelerate``: Hugging Face accelerate's ``disk_offload`` of the same model (its own offload
  folder of ``.dat`` files), when accelerate is installed.

Each forward is timed with the files warm in the page cache and cold (every file of the variant
evicted with ``posix_fadvise(DONTNEED)`` just before the run); rounds interleave the variants and
the table gives medians. Memory is measured two ways: tracked parameter bytes (demand layering's
own count of what it allocated and held; the model's bytes for ``resident``; for accelerate the
most parameter bytes that were not on ``meta`` at any op, seen by a dispatch-mode probe) and the
RSS rise of a fresh process that builds the variant and runs two forwards (process-wide:
activations, workspaces and allocator slack included; honest only with
``MALLOC_MMAP_THRESHOLD_=65536``, which the script sets by re-executing itself).

Run from the repository root::

    python -m benchmarks.demand_layering                  # full run
    python -m benchmarks.demand_layering --quick          # CI-sized
    python -m benchmarks.demand_layering --models mlp --rounds 7 --out results.jsonl
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import vtensor
from benchmarks.common import (
    add_out,
    add_quick,
    describe,
    environment,
    reexec_with_honest_rss,
    tagged,
    write_json_lines,
)
from benchmarks.zoo import DeepMLP, workloads
from vtensor.layering.weightfile import evict_page_cache
from vtensor.measure.rss import RssMeter

try:
    import accelerate  # type: ignore[import-untyped]
except ImportError:  # a benchmark-only comparison: rows say it was not installed
    accelerate = None

MiB = 2**20
# The repository root: the RSS probes run ``python -m benchmarks.demand_layering`` from there.
ROOT = Path(__file__).resolve().parents[1]


def model_specs(
    quick: bool, batch_scale: float
) -> dict[str, tuple[str, Callable[[], nn.Module], torch.Tensor]]:
    """name -> (description, build, input)."""
    specs = {}
    for key, name in (("mobilenet", "cnn"), ("resnet", "resnet"), ("gpt", "transformer")):
        w = workloads(quick, batch_scale)[key]
        specs[name] = (w.describe, w.build, w.batch(0)[0])
    width, depth, batch = (512, 8, 8) if quick else (2048, 24, 32)
    specs["mlp"] = (
        f"deep MLP, {depth} x Linear({width}, {width}) + ReLU, batch {batch}",
        lambda: DeepMLP(width, depth),
        torch.randn(batch, width, generator=torch.Generator().manual_seed(0)),
    )
    return specs


def _tensor_bytes(model: nn.Module) -> int:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if t.device.type != "meta"}
    return sum(t.numel() * t.element_size() for t in tensors.values())


class ParamProbe(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The most bytes of a model's parameters and buffers that were off ``meta`` at any op."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.model, self.peak_bytes = model, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.peak_bytes = max(self.peak_bytes, _tensor_bytes(self.model))
        return func(*args, **(kwargs or {}))


def build_variant(
    variant: str, build: Callable[[], nn.Module], weights: Path, offload_dir: Path
) -> tuple[Callable[[torch.Tensor], torch.Tensor], nn.Module, Any]:
    """(forward, model, handle): handle is the DemandLayering of dl-k variants, else None."""
    if variant == "resident":
        with torch.device("meta"):
            model = build().eval()
        with vtensor.WeightFile(weights) as file:
            model.load_state_dict(file.read_state_dict(), assign=True)
        return model, model, None
    with torch.device("meta"):
        model = build().eval()
    if variant == "accelerate":
        # disk_offload reuses the offload folder's index and .dat files written by setup().
        accelerate.disk_offload(
            model, str(offload_dir), execution_device="cpu", offload_buffers=True
        )
        return model, model, None
    layered = vtensor.DemandLayering(model, weights, lookahead=int(variant.removeprefix("dl-k")))
    return layered, model, layered


def setup(build: Callable[[], nn.Module], root: Path) -> tuple[Path, Path, nn.Module]:
    """Write the weight file and accelerate's offload folder from one seeded model."""
    torch.manual_seed(0)
    model = build().eval()
    weights = vtensor.write_weights(model.state_dict(), root / "model.vtw")
    offload_dir = root / "offload"
    if accelerate is not None:
        with torch.device("meta"):
            shadow = build().eval()
        shadow.load_state_dict(model.state_dict(), assign=True)
        accelerate.disk_offload(
            shadow, str(offload_dir), execution_device="cpu", offload_buffers=True
        )
    return weights, offload_dir, model


def evict(variant: str, weights: Path, offload_dir: Path) -> None:
    if variant.startswith("dl-"):
        evict_page_cache(weights)
    elif variant == "accelerate":
        for path in offload_dir.glob("*.dat"):
            evict_page_cache(path)


def rss_probe(args: argparse.Namespace) -> None:
    """Child process: the RSS rise of building one variant and running two forwards."""
    torch.set_num_threads(args.threads)
    _, build, x = model_specs(args.quick, args.batch_scale)[args.models[0]]
    meter = RssMeter()
    baseline = meter.current_rss_bytes()
    meter.reset_peak()
    forward, _, _ = build_variant(args.rss_probe, build, Path(args.weights), Path(args.offload_dir))
    with torch.no_grad():
        for _ in range(2):
            forward(x)
    print(json.dumps({"rss_rise_bytes": meter.peak_rss_bytes() - baseline}))


def measure_rss(
    args: argparse.Namespace, name: str, variant: str, weights: Path, offload: Path
) -> int:
    command = [
        sys.executable,
        "-m",
        "benchmarks.demand_layering",
        "--rss-probe",
        variant,
        "--models",
        name,
        "--weights",
        str(weights),
        "--offload-dir",
        str(offload),
        "--threads",
        str(args.threads),
        "--batch-scale",
        str(args.batch_scale),
    ] + (["--quick"] if args.quick else [])
    out = subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT).stdout
    return int(json.loads(out.strip().splitlines()[-1])["rss_rise_bytes"])


def run_model(args: argparse.Namespace, name: str, root: Path) -> list[dict[str, Any]]:
    describe, build, x = model_specs(args.quick, args.batch_scale)[name]
    weights, offload_dir, reference = setup(build, root)
    with torch.no_grad():
        expected = reference(x)
    model_bytes = _tensor_bytes(reference)
    del reference
    variants = ["resident", *(f"dl-k{k}" for k in args.lookaheads)]
    variants += ["accelerate"] if accelerate is not None else []
    built = {v: build_variant(v, build, weights, offload_dir) for v in variants}
    rows: dict[str, dict[str, Any]] = {}
    for variant, (forward, model, _) in built.items():
        probe = ParamProbe(model)
        with torch.no_grad(), probe:  # warm-up: demand layering plans on its first forward
            identical = torch.equal(forward(x), expected)
        rows[variant] = {
            "model": name,
            "describe": describe,
            "variant": variant,
            "model_bytes": model_bytes,
            "identical": identical,
            "probe_param_bytes": probe.peak_bytes,
            **{f"{cache}_{what}": [] for cache in ("warm", "cold") for what in ("s", "stall_s")},
        }
    for round_index in range(args.rounds + 1):  # interleaved: load changes hit every variant
        for cache in ("warm", "cold"):
            for variant, (forward, _, layered) in built.items():
                if cache == "cold":
                    evict(variant, weights, offload_dir)
                if layered is not None:
                    layered.reset_stats()
                started = time.perf_counter()
                with torch.no_grad():
                    forward(x)
                if round_index > 0:  # round 0 warms caches and allocators up
                    rows[variant][f"{cache}_s"].append(time.perf_counter() - started)
                    if layered is not None:
                        report, row = layered.report(), rows[variant]
                        row[f"{cache}_stall_s"].append(report.stall_s)
                        row["peak_live_bytes"] = max(
                            row.get("peak_live_bytes", 0), report.peak_live_bytes
                        )
    for variant, (_, _, layered) in built.items():
        row = rows[variant]
        row["param_bytes"] = model_bytes if variant == "resident" else row["probe_param_bytes"]
        if layered is not None:
            report = layered.report()
            row["param_bytes"] = report.buffer_bytes
            layered.close()
        if not args.no_rss:
            row["rss_rise_bytes"] = measure_rss(args, name, variant, weights, offload_dir)
    return list(rows.values())


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians, overheads, the knee of the memory-delay curve and the accelerate comparison."""
    base = statistics.median(next(r for r in rows if r["variant"] == "resident")["warm_s"])
    for row in rows:
        row["reduction"] = 1 - row["param_bytes"] / row["model_bytes"]
        for cache in ("warm", "cold"):
            row[f"{cache}_median_s"] = statistics.median(row[f"{cache}_s"])
            row[f"{cache}_min_s"] = min(row[f"{cache}_s"])
            row[f"{cache}_overhead"] = row[f"{cache}_median_s"] / base - 1
    layered = sorted(
        (r for r in rows if r["variant"].startswith("dl-")), key=lambda r: r["param_bytes"]
    )
    acc = next((r for r in rows if r["variant"] == "accelerate"), None)
    out: dict[str, Any] = {"model": rows[0]["model"]}
    for cache in ("warm", "cold"):
        best = min(r[f"{cache}_median_s"] for r in layered)
        # The knee: the least memory whose latency is within 10 % of the best setting's.
        knee = next(r for r in layered if r[f"{cache}_median_s"] <= 1.1 * best)
        out[f"knee_{cache}"] = {
            "variant": knee["variant"],
            "reduction": knee["reduction"],
            "overhead": knee[f"{cache}_overhead"],
        }
        if acc is not None:
            # Equal memory within 1 %: buffers round each tensor up to 64 bytes.
            fair = [r for r in layered if r["param_bytes"] <= 1.01 * acc["param_bytes"]]
            if fair:
                fastest = min(fair, key=lambda r: r[f"{cache}_median_s"])
                out[f"vs_accelerate_{cache}"] = {
                    "variant": fastest["variant"],
                    "speedup": acc[f"{cache}_median_s"] / fastest[f"{cache}_median_s"],
                    "overhead": fastest[f"{cache}_overhead"],
                    "accelerate_overhead": acc[f"{cache}_overhead"],
                }
    return out


def print_tables(rows: list[dict[str, Any]], summaries: list[dict[str, Any]]) -> None:
    print(
        "| model | variant | param MiB (tracked) | reduction | peak live MiB | RSS rise MiB "
        "| warm ms median (min) | warm overhead | cold ms median (min) | cold overhead "
        "| stall ms warm/cold | bit-identical |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        live = f"{r['peak_live_bytes'] / MiB:.2f}" if "peak_live_bytes" in r else ""
        rss = f"{r['rss_rise_bytes'] / MiB:.1f}" if "rss_rise_bytes" in r else ""
        stall = (
            "/".join(f"{statistics.median(r[f'{c}_stall_s']) * 1e3:.1f}" for c in ("warm", "cold"))
            if r["warm_stall_s"]
            else ""
        )
        print(
            f"| {r['model']} | {r['variant']} | {r['param_bytes'] / MiB:.2f} "
            f"| {r['reduction']:.1%} | {live} | {rss} "
            f"| {r['warm_median_s'] * 1e3:.0f} ({r['warm_min_s'] * 1e3:.0f}) "
            f"| {r['warm_overhead']:+.0%} "
            f"| {r['cold_median_s'] * 1e3:.0f} ({r['cold_min_s'] * 1e3:.0f}) "
            f"| {r['cold_overhead']:+.0%} | {stall} | {r['identical']} |"
        )
    print(
        "\n| model | cache | knee (least memory within 10 % of the best latency) | reduction "
        "| overhead | fastest at <= accelerate's memory | speedup vs accelerate |"
    )
    print("|---|---|---|---|---|---|---|")
    for s in summaries:
        for cache in ("warm", "cold"):
            knee, acc = s[f"knee_{cache}"], s.get(f"vs_accelerate_{cache}")
            versus = (
                f"{acc['variant']} ({acc['overhead']:+.0%} vs accelerate's "
                f"{acc['accelerate_overhead']:+.0%}) | {acc['speedup']:.2f}x"
                if acc
                else "| "
            )
            print(
                f"| {s['model']} | {cache} | {knee['variant']} | {knee['reduction']:.1%} "
                f"| {knee['overhead']:+.0%} | {versus} |"
            )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["cnn", "resnet", "transformer", "mlp"])
    p.add_argument("--lookaheads", nargs="+", type=int, default=[0, 1, 2, 4, 8])
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per cache state (>= 5)")
    p.add_argument(
        "--batch-scale",
        type=float,
        default=1 / 3,
        help="scales the workload batches of benchmarks/zoo",
    )
    p.add_argument("--threads", type=int, default=1)
    add_quick(p, "small models")
    p.add_argument("--no-rss", action="store_true", help="skip the fresh-process RSS probes")
    p.add_argument("--dir", default=None, help="where the weight files go (default: temp dir)")
    add_out(p)
    p.add_argument("--rss-probe", default=None, help=argparse.SUPPRESS)
    p.add_argument("--weights", default=None, help=argparse.SUPPRESS)
    p.add_argument("--offload-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rss_probe:
        rss_probe(args)
        return
    torch.set_num_threads(args.threads)
    env = environment(accelerate=getattr(accelerate, "__version__", None))
    print(describe(env))
    print(f"# accelerate {env['accelerate'] or 'not installed'}")
    rows, summaries = [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for name in args.models:
            root = Path(tmp) / name
            root.mkdir()
            model_rows = run_model(args, name, root)
            summaries.append(summarise(model_rows))
            rows += model_rows
            print(f"# {name}: {model_rows[0]['describe']}", flush=True)
    print_tables(rows, summaries)
    print(f"# load average at end {os.getloadavg()[0]:.2f}")
    write_json_lines(args.out, env, [*tagged("variant", rows), *tagged("summary", summaries)])


if __name__ == "__main__":
    reexec_with_honest_rss()
    main()
