"""The planner's memory model: resident bytes per step under a plan, its checks, its stalls."""

import bisect
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from vtensor.planner.plan import Plan, TensorMove
from vtensor.planner.trace import Trace, TraceTensor

# NOTE [memory model]: tensor t occupies ``nbytes`` from ``saved_step`` through its last use
# (through the last step if it has none or is persistent: parameters and optimizer state live
# across iterations); a move takes ``evict_bytes`` off it during ``[evict_step, prefetch_step)``.
# Resident bytes at a step are its unmanaged peak plus the resident parts of the live tensors.
# docs/lgm.md states the model in full.


def last_live_step(tensor: TraceTensor, n_steps: int) -> int:
    """The last step at which ``tensor`` occupies memory: its last use, else the last step."""
    if tensor.persistent or not tensor.use_steps:
        return n_steps - 1
    return max(tensor.use_steps)


# NOTE [backward parts]: a module whose forward calls tensor ops itself (an attention) has its
# whole backward in one step, and each tensor it unpacks is freed once the node that used it is
# done, often before the step's peak: held to the step, they would overstate the floor. So a
# profile cuts a backward step into parts, one beginning at the first unpack after a node ended
# (``TraceStep.part_peak_bytes``), and notes the part of each tensor's last unpack
# (``TraceTensor.last_part``). A tensor counts from its use step's start and, at its last use,
# through that part; the step's unmanaged figure is its largest part less the tensors used there
# (the model adds them back). No plan changes which part frees what, so this holds for any plan.


def step_unmanaged(trace: Trace) -> npt.NDArray[np.int64]:
    """Per step, the unmanaged bytes of NOTE [memory model], by parts (NOTE [backward parts])."""
    n = len(trace.steps)
    figure = np.array([s.unmanaged_peak_bytes for s in trace.steps], dtype=np.int64)
    parted = {s.index: s.part_peak_bytes for s in trace.steps if len(s.part_peak_bytes) > 1}
    if not parted:
        return figure
    held = {i: np.array(parts, dtype=np.int64) for i, parts in parted.items()}
    used = dict.fromkeys(parted, 0)
    for t in trace.tensors:
        last = last_live_step(t, n)
        for u in set(t.use_steps) & parted.keys():
            used[u] += t.nbytes
            frees_here = u == last and not t.persistent and t.last_part >= 0
            held[u][: t.last_part + 1 if frees_here else None] += t.nbytes
    for i, parts in held.items():
        figure[i] = min(figure[i], int(parts.max()) - used[i])
    return figure


def chunk_of(tensor: TraceTensor, chunk_bytes: int | None) -> int | None:
    """The unit in which ``tensor`` moves: the plan's chunk, or None (whole) for whole tensors."""
    return None if tensor.whole else chunk_bytes


def tail_chunk_bytes(nbytes: int, chunk_bytes: int | None, n_chunks: int) -> int:
    """Bytes in the last ``n_chunks`` chunks of a ``nbytes`` tensor (the last chunk is short)."""
    if n_chunks <= 0:
        return 0
    if chunk_bytes is None:
        return nbytes
    total_chunks = -(-nbytes // chunk_bytes)
    return nbytes - min(nbytes, max(0, total_chunks - n_chunks) * chunk_bytes)


def next_use(t: TraceTensor, step: int) -> int | None:
    """The first use of ``t`` at or after ``step``; None if none."""
    uses = sorted(t.use_steps)
    i = bisect.bisect_left(uses, step)
    return uses[i] if i < len(uses) else None


def unmanaged_peak(trace: Trace, kept: Sequence[tuple[int, int]] = ()) -> int:
    """The most bytes ``trace``'s iteration would have held with nothing moved or recomputed.

    ``kept``: ``(step, bytes)`` the trace leaves out that the plain loop holds from that step to
    the iteration's end (the gradients an offloaded update consumed at once).
    """
    resident = np.array(simulate(None, trace), dtype=np.int64)
    for step, nbytes in kept:
        resident[step:] += nbytes
    return int(resident.max(initial=0))


def simulate(plan: Plan | None, trace: Trace) -> list[int]:
    """Resident device bytes at each step of ``trace`` when ``plan`` is replayed (None: none)."""
    n = len(trace.steps)
    delta = np.zeros(n + 1, dtype=np.int64)
    for t in trace.tensors:
        delta[t.saved_step] += t.nbytes
        delta[last_live_step(t, n) + 1] -= t.nbytes
    for m in plan.moves if plan is not None else ():
        if 0 <= m.vid < len(trace.tensors) and 0 <= m.evict_step < m.prefetch_step <= n:
            stop = min(m.prefetch_step, last_live_step(trace.tensors[m.vid], n) + 1)
            if m.evict_step < stop:
                delta[m.evict_step] -= m.evict_bytes
                delta[stop] += m.evict_bytes
    return [int(b) for b in step_unmanaged(trace) + np.cumsum(delta[:n])]


# NOTE [confirmed readings]: a lean replay's reading confirms the plan's prediction, after which
# the bytes the trace explains are known from the plan alone; another reading adds only bytes
# no trace explains, and each walks the whole heap. So of the steps predicted near the budget, a
# lean replay reads where the plan predicts more than ``slack_bytes`` above its last reading, at
# the predicted peak, and after ``stride`` near steps without one: unexplained bytes are found
# within ``stride`` near steps.
READING_STRIDE = 8


def watched_steps(plan: Plan, trace: Trace, margin_bytes: int, slack_bytes: int) -> tuple[int, ...]:
    """The steps near the budget and the peak's that a lean replay reads at.

    NOTE [confirmed readings] picks them from those predicted within ``margin_bytes``.
    """
    resident = simulate(plan, trace)
    if not resident:
        return ()
    top = max(range(len(resident)), key=resident.__getitem__)
    near = plan.budget_bytes - margin_bytes
    candidates = [i for i, b in enumerate(resident) if b >= near or i == top]
    return confirming_readings(resident, candidates, top, slack_bytes, READING_STRIDE)


def confirming_readings(
    resident: list[int], candidates: list[int], top: int, slack_bytes: int, stride: int
) -> tuple[int, ...]:
    """Of ``candidates`` (ascending steps), those NOTE [confirmed readings] reads at."""
    if stride < 1:
        raise ValueError(f"stride={stride}: a lean replay must read at least every candidate")
    chosen: list[int] = []
    confirmed, unread = 0, 0
    for step in candidates:
        rises = resident[step] > confirmed + slack_bytes
        if not chosen or step == top or rises or unread >= stride:
            chosen.append(step)
            confirmed, unread = resident[step], 0
        else:
            unread += 1
    return tuple(chosen)


def watched_events(plan: Plan, trace: Trace, steps: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """The first saved-tensor event at or after each of ``steps`` (NOTE [hookless replay]).

    Each event once, in order; empty when a step has none after it.
    """
    events = [(t.saved_step, 0, t.vid) for t in trace.tensors[: plan.activation_count]]
    events += [
        (t.use_steps[0], 1, t.vid) for t in trace.tensors[: plan.activation_count] if t.use_steps
    ]
    events.sort()
    chosen: list[tuple[int, int]] = []
    for step in steps:
        i = bisect.bisect_left(events, (step, -1, -1))
        if i == len(events):
            return ()
        _, kind, vid = events[i]
        if (vid, kind) not in chosen:
            chosen.append((vid, kind))
    return tuple(chosen)


def step_headroom(plan: Plan, trace: Trace) -> tuple[int, ...]:
    """Per step, the plan's budget less the bytes it predicts resident there (never below 0)."""
    return tuple(max(0, plan.budget_bytes - b) for b in simulate(plan, trace))


def check_plan(plan: Plan, trace: Trace, budget_bytes: int) -> list[str]:
    """Every way ``plan`` breaks the rules on ``trace`` under ``budget_bytes``; empty if none."""
    names = tuple(s.name for s in trace.steps)
    sizes = tuple(t.nbytes for t in trace.tensors)
    if plan.step_names != names or plan.tensor_bytes != sizes:
        return ["plan is for another trace (step names or vTensor sizes differ)"]
    problems = [p for m in plan.moves for p in _check_move(m, plan.chunk_bytes, trace)]
    problems += _check_disjoint(plan.moves)
    problems += _check_cycle(plan.moves, trace)
    for step, resident in zip(trace.steps, simulate(plan, trace), strict=True):
        if resident > budget_bytes:
            problems.append(f"step {step.index} {step.name!r}: {resident} bytes > {budget_bytes}")
    return problems


def _check_move(m: TensorMove, chunk_bytes: int | None, trace: Trace) -> list[str]:
    n = len(trace.steps)
    if not 0 <= m.vid < len(trace.tensors):
        return [f"move of unknown vTensor {m.vid}"]
    t = trace.tensors[m.vid]
    kept = t.nbytes - m.evict_bytes
    bad: list[str] = []
    chunk = chunk_of(t, chunk_bytes)
    whole = kept == 0 if chunk is None else kept >= 0 and kept % chunk == 0
    if m.evict_bytes <= 0 or not whole:
        bad.append(f"vTensor {m.vid}: {m.evict_bytes} bytes is not a whole number of tail chunks")
    if t.evictable_step < 0 or m.evict_step < max(t.saved_step, t.evictable_step):
        bad.append(f"vTensor {m.vid}: evicted at step {m.evict_step}, before it was evictable")
    if not m.evict_step < m.prefetch_step <= n or m.evict_step > last_live_step(t, n):
        bad.append(f"vTensor {m.vid}: window [{m.evict_step}, {m.prefetch_step}) is not legal")
    used = [u for u in t.use_steps if m.evict_step <= u < m.prefetch_step]
    if used:
        bad.append(f"vTensor {m.vid}: used at step {used[0]} while evicted")
    return bad


def _check_cycle(moves: tuple[TensorMove, ...], trace: Trace) -> list[str]:
    """A persistent tensor away at the end of an iteration must be away at the start of one."""
    n = len(trace.steps)
    at_end = {m.vid for m in moves if m.prefetch_step == n}
    at_start = {m.vid for m in moves if m.evict_step == 0}
    return [
        f"vTensor {vid}: persistent, away at the end of the iteration but not at its start"
        for vid in sorted(at_end - at_start)
        if 0 <= vid < len(trace.tensors)
        and trace.tensors[vid].persistent
        and trace.tensors[vid].saved_step == 0
        and 0 not in trace.tensors[vid].use_steps
    ]


def _check_disjoint(moves: tuple[TensorMove, ...]) -> list[str]:
    bad: list[str] = []
    last_stop: dict[int, int] = {}
    for m in sorted(moves, key=lambda m: (m.vid, m.evict_step)):
        if m.evict_step < last_stop.get(m.vid, -1):
            bad.append(f"vTensor {m.vid}: overlapping moves at step {m.evict_step}")
        last_stop[m.vid] = max(last_stop.get(m.vid, -1), m.prefetch_step)
    return bad


def predict_stalls(
    plan: Plan,
    trace: Trace,
    write_bytes_per_s: float,
    read_bytes_per_s: float,
) -> list[float]:
    """Seconds compute waits for transfers at the start of each step when ``plan`` is replayed.

    One FIFO channel; a restore is due at its next use, an eviction at the first step over
    budget without it.
    """
    resident = np.array(simulate(plan, trace), dtype=np.int64)
    issued: dict[int, list[tuple[float, int]]] = {}  # step -> (seconds of I/O, step it is due)
    writes = writing_moves(plan, trace)
    for m in plan.moves:
        if m not in writes:
            continue  # a clean copy is in the tier already: leaving memory is free
        away = resident[m.evict_step : m.prefetch_step] + m.evict_bytes > plan.budget_bytes
        if away.any():
            due = m.evict_step + int(np.argmax(away))
            issued.setdefault(m.evict_step, []).append((m.evict_bytes / write_bytes_per_s, due))
    for m in plan.moves:
        use = next_use(trace.tensors[m.vid], m.prefetch_step)
        if m.prefetch_step < len(trace.steps) and use is not None:
            issued.setdefault(m.prefetch_step, []).append((m.evict_bytes / read_bytes_per_s, use))
    return _replay_timeline(trace, issued)


def writing_moves(plan: Plan, trace: Trace) -> set[TensorMove]:
    """The moves whose eviction writes bytes; the others drop a copy the tier already holds.

    A persistent tensor keeps its last written copy (NOTE [write-back residency]): only its
    first move after its change (``dirty_step``, cyclically) writes.
    """
    writes: set[TensorMove] = set()
    by_vid: dict[int, list[TensorMove]] = {}
    for m in plan.moves:
        by_vid.setdefault(m.vid, []).append(m)
    for vid, moves in by_vid.items():
        t = trace.tensors[vid] if 0 <= vid < len(trace.tensors) else None
        if t is None or not t.persistent:
            writes.update(moves)
            continue
        if t.dirty_step < 0:
            continue
        moves.sort(key=lambda m: m.evict_step)
        after = [m for m in moves if m.evict_step > t.dirty_step]
        writes.add(after[0] if after else moves[0])
    return writes


def _replay_timeline(trace: Trace, issued: dict[int, list[tuple[float, int]]]) -> list[float]:
    now_s, channel_free_s = 0.0, 0.0
    due: dict[int, float] = {}
    stalls: list[float] = []
    for step in trace.steps:
        for io_s, due_step in issued.get(step.index, []):
            channel_free_s = max(channel_free_s, now_s) + io_s
            due[due_step] = max(due.get(due_step, 0.0), channel_free_s)
        stall = max(0.0, due.get(step.index, 0.0) - now_s)
        stalls.append(stall)
        now_s += stall + step.duration_s
    return stalls
