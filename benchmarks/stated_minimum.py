"""Models no test uses, under the defaults: 40 % of their peak, and the minimum they state.

For each held-out model (``benchmarks/held_out_models.py``), at its batch: the unmanaged peak
(two steps under a budget that never binds), then ``--steps`` SGD steps (momentum 0.9) under
``MemoryManager`` with its defaults (``offload_params="auto"``, ``recompute=True``) at 40 % of
that peak, at the minimum it states from far below (one step at 1 MiB), and at 97 % of that
minimum (where refused, at the minimum stated there); each against the same steps unmanaged.
Each managed run is the first training of a new process, as a user retrying at a stated
minimum would run it. Per row: whether it trained, its tracked peak against the budget, whether
the weights came out bit-identical, and the iteration by which the plan was decided.

    python -m benchmarks.stated_minimum                 # every model, 5 steps (minutes)
    python -m benchmarks.stated_minimum --models vit --steps 4
"""

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import torch

import vtensor
from benchmarks.common import environment, write_json_lines
from benchmarks.held_out import _batch, _loss, _peak
from benchmarks.held_out_models import MODELS

_BATCH, _SIZE = 8, 64


def _train(
    model: torch.nn.Module, name: str, steps: int, budget: int | None
) -> tuple[list[vtensor.IterationReport], str]:
    """``steps`` steps of ``model`` in place, under ``budget`` (None: unmanaged); "" if it fit."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if budget is None:
        for step in range(steps):
            torch.manual_seed(100 + step)
            x, y = _batch(name, step, _BATCH, _SIZE)
            _loss(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        return [], ""
    try:
        with vtensor.MemoryManager(budget, storage_dir=tempfile.mkdtemp(), recompute=True) as mm:
            for step in range(steps):
                torch.manual_seed(100 + step)
                x, y = _batch(name, step, _BATCH, _SIZE)
                with mm.step(model, opt, (x, y)):
                    _loss(model, x, y).backward()
                opt.step()
                opt.zero_grad()
            return list(mm.reports), ""
    except vtensor.InfeasibleBudgetError as err:
        return [], str(err.min_budget_bytes)


def _row(name: str, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    peak = _peak(name, MODELS[name](), _BATCH, _SIZE)
    stated = _fresh(name, 1, 1 << 20)["refused_min_bytes"]
    row: dict[str, Any] = {"model": name, "peak_bytes": peak, "stated_min_bytes": stated}
    for label, budget in (("40%", int(0.4 * peak)), ("stated", stated)):
        row[label] = _fresh(name, steps, budget)
    near = row["near"] = _fresh(name, steps, int(0.97 * stated))
    if near["refused_min_bytes"]:
        near["restated"] = _fresh(name, steps, near["refused_min_bytes"])
    return row


def _fresh(name: str, steps: int, budget: int) -> dict[str, Any]:
    """:func:`_run` in a new process: its managed run is the first training there."""
    args = ["--run", name, str(budget), "--steps", str(steps)]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.stated_minimum", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _run(name: str, steps: int, budget: int) -> dict[str, Any]:
    """``steps`` managed steps of ``name`` under ``budget``, then the same steps unmanaged."""
    torch.manual_seed(0)
    reference = MODELS[name]()
    model, plain = copy.deepcopy(reference), copy.deepcopy(reference)
    reports, refused = _train(model, name, steps, budget)
    _train(plain, name, steps, None)
    pairs = zip(plain.state_dict().values(), model.state_dict().values(), strict=True)
    sources = [r.plan_source.value for r in reports]
    decided = next(
        (i + 1 for i, s in enumerate(sources) if s not in ("profiled", "fallback")), None
    )
    return {
        "budget_bytes": budget,
        "refused_min_bytes": int(refused) if refused else None,
        "peak_bytes": max((r.peak_device_bytes for r in reports), default=0),
        "identical": not refused and all(torch.equal(a, b) for a, b in pairs),
        "decided_at_iteration": decided,
        "sources": sources,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="")
    parser.add_argument("--run", nargs=2, metavar=("MODEL", "BUDGET"), help="one run, as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.run:
        print(json.dumps(_run(args.run[0], args.steps, int(args.run[1]))))
        return
    rows = []
    print(f"# load average at start {os.getloadavg()[0]:.2f}")
    print(
        "| model | peak MiB | stated min MiB | at 40 %: trained, peak/budget, identical, "
        "decided by | at stated min: trained, peak/budget, identical | at 97 % of it |"
    )
    print("|---|---|---|---|---|---|")
    for name in args.models:
        row = _row(name, args.steps)
        rows.append(row)
        a, s = row["40%"], row["stated"]

        def cell(r: dict[str, Any]) -> str:
            if r["refused_min_bytes"]:
                return f"refused (states {r['refused_min_bytes'] / 2**20:.1f} MiB)"
            ratio = r["peak_bytes"] / max(r["budget_bytes"], 1)
            return f"yes, {ratio:.3f}, {'yes' if r['identical'] else 'NO'}"

        decided = a["decided_at_iteration"]
        near = cell(row["near"])
        if "restated" in row["near"]:  # refused: how it trains at the minimum stated there
            near += f"; there {cell(row['near']['restated'])}"
        print(
            f"| {name} | {row['peak_bytes'] / 2**20:.1f} | {row['stated_min_bytes'] / 2**20:.1f} "
            f"| {cell(a)}, {decided if decided else '-'} | {cell(s)} | {near} |",
            flush=True,
        )
    print(f"# load average at end {os.getloadavg()[0]:.2f}")
    write_json_lines(args.out or None, environment(), rows)


if __name__ == "__main__":
    main()
