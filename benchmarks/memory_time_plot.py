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
several (each file's rows are set against that file's own unmanaged run; a variant of a model
found in two files is drawn from the first)::

    python -m benchmarks.memory_time_plot act.jsonl benchmarks/figures/memory_time.png
    python -m benchmarks.memory_time_plot eager.jsonl compile.jsonl memory_time.png
"""

import argparse
import json
from collections import defaultdict
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the backend


def load_rows(path: str) -> list[dict[str, Any]]:
    """The result rows (not the environment record) of a JSON-lines file."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if "variant" in r and r.get("vs_unmanaged") is not None]


def points(rows: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """model -> variant -> [(peak / unmanaged peak, step / unmanaged step)], by budget."""
    ordered = sorted(rows, key=lambda r: -(r["budget_frac"] or 0.0))
    unmanaged_rss = {
        r["model"]: r["extra"].get("rss_step_peak_bytes")
        for r in rows
        if r["variant"] == "unmanaged"
    }
    out: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for r in ordered:
        variant = r["variant"]
        if variant == "compile":  # nothing tracks its buffers: RSS against RSS
            reference = unmanaged_rss.get(r["model"])
            if not reference or r.get("rss_peak_bytes") is None:
                continue
            out[r["model"]]["compile (RSS)"].append(
                (r["rss_peak_bytes"] / reference, r["vs_unmanaged"])
            )
            continue
        if r["budget_bytes"] is None:  # a baseline: the live storages its step held
            peak = r["dispatch_peak_bytes"]
        else:
            peak = r.get("timed_tracked_peak_bytes") or r["tracked_peak_bytes"]
        out[r["model"]][variant].append(
            (peak / r["unmanaged_tracked_peak_bytes"], r["vs_unmanaged"])
        )
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("jsonl", nargs="+", help="--out files of benchmarks.activation_swap")
    p.add_argument("png", help="where to write the figure")
    args = p.parse_args(argv)
    data: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(dict)
    for path in args.jsonl:
        for model, variants in points(load_rows(path)).items():
            for variant, series in variants.items():
                data[model].setdefault(variant, series)
    fig, axes = plt.subplots(1, len(data), figsize=(6 * len(data), 4.5), squeeze=False)
    # More variants than a default colour cycle has colours: each gets its own colour and marker.
    names = sorted({variant for variants in data.values() for variant in variants})
    colours = plt.get_cmap("tab20").colors
    style = {
        name: (colours[i % len(colours)], "osD^v<>ph*X"[i % 11]) for i, name in enumerate(names)
    }
    for ax, (model, variants) in zip(axes[0], sorted(data.items()), strict=True):
        for variant, series in sorted(variants.items()):
            xs, ys = zip(*series, strict=True)
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
