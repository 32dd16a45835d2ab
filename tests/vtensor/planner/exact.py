"""Exact solvers for small traces, the yardsticks of the planner's greedy passes."""

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from vtensor.planner.lgm import build_lgm
from vtensor.planner.trace import Trace


def exact_min_bytes_moved(trace: Trace, budget: int) -> int:
    """Least bytes moved (out and in) by any eviction schedule, as an ILP (scipy.optimize.milp).

    Variables per (tensor, step where it may be away): k chunks away, z = [k >= 1], y bytes
    away, u >= y - y(previous step) the bytes written at that step. A relaxation of the plan
    format (several nested evictions per gap are allowed), so its optimum is a lower bound.
    """
    lgm = build_lgm(trace, trace.chunk_bytes)
    n, chunk = lgm.n_steps, trace.chunk_bytes
    cells = [
        (t, s)
        for t in trace.tensors
        for s in range(t.saved_step, max(t.use_steps, default=n - 1) + 1)
        if 0 <= t.evictable_step <= s and s not in t.use_steps
    ]
    index = {(t.vid, s): i for i, (t, s) in enumerate(cells)}
    nv = 4 * len(cells)  # k, z, y, u per cell
    rows: list[tuple[dict[int, float], float, float]] = []
    upper = np.zeros(nv)
    integer = np.zeros(nv)
    for i, (t, s) in enumerate(cells):
        total = lgm.n_chunks(t)
        k, z, y, u = 4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3
        upper[[k, z, y, u]] = [total, 1, t.nbytes, t.nbytes]
        integer[[k, z]] = 1
        waste = 0 if chunk is None else total * chunk - t.nbytes
        unit = t.nbytes if chunk is None else chunk
        rows.append(({y: 1, k: -unit, z: waste}, 0, 0))  # y = unit * k - waste * z
        rows.append(({k: 1, z: -total}, -np.inf, 0))  # k > 0 => z = 1
        rows.append(({z: 1, k: -1}, -np.inf, 0))  # z = 1 => k >= 1
        previous = index.get((t.vid, s - 1))
        rows.append(
            ({u: 1, y: -1, **({4 * previous + 2: 1} if previous is not None else {})}, 0, np.inf)
        )
    full = lgm.full_resident()
    for s in range(n):
        need = int(full[s]) - budget
        if need > 0:
            rows.append(
                ({4 * index[(t.vid, s)] + 2: 1 for t, s2 in cells if s2 == s}, need, np.inf)
            )
    if not cells:
        return 0
    matrix = np.zeros((len(rows), nv))
    for r, (coefficients, _, _) in enumerate(rows):
        for column, value in coefficients.items():
            matrix[r, column] = value
    cost = np.zeros(nv)
    cost[3::4] = 1
    result = milp(
        cost,
        constraints=LinearConstraint(matrix, [r[1] for r in rows], [r[2] for r in rows]),
        integrality=integer,
        bounds=Bounds(np.zeros(nv), upper),
    )
    assert result.success, result.message
    return 2 * round(result.fun)


def exact_hybrid_cost(
    trace: Trace, budget: int, swap_s_per_byte: float
) -> tuple[float, tuple[str, ...]]:
    """The least modelled step cost over every choice of what to recompute, and that choice.

    Cost = the recomputed units' forward time + the least bytes any swap schedule moves (the
    ILP above) at ``swap_s_per_byte``. Every subset of the safe units, with no two nested units
    recomputed, whose recomputed trace has a feasible floor is tried: exponential, for a
    handful of units only. Returns (cost, recomputed names).
    """
    from itertools import product

    from vtensor.planner.lgm import min_budget
    from vtensor.planner.recomputed import with_recompute

    safe = [u for u in trace.units if u.safe]
    best: tuple[float, tuple[str, ...]] = (float("inf"), ())
    for picks in product((False, True), repeat=len(safe)):
        chosen = tuple(u.name for u, p in zip(safe, picks, strict=True) if p)
        if any(b.startswith(a + ".") for a in chosen for b in chosen if a != b):
            continue
        after = with_recompute(trace, chosen)
        if min_budget(build_lgm(after, after.chunk_bytes))[0] > budget:
            continue
        moved = exact_min_bytes_moved(after, budget)
        spent = sum(u.forward_s for u, p in zip(safe, picks, strict=True) if p)
        best = min(best, (spent + swap_s_per_byte * moved, chosen))
    return best
