"""plan_lgm: a pure planner from a Trace to a swap Plan, in named passes over the trace's LGM.

docs/lgm.md states the algorithm; NOTE [memory model] in memory_model.py, what occupies memory.
"""

import bisect
import logging
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from vtensor.errors import InfeasibleBudgetError
from vtensor.planner.lgm import (
    DEFAULT_READ_BYTES_PER_S,
    DEFAULT_WRITE_BYTES_PER_S,
    FROM_TRACE,
    Bytes,
    LayeredGraph,
    TraceDefault,
    build_lgm,
    empty_plan,
    evictable_at,
    min_budget,
)
from vtensor.planner.memory_model import (
    chunk_of,
    last_live_step,
    next_use,
    predict_stalls,
    tail_chunk_bytes,
)
from vtensor.planner.plan import Plan, TensorMove
from vtensor.planner.trace import Trace, TraceTensor

logger = logging.getLogger(__name__)


@dataclass
class _Window:
    """Working record of one move: ``nbytes`` of ``vid`` away during ``[first, stop)``."""

    vid: int
    first: int
    stop: int
    n_chunks: int = 0
    nbytes: int = 0


def plan_lgm(
    trace: Trace,
    budget_bytes: int,
    *,
    chunk_bytes: int | Literal[TraceDefault.TRACE] | None = FROM_TRACE,
    write_bytes_per_s: float = DEFAULT_WRITE_BYTES_PER_S,
    read_bytes_per_s: float = DEFAULT_READ_BYTES_PER_S,
    floors_over: bool = False,
) -> Plan:
    """Plan which chunks leave and return at which step so that ``trace`` fits ``budget_bytes``.

    Pure and deterministic: farthest-next-use (Belady) eviction of exactly the deficit at each
    over-budget layer, then each prefetch as early as memory allows.

    Args:
        trace: the profiled iteration.
        budget_bytes: device bytes never to exceed.
        chunk_bytes: unit of eviction; None for whole tensors; default: the trace's.
        write_bytes_per_s: swap-out bandwidth of the slower tier.
        read_bytes_per_s: swap-in bandwidth of the slower tier.
        floors_over: a step whose floor lies above ``budget_bytes`` is planned at its floor, and
            the plan's budget is the highest of those (NOTE [floor over the budget]).

    Raises:
        InfeasibleBudgetError: even with every evictable byte away some step exceeds the budget
            (never with ``floors_over``).
        ValueError: the trace is inconsistent or a parameter is not positive.
    """
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes={budget_bytes} must not be negative")
    chunk = trace.chunk_bytes if chunk_bytes is FROM_TRACE else chunk_bytes
    lgm = build_lgm(trace, chunk, write_bytes_per_s, read_bytes_per_s)
    floor, step = min_budget(lgm)
    if budget_bytes < floor and not floors_over:
        name = trace.steps[step].name
        raise InfeasibleBudgetError(budget_bytes, floor, name, "planning on the trace")
    # Per step, the bytes not to exceed: the budget, or a floor above it (``floors_over``).
    caps = (
        np.maximum(lgm.floors(), budget_bytes)
        if floors_over
        else np.full(lgm.n_steps, budget_bytes)
    )
    budget_bytes = int(caps.max(initial=budget_bytes))
    resident = lgm.full_resident()
    windows = _evict_farthest(lgm, resident, caps)
    windows = _trim_overshoot(lgm, windows, resident, caps)
    windows = _close_cycles(lgm, windows, resident)
    _schedule_prefetches(lgm, windows, resident, caps)
    moves = sorted(
        (TensorMove(w.vid, w.nbytes, w.first, w.stop) for w in windows),
        key=lambda m: (m.evict_step, m.vid),
    )
    plan = replace(
        empty_plan(trace, budget_bytes, chunk),
        moves=tuple(moves),
        predicted_peak_bytes=int(resident.max(initial=0)),
    )
    stall_s = sum(predict_stalls(plan, trace, write_bytes_per_s, read_bytes_per_s))
    plan = replace(plan, predicted_stall_s=stall_s)
    logger.info(
        "LGM plan: %d moves, %d bytes moved, peak %d of %d, predicted stall %.4f s",
        len(moves), plan.bytes_moved, plan.predicted_peak_bytes, budget_bytes, stall_s,
    )  # fmt: skip
    return plan


def _evict_farthest(lgm: LayeredGraph, resident: Bytes, caps: Bytes) -> list[_Window]:
    """Walk the layers; at each over its cap, evict exactly the deficit, farthest next use first.

    A victim stays away for its whole gap between uses; ``resident`` is updated in place.
    """
    starting: dict[int, list[TraceTensor]] = {}
    for t in lgm.trace.tensors:
        starting.setdefault(t.saved_step, []).append(t)
    active: list[TraceTensor] = []
    windows: dict[tuple[int, int], _Window] = {}
    never = lgm.n_steps  # sorts after every real use
    for s in range(lgm.n_steps):
        active += starting.get(s, [])
        deficit = int(resident[s] - caps[s])
        if deficit <= 0:
            continue
        active = [t for t in active if last_live_step(t, lgm.n_steps) >= s]
        by_rank: dict[float, list[TraceTensor]] = {}
        for t in active:
            if evictable_at(t, s):
                use = next_use(t, s)
                rank = (never if use is None else use - s) * _cost_weight(lgm, t, use)
                by_rank.setdefault(rank, []).append(t)
        for rank in sorted(by_rank, reverse=True):
            deficit = _evict_group(lgm, s, deficit, by_rank[rank], windows, resident)
            if deficit <= 0:
                break
        assert deficit <= 0, "min_budget() guarantees every deficit can be covered"
    return sorted(windows.values(), key=lambda w: (w.stop, w.vid))


def _cost_weight(lgm: LayeredGraph, t: TraceTensor, use: int | None) -> float:
    """How much farther a clean tensor's next use counts than a dirty one's.

    NOTE [cost-weighted distance]: evicting an activation costs a write and a read; evicting a
    persistent tensor unchanged since its last write-back is a drop and costs only the read. So
    a clean victim's distance is multiplied by ``(1/write + 1/read) / (1/read)``.
    """
    clean = t.persistent and use is not None and (t.dirty_step < 0 or use <= t.dirty_step)
    return 1.0 + lgm.read_bytes_per_s / lgm.write_bytes_per_s if clean else 1.0


def _evict_group(
    lgm: LayeredGraph,
    step: int,
    deficit: int,
    group: list[TraceTensor],
    windows: dict[tuple[int, int], _Window],
    resident: Bytes,
) -> int:
    """Cover ``deficit`` from vTensors with the same next use; return what is left of it.

    The smallest that covers it alone goes, else the largest, and repeat: small overshoot.
    """
    sizes: list[tuple[int, int, TraceTensor]] = []
    for t in group:
        w = windows.get((t.vid, _gap(t, step, lgm.n_steps)[1]))
        left = t.nbytes - (w.nbytes if w else 0)
        if left > 0:
            sizes.append((left, t.vid, t))
    sizes.sort()
    while deficit > 0 and sizes:
        i = bisect.bisect_left(sizes, deficit, key=lambda entry: entry[0])
        _, _, t = sizes.pop(i if i < len(sizes) else -1)
        deficit -= _evict_more(lgm, t, step, deficit, windows, resident)
    return deficit


def _gap(t: TraceTensor, step: int, n_steps: int) -> tuple[int, int]:
    """The longest ``[first, stop)`` around ``step`` during which ``t`` may be away."""
    uses = sorted(set(t.use_steps))
    i = bisect.bisect_right(uses, step)
    previous = uses[i - 1] if i else -1
    first = max(t.saved_step, t.evictable_step, previous + 1)
    return first, uses[i] if i < len(uses) else n_steps


def _evict_more(
    lgm: LayeredGraph,
    t: TraceTensor,
    step: int,
    deficit: int,
    windows: dict[tuple[int, int], _Window],
    resident: Bytes,
) -> int:
    """Evict the fewest more tail chunks of ``t`` covering ``deficit``; return bytes freed."""
    first, stop = _gap(t, step, lgm.n_steps)
    w = windows.setdefault((t.vid, stop), _Window(t.vid, first, stop))
    if w.n_chunks == lgm.n_chunks(t):
        return 0
    k = max(w.n_chunks + 1, _chunks_for(lgm, t, w.nbytes + deficit))
    return _resize(lgm, w, k, resident)


def _resize(lgm: LayeredGraph, w: _Window, n_chunks: int, resident: Bytes) -> int:
    """Set ``w`` to the last ``n_chunks`` chunks of its vTensor; return the bytes this frees."""
    t = lgm.trace.tensors[w.vid]
    nbytes = tail_chunk_bytes(t.nbytes, chunk_of(t, lgm.chunk_bytes), n_chunks)
    freed = nbytes - w.nbytes
    w.n_chunks, w.nbytes = n_chunks, nbytes
    resident[w.first : w.stop] -= freed
    return freed


def _chunks_for(lgm: LayeredGraph, t: TraceTensor, nbytes: int) -> int:
    """The fewest tail chunks of ``t`` that hold at least ``nbytes``."""
    if nbytes <= 0:
        return 0
    chunk = chunk_of(t, lgm.chunk_bytes)
    if chunk is None or nbytes >= t.nbytes:
        return lgm.n_chunks(t)
    return lgm.n_chunks(t) - (t.nbytes - nbytes) // chunk


def _trim_overshoot(
    lgm: LayeredGraph, windows: list[_Window], resident: Bytes, caps: Bytes
) -> list[_Window]:
    """Bring back, largest first, whole chunks no layer of their window needs away any more."""
    for w in sorted(windows, key=lambda w: (-w.nbytes, w.vid, w.first)):
        slack = int((caps[w.first : w.stop] - resident[w.first : w.stop]).min())
        k = _chunks_for(lgm, lgm.trace.tensors[w.vid], w.nbytes - slack)
        if k < w.n_chunks:
            _resize(lgm, w, k, resident)
    return [w for w in windows if w.n_chunks]


def _close_cycles(lgm: LayeredGraph, windows: list[_Window], resident: Bytes) -> list[_Window]:
    """Make each persistent tensor's residency at the end of the iteration match its start.

    Iterations repeat: one away after its last use is still away at the next start.
    """
    n = lgm.n_steps
    by_vid: dict[int, list[_Window]] = {}
    for w in windows:
        by_vid.setdefault(w.vid, []).append(w)
    added: list[_Window] = []
    for vid, group in sorted(by_vid.items()):
        t = lgm.trace.tensors[vid]
        if not t.persistent or t.saved_step != 0 or not t.use_steps:
            continue
        first_use, last_use = min(t.use_steps), max(t.use_steps)
        starts = any(w.first == 0 for w in group)
        ends = any(w.stop == n for w in group)
        if ends and not starts and first_use > 0:
            added.append(_Window(vid, 0, first_use))
        if starts and not ends and last_use + 1 < n:
            added.append(_Window(vid, last_use + 1, n))
    for w in added:
        _resize(lgm, w, lgm.n_chunks(lgm.trace.tensors[w.vid]), resident)
    return sorted([*windows, *added], key=lambda w: (w.stop, w.vid))


def _schedule_prefetches(
    lgm: LayeredGraph, windows: list[_Window], resident: Bytes, caps: Bytes
) -> None:
    """Issue each restore as early as memory allows, earliest use first (it gets memory first)."""
    for w in windows:
        if w.stop >= lgm.n_steps:
            continue
        fits = resident[w.first + 1 : w.stop] + w.nbytes <= caps[w.first + 1 : w.stop]
        blocked = np.flatnonzero(~fits)
        start = w.first + 1 + (int(blocked[-1]) + 1 if blocked.size else 0)
        resident[start : w.stop] += w.nbytes
        w.stop = start
