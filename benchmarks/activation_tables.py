"""The activation benchmark's output: one markdown table per model and the comparisons.

``comparisons`` sets each LGM variant against the others and the baselines measured in the same
run (``benchmarks.activation_swap``); the rows are the JSON rows that script writes.
"""

import statistics
from typing import Any

MIB = 1 << 20


def unmanaged_peak(row: dict[str, Any]) -> int:
    """The peak an unmanaged baseline's step must fit in: its tracked and its dispatch peak.

    The tracked peak is read at the measuring manager's hook points only; a recomputation runs
    between two of them (checkpointing's, inside an unpack), and its working set peaks there
    unseen: checkpointing the char GPT's blocks at half batch read 87.3 MiB tracked where its
    live tensors reached 99.1 MiB (the dispatch peak, every allocation counted). The dispatch
    peak is exact for a step without a manager, so a baseline fits where both do.
    """
    return max(row["tracked_peak_bytes"], row.get("dispatch_peak_bytes") or 0)


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MIB:.1f}"


def _num(n: float | None, fmt: str) -> str:
    return "-" if n is None else format(n, fmt)


def recomputed_seconds(units: dict[str, float], names: list[str]) -> float:
    """What the kept plan's recomputation costs a step, as the profile measured it.

    ``units``: unit name -> its cost recomputed whole (``whole_s``), from the trace; ``names``:
    the units the plan recomputes.
    """
    return sum(units[n] for n in names if n in units)


def _replayed(r: dict[str, Any]) -> str:
    timed = r.get("policies", [])[1:]
    if "plan_sources" not in r or not timed:
        return "-"
    return f"{sum(p == 'planned' for p in timed)}/{len(timed)}"


def table(rows: list[dict[str, Any]]) -> str:
    """One markdown table of the rows of one model."""
    cols = (
        "variant",
        "budget MiB (%)",
        "tracked peak MiB",
        "dispatch peak MiB",
        "RSS peak MiB",
        "predicted peak MiB",
        "MiB moved/step",
        "recomputed s (profiled)",
        "prefix copies MiB/step",
        "stall s (pred.)",
        "step s",
        "vs unmanaged",
        "planned steps",
        "planning ms",
        "cache load ms",
        "grads identical",
    )
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        if r["budget_bytes"] is None:
            budget = "-"
        elif r["budget_frac"] is None:
            budget = "never binds"
        else:
            budget = f"{r['budget_bytes'] / MIB:.1f} ({r['budget_frac']:.0%})"
        if r["error"] is not None:
            lines.append(
                f"| {r['variant']} | {budget} | infeasible: min budget "
                f"{_mib(r['min_budget_bytes'])} MiB |" + " |" * (len(cols) - 3)
            )
            continue
        moved = (r["bytes_out_per_step"] or 0) + (r["bytes_in_per_step"] or 0)
        stall = _num(r["stall_s_median"], ".3f")
        if r.get("predicted_stall_s") is not None:
            stall += f" ({r['predicted_stall_s']:.3f})"
        grads = {True: "yes", False: "NO", None: "-"}[r["grads_identical"]]
        planning = r.get("planning_s")
        load = r["extra"].get("cache_load_s_median")
        lines.append(
            " | ".join(
                [
                    f"| {r['variant']}",
                    budget,
                    _mib(r["tracked_peak_bytes"]),
                    _mib(r["dispatch_peak_bytes"]),
                    _mib(r["rss_peak_bytes"]),
                    _mib(r.get("predicted_peak_bytes")),
                    _mib(moved),
                    _num(r["extra"].get("recomputed_s"), ".3f"),
                    _mib(r.get("copied_bytes_per_step")),
                    stall,
                    _num(r["step_s_median"], ".2f"),
                    _num(r["vs_unmanaged"], ".2f"),
                    _replayed(r),
                    "-" if not planning else f"{planning * 1e3:.0f}",
                    "-" if load is None else f"{load * 1e3:.2f}",
                    grads,
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def comparisons(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """LGM chunked vs whole-tensor at each budget, measured in the same run, and vs checkpoint;
    then one entry per hybrid variant and budget (``hybrid`` names it)."""
    by = {(r["variant"], r["budget_frac"]): r for r in rows}
    ckpt = by.get(("checkpoint", None))
    out = []
    for frac in sorted({r["budget_frac"] for r in rows if r["budget_frac"]}, reverse=True):
        chunk, whole = by.get(("lgm-chunk", frac)), by.get(("lgm-tensor", frac))
        c: dict[str, Any] = {"model": rows[0]["model"], "budget_frac": frac}
        if chunk and whole and not chunk["error"] and not whole["error"]:
            cm = chunk["bytes_out_per_step"] + chunk["bytes_in_per_step"]
            wm = whole["bytes_out_per_step"] + whole["bytes_in_per_step"]
            paired = [t / s for t, s in zip(whole["step_s_all"], chunk["step_s_all"], strict=False)]
            c.update(
                throughput_ratio=whole["step_s_median"] / chunk["step_s_median"],
                throughput_ratio_paired_median=median_or_none(paired),
                bytes_ratio=cm / wm if wm else None,
            )
        if chunk and ckpt and not chunk["error"]:
            c.update(
                checkpoint_fits=unmanaged_peak(ckpt) <= chunk["budget_bytes"],
                chunk_vs_checkpoint_time=chunk["step_s_median"] / ckpt["step_s_median"],
            )
        out.append(c)
        hybrids = {r["variant"] for r in rows if r["variant"].startswith("lgm-hybrid")}
        for name in sorted(hybrids):
            hybrid = by.get((name, frac))
            if hybrid and not hybrid["error"] and hybrid["step_s_median"] is not None:
                out.append(_hybrid_comparison(rows, by, hybrid))
    return out


def _hybrid_comparison(
    rows: list[dict[str, Any]],
    by: dict[tuple[str, float | None], dict[str, Any]],
    hybrid: dict[str, Any],
) -> dict[str, Any]:
    """One hybrid variant at one budget against the rest of the same run."""
    frac, name = hybrid["budget_frac"], hybrid["variant"]
    ckpt = by.get(("checkpoint", None))
    c: dict[str, Any] = {
        "model": rows[0]["model"],
        "budget_frac": frac,
        "hybrid": name,
        "hybrid_vs_unmanaged": hybrid["step_s_median"] / by[("unmanaged", None)]["step_s_median"],
        "hybrid_recomputed": hybrid["extra"].get("recomputed_modules", 0),
    }
    # Paired over the hybrid's own timed rounds (its last ones: the decision's are not timed),
    # so that the machine's drift over the run does not enter the ratio.
    paired = _paired(hybrid, by[("unmanaged", None)])
    if paired is not None:
        c["hybrid_vs_unmanaged_paired"] = paired
    # LGM-chunk alone with the same encoding ("lgm-hybrid+masks" against "lgm-chunk+masks").
    for chunk_name in (name.replace("lgm-hybrid", "lgm-chunk"), "lgm-chunk"):
        chunk = by.get((chunk_name, frac))
        if chunk and not chunk["error"] and chunk["step_s_median"] is not None:
            c["chunk_variant"] = chunk_name
            c["hybrid_vs_chunk"] = hybrid["step_s_median"] / chunk["step_s_median"]
            paired = _paired(hybrid, chunk)
            if paired is not None:
                c["hybrid_vs_chunk_paired"] = paired
            break
    if ckpt and unmanaged_peak(ckpt) <= hybrid["budget_bytes"]:
        c["hybrid_vs_checkpoint"] = hybrid["step_s_median"] / ckpt["step_s_median"]
    # The fastest alternative whose peak fits the same budget.
    fitting = [
        r
        for r in rows
        if r["variant"] in ("checkpoint", "selective", "micro-2", "micro-4")
        and unmanaged_peak(r) <= hybrid["budget_bytes"]
    ]
    compiled = by.get(("compile", frac))
    unmanaged_rss = by[("unmanaged", None)]["extra"].get("rss_step_peak_bytes")
    honest = compiled is not None and compiled["machine"]["rss_honest"]
    if compiled and honest and compiled["rss_peak_bytes"] is not None and unmanaged_rss:
        # Not bit-identical, and an RSS peak: reported apart from the fastest that fits.
        # It fits when its peak is the budget's fraction of the unmanaged step's peak
        # measured the same way (that one reads 5-10 % under the tracked peak).
        c["compile_peak_frac"] = compiled["rss_peak_bytes"] / unmanaged_rss
        c["compile_fits"] = c["compile_peak_frac"] <= frac
        c["hybrid_vs_compile"] = hybrid["step_s_median"] / compiled["step_s_median"]
    tensor = by.get(("lgm-tensor", frac))
    if tensor and not tensor["error"] and tensor["step_s_median"] is not None:
        fitting.append(tensor)
    if fitting:
        best = min(fitting, key=lambda r: r["step_s_median"])
        c["best_baseline"] = best["variant"]
        c["hybrid_vs_best_baseline"] = hybrid["step_s_median"] / best["step_s_median"]
    return c


def _paired(row: dict[str, Any], other: dict[str, Any]) -> float | None:
    """The median of ``row``'s step ÷ ``other``'s over ``row``'s timed rounds, the last of the
    run; None where ``other`` was not timed in all of them."""
    mine = row["step_s_all"]
    theirs = other["step_s_all"][-len(mine) :] if mine else []
    if not mine or len(theirs) != len(mine):
        return None
    return statistics.median(a / b for a, b in zip(mine, theirs, strict=True))


def print_comparisons(comps: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    """The manager's own cost per model, then one line per model and budget."""
    for r in rows:
        if r["variant"] == "unbound" and r["vs_unmanaged"] is not None:
            print(
                f"{r['model']}: the manager with a budget that never binds "
                f"{r['vs_unmanaged']:.3f}x unmanaged"
            )
    for c in comps:
        parts = _hybrid_parts(c) if "hybrid" in c else _chunk_parts(c)
        if parts:
            print(f"{c['model']} {c['budget_frac']:.0%}: " + "; ".join(parts))


def _chunk_parts(c: dict[str, Any]) -> list[str]:
    parts = []
    if "throughput_ratio" in c:
        br = "-" if c["bytes_ratio"] is None else f"{c['bytes_ratio']:.3f}x"
        parts.append(
            f"LGM chunk/tensor throughput {c['throughput_ratio']:.3f}x (paired rounds "
            f"{c['throughput_ratio_paired_median']:.3f}x), bytes moved {br}"
        )
    if "chunk_vs_checkpoint_time" in c:
        fits = "fits" if c["checkpoint_fits"] else "exceeds"
        parts.append(
            f"chunk step / checkpoint step {c['chunk_vs_checkpoint_time']:.2f} "
            f"(checkpoint peak {fits} the budget)"
        )
    return parts


def _hybrid_parts(c: dict[str, Any]) -> list[str]:
    if "hybrid_vs_unmanaged" not in c:
        return []
    line = (
        f"{c['hybrid']} ({c['hybrid_recomputed']} modules recomputed) "
        f"{c['hybrid_vs_unmanaged']:.2f}x unmanaged"
    )
    if "hybrid_vs_unmanaged_paired" in c:
        line += f" (paired {c['hybrid_vs_unmanaged_paired']:.2f}x)"
    if "hybrid_vs_chunk" in c:
        line += f", {c['hybrid_vs_chunk']:.2f}x {c['chunk_variant']}"
    if "hybrid_vs_chunk_paired" in c:
        line += f" (paired {c['hybrid_vs_chunk_paired']:.2f}x)"
    if "hybrid_vs_checkpoint" in c:
        line += f", {c['hybrid_vs_checkpoint']:.2f}x checkpoint"
    if "hybrid_vs_compile" in c:
        fits = "fits" if c["compile_fits"] else "exceeds"
        line += (
            f", {c['hybrid_vs_compile']:.2f}x torch.compile (its peak "
            f"{c['compile_peak_frac']:.0%}: {fits})"
        )
    if "best_baseline" in c:
        line += (
            f", {c['hybrid_vs_best_baseline']:.2f}x the fastest alternative that fits "
            f"({c['best_baseline']})"
        )
    return [line]
