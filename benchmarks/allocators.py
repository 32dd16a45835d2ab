"""vtensor's CPU counters and budgets under glibc, mimalloc and jemalloc (NOTE [CPU counter]).

Each allocator runs in child processes started with its environment: glibc with
``MALLOC_MMAP_THRESHOLD_=65536`` (as the tests set), Debian's mimalloc 2.0 preloaded with
``MIMALLOC_RESET_DELAY=0``, jemalloc preloaded with
``MALLOC_CONF=dirty_decay_ms:0,muzzy_decay_ms:0``.

1. Readings, one child per allocator: the median cost of 2000 readings of glibc's heap counter
   (``MallocTracker``) and of the anonymous resident pages (``ResidentTracker``); what counting
   live storages (``LiveStorageTracker``, a cost per op) adds to a small CNN's training step; and
   what each counter reads as risen when a mix of tensors is allocated (4 KiB x 64, 64 KiB x 64,
   1 MiB x 8, 12 MiB) and as dropped when it is freed, over their storage bytes.
2. The held-out models (held_out.py's models and batches), one child per allocator and model:
   the unmanaged peak (a manager whose budget never binds, two steps); N steps unmanaged and N
   under ``MemoryManager(max(peak // 2, the minimum it states when it refuses))`` from the same
   weights and batches; the manager's highest peak over steps 1.. against the budget; every
   gradient and the final state bit-identical; the RSS the parent samples from
   ``/proc/<pid>/statm`` every ~1 ms over managed steps 1.. (its rise against the budget less
   the bytes held before them: parameters, momentum, the batch); median steps (forward, backward,
   update) over steps 2.., managed and unmanaged. Run from the repository root::

    python -m benchmarks.allocators --out allocators.jsonl
    python -m benchmarks.allocators --count-workspaces    # the budget holds for RSS too
    python -m benchmarks.allocators --quick    # two models, three steps; its rows are not results
"""

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

import vtensor
from benchmarks.common import add_out, add_quick, describe, environment, tagged, write_json_lines
from benchmarks.held_out import _batch, _loss
from benchmarks.held_out_models import MODELS
from vtensor.measure.counter import allocator_name, cpu_counter
from vtensor.measure.dispatch import LiveStorageTracker
from vtensor.measure.trackers import MallocTracker, ResidentTracker

MIB, KIB = 1 << 20, 1 << 10
LIB = "/usr/lib/x86_64-linux-gnu"
ALLOCATORS: dict[str, dict[str, str]] = {
    "glibc": {"MALLOC_MMAP_THRESHOLD_": "65536"},
    "mimalloc": {"LD_PRELOAD": f"{LIB}/libmimalloc.so.2", "MIMALLOC_RESET_DELAY": "0"},
    "jemalloc": {
        "LD_PRELOAD": f"{LIB}/libjemalloc.so.2",
        "MALLOC_CONF": "dirty_decay_ms:0,muzzy_decay_ms:0",
    },
}
MIX_BYTES = [4 * KIB] * 64 + [64 * KIB] * 64 + [MIB] * 8 + [12 * MIB]
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
Grads = list[torch.Tensor | None]


def _emit(message: dict[str, Any]) -> None:
    print(json.dumps(message), flush=True)


def _sgd(model: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


# -- part 1: readings (child) -------------------------------------------------------------------
def _median_us(read: Callable[[], int], count: int = 2000) -> float:
    times = []
    for _ in range(count):
        begin = time.perf_counter_ns()
        read()
        times.append(time.perf_counter_ns() - begin)
    return statistics.median(times) / 1000


def _dispatch_ratio(steps: int = 30) -> float:
    """A small CNN's median training step with a ``LiveStorageTracker`` over it, against without."""
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU()]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    opt, x, y = _sgd(model), torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(2 * steps + 4):  # in turns; the first two of each are warm-up
        tracker = LiveStorageTracker()
        tracker.track(*model.parameters(), x, y)
        begin = time.perf_counter()
        with tracker if i % 2 else nullcontext():
            nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
            opt.step()
            opt.zero_grad(set_to_none=True)
        times[bool(i % 2)].append(time.perf_counter() - begin)
    return statistics.median(times[True][2:]) / statistics.median(times[False][2:])


def _accuracy() -> dict[str, float]:
    """Each counter's rise and drop over the mix of tensors / their storage bytes (3 rounds)."""
    heap, resident, total = MallocTracker(), ResidentTracker(), sum(MIX_BYTES)
    ratios: dict[str, list[float]] = {}
    gc.disable()
    for _ in range(3):
        with LiveStorageTracker() as storages:
            reads = {"heap": heap.current_bytes, "resident": resident.current_bytes}
            reads["storages"] = lambda: storages.current_bytes
            before = {k: read() for k, read in reads.items()}
            tensors = [torch.ones(n // 4) for n in MIX_BYTES]  # written: every page touched
            assert sum(t.untyped_storage().nbytes() for t in tensors) == total
            after = {k: read() for k, read in reads.items()}
            del tensors
            for k, read in reads.items():
                ratios.setdefault(f"{k}_rise", []).append((after[k] - before[k]) / total)
                ratios.setdefault(f"{k}_drop", []).append((after[k] - read()) / total)
    gc.enable()
    return {k: statistics.median(v) for k, v in ratios.items()}


def _readings_child(row: dict[str, Any]) -> None:
    heap, resident = MallocTracker(), ResidentTracker()
    row.update(allocator_seen=allocator_name(), counter=cpu_counter())
    row.update(
        heap_us=_median_us(heap.current_bytes), resident_us=_median_us(resident.current_bytes)
    )
    row.update(storages_step_ratio=_dispatch_ratio(), **_accuracy())


# -- part 2: a held-out model (child) -----------------------------------------------------------
def _step(
    model: nn.Module, opt: Any, batch: Any, step: int, mm: vtensor.MemoryManager | None
) -> tuple[float, Grads]:
    """One step; its seconds (forward, backward, update) and the gradients it made."""
    x, y = batch
    torch.manual_seed(100 + step)  # dropout and stochastic depth alike
    begin = time.perf_counter()
    with mm.step(model, opt, (x, y)) if mm is not None else nullcontext():
        _loss(model, x, y).backward()  # type: ignore[no-untyped-call]
    seconds, grads = time.perf_counter() - begin, [p.grad for p in model.parameters()]
    begin = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return seconds + time.perf_counter() - begin, grads


def _same(a: Grads, b: Grads) -> bool:
    pairs = zip(a, b, strict=True)
    return all(x is y or (x is not None and y is not None and torch.equal(x, y)) for x, y in pairs)


def _managed(
    init: nn.Module,
    batches: list[Any],
    ref: list[tuple[float, Grads]],
    budget: int,
    row: dict[str, Any],
    tmp: str,
    workspaces: bool,
) -> nn.Module:
    """N managed steps from ``init``; tells the parent when step 0 (profiling) is done."""
    model = copy.deepcopy(init)
    opt, times, row["first_grad_diff_step"] = _sgd(model), [], None
    with vtensor.MemoryManager(
        budget, storage_dir=tmp, count_workspaces=workspaces, offload_params=False
    ) as mm:
        for step, batch in enumerate(batches):
            row.update(budget_bytes=budget, at_step=step)
            if step == 1:  # from here the parent samples the RSS
                state = [*model.parameters(), *batch]
                state += [s["momentum_buffer"] for s in opt.state.values()]
                row["held_bytes"] = sum(t.untyped_storage().nbytes() for t in state)
                _emit({"phase": "ready", "budget": budget, "held": row["held_bytes"]})
                sys.stdin.readline()
            seconds, grads = _step(model, opt, batch, step, mm)
            times.append(seconds)
            if row["first_grad_diff_step"] is None and not _same(grads, ref[step][1]):
                row["first_grad_diff_step"] = step
            del grads
    row.update(manager_peaks=[r.peak_device_bytes for r in mm.reports])
    row.update(plan_sources=[r.plan_source.value for r in mm.reports])
    row.update(manager_peak_bytes=max(row["manager_peaks"][1:]))
    row.update(managed_step_s=statistics.median(times[2:]))
    return model


def _model_child(
    row: dict[str, Any], name: str, steps: int, batch_size: int, tmp: str, workspaces: bool
) -> None:
    """Fills ``row`` as it goes: on an exception the caller emits what it holds."""
    row["counter"] = cpu_counter()
    torch.manual_seed(0)
    init = MODELS[name]()
    batches = [_batch(name, s, batch_size, 64) for s in range(steps)]
    probe = copy.deepcopy(init)
    with vtensor.MemoryManager("1TiB", storage_dir=tmp) as mm:
        opt = _sgd(probe)
        for s in range(2):
            _step(probe, opt, batches[s], s, mm)
    row["peak_bytes"] = peak = max(r.peak_device_bytes for r in mm.reports)
    ref, budget, row["refusals"] = copy.deepcopy(init), peak // 2, []
    ref_opt = _sgd(ref)
    ref_runs = [_step(ref, ref_opt, batch, s, None) for s, batch in enumerate(batches)]
    row["unmanaged_step_s"] = statistics.median(t for t, _ in ref_runs[2:])
    for _ in range(4):
        try:
            model = _managed(init, batches, ref_runs, budget, row, tmp, workspaces)
        except vtensor.InfeasibleBudgetError as err:
            row["refusals"].append(
                dict(budget=budget, step=row["at_step"], min=err.min_budget_bytes)
            )
            budget = max(err.min_budget_bytes, budget + 1)
            continue
        final = ref.state_dict()
        same = all(torch.equal(final[k], v) for k, v in model.state_dict().items())
        row["identical"] = row["first_grad_diff_step"] is None and same
        return
    row["error"] = "the manager refused four budgets"


# -- parent -------------------------------------------------------------------------------------
def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE_BYTES


def _child(allocator: str, args: list[str]) -> dict[str, Any]:
    """Run a child under ``allocator``; sample its RSS from each "ready" to its result."""
    dropped = ("LD_PRELOAD", "MALLOC_CONF", "MALLOC_MMAP_THRESHOLD_")
    env = {k: v for k, v in os.environ.items() if k not in dropped} | ALLOCATORS[allocator]
    argv = [sys.executable, "-m", "benchmarks.allocators", "--child", *args]
    begin, start, highest = time.perf_counter(), 0, 0
    ready: dict[str, Any] = {}
    result: dict[str, Any] = {}
    with tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env
        )
        assert child.stdout is not None and child.stdin is not None
        os.set_blocking(child.stdout.fileno(), False)
        while not result:
            line = child.stdout.readline()
            if line and json.loads(line)["phase"] == "ready":
                ready, start = json.loads(line), _rss(child.pid)
                highest = start
                child.stdin.write("\n")
                child.stdin.flush()
            elif line:
                result = json.loads(line)
            elif child.poll() is not None:
                err.seek(0)
                result = {"error": f"exit {child.returncode}: {err.read()[-2000:]}"}
            else:
                highest = max(highest, _rss(child.pid)) if ready else 0
                time.sleep(0.001 if ready else 0.01)
        child.wait()
    result.pop("phase", None)
    if ready:
        result["rss_rise_bytes"] = highest - start
    return {"allocator": allocator, "child_s": time.perf_counter() - begin, **result}


def _ratios(r: dict[str, Any]) -> dict[str, Any]:
    """A model row's figures against its budget, as the table shows them."""
    if "peak_bytes" in r:
        r["peak_mib"], r["refused"] = r["peak_bytes"] / MIB, len(r["refusals"])
    if "identical" in r:
        budget, diff = r["budget_bytes"], r["first_grad_diff_step"]
        r["budget_share"] = budget / r["peak_bytes"]
        r["manager_vs_budget"] = r["manager_peak_bytes"] / budget
        r["rss_vs_room"] = r["rss_rise_bytes"] / (budget - r["held_bytes"])
        r["bit_identical"] = "yes" if r["identical"] else f"NO (gradients from step {diff})"
    return r


def _table(columns: list[tuple[str, str, str]], rows: list[dict[str, Any]]) -> str:
    """A markdown table of ``(head, key, format)`` columns; a row's error goes last."""
    lines = [[head for head, _, _ in columns], ["---"] * len(columns)]
    for r in rows:
        lines.append([form.format(r[key]) if key in r else "-" for _, key, form in columns])
        if "error" in r:  # its last line; the JSON keeps the traceback
            lines[-1].append(
                f"error at step {r.get('at_step', '-')}: {r['error'].strip().splitlines()[-1]}"
            )
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


READINGS = [("allocator", "allocator", "{}"), ("counter", "counter", "{}")]
READINGS += [("heap read us", "heap_us", "{:.2f}"), ("resident read us", "resident_us", "{:.2f}")]
READINGS += [("storages: step x", "storages_step_ratio", "{:.2f}")]
READINGS += [
    (f"{c} {w}", f"{c}_{w}", "{:.3f}")
    for c in ("heap", "resident", "storages")
    for w in ("rise", "drop")
]
MODEL_ROWS = [
    ("allocator", "allocator", "{}"),
    ("counter", "counter", "{}"),
    ("model", "model", "{}"),
]
MODEL_ROWS += [("peak MiB", "peak_mib", "{:.1f}"), ("budget / peak", "budget_share", "{:.0%}")]
MODEL_ROWS += [("manager peak / budget", "manager_vs_budget", "{:.3f}")]
MODEL_ROWS += [("RSS rise / (budget - held)", "rss_vs_room", "{:.3f}")]
MODEL_ROWS += [
    ("bit-identical", "bit_identical", "{}"),
    ("managed step s", "managed_step_s", "{:.3f}"),
]
MODEL_ROWS += [("unmanaged step s", "unmanaged_step_s", "{:.3f}"), ("refusals", "refused", "{}")]


def _run_child(args: list[str]) -> None:
    """A child's side: run its part, emit its row (with the error where one was raised)."""
    torch.set_num_threads(1)
    row: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if args[0] == "readings":
                _readings_child(row)
            else:
                _model_child(row, args[1], int(args[2]), int(args[3]), tmp, args[4] == "1")
    except Exception:
        row["error"] = traceback.format_exc()[-2000:]
    _emit({"phase": "done", **row})


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run the children per allocator, print the tables, write the JSON lines."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_quick(p, "two models, three steps, batch 4")
    p.add_argument("--allocators", nargs="+", choices=list(ALLOCATORS), default=list(ALLOCATORS))
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--steps", type=int, default=6, help="steps per variant (default 6, at least 3)")
    p.add_argument(
        "--count-workspaces",
        action="store_true",
        help="budget op workspaces too (the budget then holds for the process's RSS)",
    )
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    add_out(p)
    args = p.parse_args(argv)
    if args.child:
        return _run_child(args.child)
    if args.steps < 3:
        p.error("--steps must be at least 3: step 0 profiles, medians are over steps 2..")
    batch = 4 if args.quick else 16
    if args.quick:
        args.models, args.steps = ["senet", "vit"], 3
    torch.set_num_threads(1)
    allocator_env = {a: ALLOCATORS[a] for a in args.allocators}
    env = environment(
        script="allocators",
        steps=args.steps,
        batch=batch,
        allocators=allocator_env,
        count_workspaces=args.count_workspaces,
    )
    print(describe(env), flush=True)
    readings, models = [], []
    for allocator in args.allocators:
        readings.append(_child(allocator, ["readings"]))
        print(f"# {allocator} readings done ({readings[-1]['child_s']:.0f} s)", flush=True)
        for name in args.models:
            flag = "1" if args.count_workspaces else "0"
            row = _child(allocator, ["model", name, str(args.steps), str(batch), flag])
            models.append({"model": name, **row})
            print(f"# {allocator} {name} done ({row['child_s']:.0f} s)", flush=True)
    print(_table(READINGS, readings))
    print(_table(MODEL_ROWS, [_ratios(r) for r in models]))
    write_json_lines(args.out, env, tagged("readings", readings) + tagged("model", models))


if __name__ == "__main__":
    main()
