"""Memory-time plot of an activation benchmark run: step time against tracked peak, per model.

One panel per model, one curve per variant: each budgeted variant's points are its budgets
(tracked peak as a fraction of the unmanaged peak, step time as a multiple of the unmanaged
step), joined in order of budget; the budget-free baselines (checkpointing, selective
checkpointing, micro-batching, the manager with a budget that never binds) are one point each.
Lower and further left is better. A baseline's peak is its dispatch peak (the live storages of
one unmanaged step, ``LiveStorageTracker``); a managed variant's, its tracked peak over the
timed rounds; ``torch.compile``'s, whose buffers nothing tracks, its RSS peak over one step
against the unmanaged step's measured the same way (labelled "compile (RSS)").

Run from the repository root on the JSON lines ``activation_swap --out`` wrote, one file or
several (each file's rows are set against that file's own unmanaged run; a variant's budgets
are gathered from every file, and a point found in two files, such as a budget-free baseline
run beside every budget, is drawn from the first)::

    python -m benchmarks.memory_time_plot act.jsonl benchmarks/figures/memory_time.png
    python -m benchmarks.memory_time_plot eager.jsonl compile.jsonl memory_time.png
    python -m benchmarks.memory_time_plot mobilenet-0.8.jsonl mobilenet-0.5.jsonl memory_time.png
"""

import argparse
import json
from collections import defaultdict
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the backend


def load_rows(path: str) -> list[dict[str, Any]]:
    """The result rows (not the environment record) of a JSON-lines file; a variant that ended
    in an error is left out, even where it had timed steps before it (a budget found infeasible
    after its profile)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [
        r
        for r in rows
        if "variant" in r and r.get("vs_unmanaged") is not None and not r.get("error")
    ]


Point = tuple[float, float]  # (peak / unmanaged peak, step / unmanaged step)


def points(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[float | None, Point]]]:
    """model -> variant -> budget fraction (None for a budget-free baseline) -> its point."""
    unmanaged_rss = {
        r["model"]: r["extra"].get("rss_step_peak_bytes")
        for r in rows
        if r["variant"] == "unmanaged"
    }
    out: dict[str, dict[str, dict[float | None, Point]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        variant, budget = r["variant"], r["budget_frac"]
        if variant == "compile":  # nothing tracks its buffers: RSS against RSS
            reference = unmanaged_rss.get(r["model"])
            if not reference or r.get("rss_peak_bytes") is None:
                continue
            out[r["model"]]["compile (RSS)"][budget] = (
                r["rss_peak_bytes"] / reference,
                r["vs_unmanaged"],
            )
            continue
        if r["budget_bytes"] is None:  # a baseline: the live storages its step held
            peak = r["dispatch_peak_bytes"]
        else:
            peak = r.get("timed_tracked_peak_bytes") or r["tracked_peak_bytes"]
        out[r["model"]][variant][budget] = (
            peak / r["unmanaged_tracked_peak_bytes"],
            r["vs_unmanaged"],
        )
    return out


def series(by_budget: dict[float | None, Point]) -> list[Point]:
    """A variant's points in order of budget, the largest first."""
    return [by_budget[b] for b in sorted(by_budget, key=lambda b: -(b or 0.0))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("jsonl", nargs="+", help="--out files of benchmarks.activation_swap")
    p.add_argument("png", help="where to write the figure")
    args = p.parse_args(argv)
    gathered: dict[str, dict[str, dict[float | None, Point]]] = defaultdict(
        lambda: defaultdict(dict)
    )
    for path in args.jsonl:
        for model, variants in points(load_rows(path)).items():
            for variant, by_budget in variants.items():
                for budget, point in by_budget.items():
                    gathered[model][variant].setdefault(budget, point)
    data = {
        model: {variant: series(by_budget) for variant, by_budget in variants.items()}
        for model, variants in gathered.items()
    }
    fig, axes = plt.subplots(1, len(data), figsize=(6 * len(data), 4.5), squeeze=False)
    # More variants than a default colour cycle has colours: each gets its own colour and marker.
    names = sorted({variant for variants in data.values() for variant in variants})
    colours = plt.get_cmap("tab20").colors
    style = {
        name: (colours[i % len(colours)], "osD^v<>ph*X"[i % 11]) for i, name in enumerate(names)
    }
    for ax, (model, variants) in zip(axes[0], sorted(data.items()), strict=True):
        for variant, line_points in sorted(variants.items()):
            xs, ys = zip(*line_points, strict=True)
            colour, marker = style[variant]
            line = "-" if len(xs) > 1 else ""
            ax.plot(xs, ys, marker=marker, color=colour, linestyle=line, label=variant)
        ax.set_title(model)
        ax.set_xlabel("peak / unmanaged peak (tracked; compile: RSS)")
        ax.set_ylabel("step time / unmanaged step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
