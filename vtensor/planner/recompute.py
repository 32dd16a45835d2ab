"""Which modules to recompute instead of keeping or swapping what they save (pure).

NOTE [hybrid plan]
Every saved byte is kept, swapped or recomputed. A unit (a module, NOTE [recompute] in
``activations/recompute.py``) can be recomputed two ways. Whole, it frees its inner tensors from its
forward to its backward at the price of its measured forward time. Selectively (NOTE [selective
recompute] in ``activations/selective.py``), the outputs of its product ops (convolutions, matrix
products) are kept in a cache the manager does not see (torch's selective activation
checkpointing's, or, behind one node, the unit's own where all its products are its convolution
modules': NOTE [cached products] in ``activations/product_cache.py``) and only the rest is
recomputed: it frees the inner tensors no product op made, at the price of its non-product ops' time
(and SAC's dispatch mode, where it runs through it), and holds its product outputs, unswappable,
from their making through its backward. Either way recomputation brings the freed tensors back all
at once, at the start of the unit's backward, where swapping would bring them back one by one (each
then leaves after its last use: NOTE [recomputed lifetimes] in ``recomputed.py``). The options
cheapest per freed byte are taken first until they cover the deficit (the peak over the budget),
never two nested units nor both options of one, and an option is taken only if the iteration with it
(``with_recompute``) still has a feasible floor; where the deficit is still not covered, selective
units are recomputed whole instead, those adding the most bytes per second first. At every point of
that order the option of least time that would finish the cover alone is priced too, and the least
total time wins (NOTE [cheapest finish]). What remains is left to the swap planner. No bandwidth
model decides between the two: on a CPU the swap engine's work (sealing, system calls, page faults
on return) takes cores from compute even where the planner hides the transfer, which a model of the
disk alone does not see. So the choice is tested, not trusted, and is not the only one tried: every
outermost safe unit recomputed, selectively where it may be (what checkpointing every block does),
is a second candidate, and the fewest outermost units recomputed whole that cover the deficit,
cheapest per byte first (one that would not fit giving way to the units inside it), a third:
selective recomputation through SAC runs every op of its unit through a Python dispatch mode, which
a unit recomputed whole does not pay (NOTE [dispatch cost] in ``activations/selective_profile.py``),
and in a process with glibc's default allocator that third candidate was the fastest on MobileNetV2
at half its peak. The fourth is every outermost safe unit whole, what ``torch.utils.checkpoint`` on
every block does: where it fits it moves nothing, and a plan that moves nothing replays lean once a
full replay needed no guard (NOTE [step reserve] in ``planner/reserves.py``), so the race always
holds what a user's one line of checkpointing would do; on the held-out ViT the race had kept
swapping alone, 1.07x checkpointing's step. Each is profiled in an iteration of its own, its trace
planned by ``plan_lgm``, and the hybrid plans and the swap-only one are then replayed in turn and
the fastest replay kept (NOTE [plan race] in ``activations/race.py``).
"""

from collections.abc import Sequence

from vtensor.planner.lgm import build_lgm, empty_plan, min_budget
from vtensor.planner.memory_model import simulate
from vtensor.planner.plan import Plan
from vtensor.planner.recomputed import product_bytes, whole_s, with_recompute
from vtensor.planner.trace import TensorKind, Trace, TraceUnit


def inner_bytes(trace: Trace, unit: TraceUnit) -> int:
    """Bytes recomputing ``unit`` whole would not keep."""
    return sum(trace.tensors[v].nbytes for v in unit.inner_vids)


def unit_regrowth(trace: Trace) -> dict[str, tuple[int, int]]:
    """Per safe unit, what recomputing it holds at once: (whole, selectively).

    NOTE [regrowth bound]
    A trial of recomputation makes room for each unit before it runs again (NOTE [recomputed
    growth] in ``activations/policy.py``), from the swap-only profile, which never ran it
    twice. Its inner tensors were too little: the recomputation also makes afresh what the
    unit saved and a later unit shares (its output), and holds outputs that no op saved until
    it ends. A small ResNet's blocks held 1.0-1.5 times every tensor saved inside them (the
    unit's inputs aside), up to 3 times their inner bytes, and a selective recomputation of its
    stem, whose estimate had been its non-product tensors (none), held 1.06 MB; a trial then
    broke the budget by 250 KB beside a busy loop. So the bound was twice every tensor saved
    inside the unit but its inputs, the same whole or selectively (a selective one may make all
    but the product outputs afresh, and those are no larger). The profile now measures it: the
    unit's working set (NOTE [recomputation's working set] in ``activations/recorder.py``),
    less, selectively, the product outputs SAC's cache already holds. No hook reads inside a
    recomputation, so a trial reads its peak as where it began plus this figure, and its trace,
    and the plan made from it, hold what the recomputation held at once. On the char GPT at the
    GPU benchmark's batch and 40 %, the trials' readings then matched a count of live storages
    (533.6-547.7 MiB against 538.2-547.4), where they had read up to 111 MiB less; their race
    replays still held up to 782 MiB of live storages for 670, the temporaries inside the
    attention's backward ops that the budget leaves out unless ``count_workspaces``
    (benchmarks/README.md, "Recomputation's working set"). Where the profile measured nothing
    (no reading inside the unit's forward), the bound stands.
    """
    bounds = {}
    for unit in trace.units:
        if unit.safe and unit.working_bytes:
            selective = max(0, unit.working_bytes - product_bytes(trace, unit))
            bounds[unit.name] = (unit.working_bytes, selective)
        elif unit.safe:
            inputs = set(unit.input_vids)
            inside = sum(
                t.nbytes
                for t in trace.tensors
                if unit.first_step <= t.saved_step <= unit.last_step
                and t.vid not in inputs
                and t.kind is TensorKind.ACTIVATION
            )
            bounds[unit.name] = (2 * inside, 2 * inside)
    return bounds


def selective_bytes(trace: Trace, unit: TraceUnit) -> int:
    """Bytes recomputing ``unit`` selectively frees, less the product outputs it newly holds."""
    freed = sum(trace.tensors[v].nbytes for v in unit.selective_vids)
    return freed - unit.product_bytes


def choose_recompute(
    trace: Trace, budget_bytes: int, *, whole_outermost: bool = False
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The units of ``trace`` to recompute at ``budget_bytes``, and those of them selectively.

    With ``whole_outermost``, only outermost safe units are options, whole only: the blocks
    checkpointing would recompute, as few as cover the deficit, cheapest per byte first, one
    that would not fit giving way to the outermost units inside it (``_fewest_whole``).
    Both sorted, maybe empty. Deterministic: ties are broken by name, whole before selective.
    """
    # What the iteration would hold if nothing moved (the profiled one already swapped).
    demand = simulate(empty_plan(trace, budget_bytes, trace.chunk_bytes), trace)
    deficit = max(demand, default=0) - budget_bytes
    if deficit <= 0:
        return (), ()
    safe = [u for u in trace.units if u.safe]
    if whole_outermost:
        return _fewest_whole(trace, budget_bytes, deficit, safe), ()
    options = [(u, False, whole_s(u), inner_bytes(trace, u)) for u in safe]
    options += [
        (u, True, u.selective_s, selective_bytes(trace, u)) for u in safe if u.selective_safe
    ]
    ranked = sorted((o for o in options if o[3] > 0), key=lambda o: (o[2] / o[3], o[0].name, o[1]))
    chosen: list[str] = []
    selective: list[str] = []
    freed = 0
    spent = 0.0
    finishes: list[tuple[float, list[str], list[str]]] = []  # NOTE [cheapest finish]
    priced = False
    for unit, partial, seconds, nbytes in ranked:
        if freed >= deficit:
            break
        if not priced:  # what finishing the cover from here costs, once per prefix
            priced = True
            left = deficit - freed
            below = min((f[0] for f in finishes), default=float("inf")) - spent
            finish = _cheapest_finish(trace, budget_bytes, ranked, chosen, selective, left, below)
            if finish is not None:
                finishes.append((spent + finish[0], [*chosen, finish[1]], selective + finish[2]))
        if any(_nested(unit.name, other) for other in chosen):
            continue  # nested in a chosen unit, or the other option of one
        trial = with_recompute(trace, [*chosen, unit.name], [*selective, *[unit.name] * partial])
        if min_budget(build_lgm(trial, trace.chunk_bytes))[0] > budget_bytes:
            continue  # its working set in backward would not fit
        chosen.append(unit.name)
        if partial:
            selective.append(unit.name)
        freed += nbytes
        spent += seconds
        priced = False
    # Deficit left: recompute whole the selective units that free the most per extra second.
    units = {u.name: u for u in trace.units}
    upgrades = sorted(
        (_upgrade(trace, units[n]), n) for n in selective if _upgrade(trace, units[n])[1] > 0
    )
    for (_, extra), name in upgrades:
        if freed >= deficit:
            break
        trial = with_recompute(trace, chosen, [n for n in selective if n != name])
        if min_budget(build_lgm(trial, trace.chunk_bytes))[0] <= budget_bytes:
            selective.remove(name)
            freed += extra
    if freed >= deficit:
        spent = sum(units[n].selective_s if n in selective else whole_s(units[n]) for n in chosen)
        finishes.append((spent, chosen, selective))
    if finishes:
        _, chosen, selective = min(finishes, key=lambda f: f[0])  # the first of equals
    return tuple(sorted(chosen)), tuple(sorted(selective))


def _cheapest_finish(
    trace: Trace,
    budget_bytes: int,
    options: Sequence[tuple[TraceUnit, bool, float, int]],
    chosen: Sequence[str],
    selective: Sequence[str],
    left: int,
    below: float,
) -> tuple[float, str, list[str]] | None:
    """The option of least time, under ``below``, that alone frees ``left`` more bytes.

    NOTE [cheapest finish]
    Taking the options cheapest per freed byte first can overshoot: on the main job's CNN at
    its small class's budget (60 %), the deficit was 5.5 MiB and the best ratio, ``features.2``
    (2.5 ms for 11.8 MiB), covered it alone, where ``features.3`` (1.9 ms for 7.2 MiB) covered
    it too for less time. So at every point of the ratio order the cheapest option that would
    finish the cover on its own is priced too (the classic guard of greedy covering), and the
    least total time wins: the ratio order's own cover where nothing finishes for less. A
    finish is taken only where the iteration with it, nothing moved, really peaks within the
    budget (freed bytes are a proxy: those not live at the peak lower nothing), so it never
    leaves swapping to do; options nested in a chosen unit are passed over as there, and none
    is priced at or above a finish already priced (``below``, less what the prefix costs).
    Returns (its seconds, its name, [its name] if selective).
    """
    fitting = (o for o in options if o[3] >= left)
    for unit, partial, seconds, _ in sorted(fitting, key=lambda o: (o[2], o[0].name, o[1])):
        if seconds >= below:
            return None  # no cheaper than a finish already priced
        if any(_nested(unit.name, other) for other in chosen):
            continue
        trial = with_recompute(trace, [*chosen, unit.name], [*selective, *[unit.name] * partial])
        if _holds_under(trial, budget_bytes):
            return seconds, unit.name, [unit.name] * partial
    return None


def _holds_under(trace: Trace, budget_bytes: int) -> bool:
    """Whether ``trace`` peaks within ``budget_bytes`` with nothing moved."""
    kept = simulate(empty_plan(trace, budget_bytes, trace.chunk_bytes), trace)
    return max(kept, default=0) <= budget_bytes


def _fewest_whole(
    trace: Trace, budget_bytes: int, deficit: int, safe: Sequence[TraceUnit]
) -> tuple[str, ...]:
    """Outermost safe units whole, cheapest per byte first, until they cover ``deficit``.

    A unit whose recomputation would leave no feasible floor gives way to its outermost safe
    descendants, as in ``recompute_outermost``: a model whose blocks sit in one outermost
    stack (the main job's CNN: ``features`` and ``head``) gets its cheapest blocks, not the
    head alone. Sorted; deterministic.
    """
    frees = {u.name: inner_bytes(trace, u) for u in safe}

    def rank(u: TraceUnit) -> tuple[float, str]:
        return whole_s(u) / frees[u.name], u.name

    pool = sorted((u for u in _outermost(safe) if frees[u.name] > 0), key=rank)
    chosen: list[str] = []
    freed = 0
    while pool and freed < deficit:
        unit = pool.pop(0)
        trial = with_recompute(trace, [*chosen, unit.name])
        if min_budget(build_lgm(trial, trace.chunk_bytes))[0] > budget_bytes:
            inside = _outermost([u for u in safe if _inside(u.name, unit.name)])
            pool = sorted([*pool, *(u for u in inside if frees[u.name] > 0)], key=rank)
            continue
        chosen.append(unit.name)
        freed += frees[unit.name]
    return tuple(sorted(chosen))


def recompute_outermost(
    trace: Trace, budget_bytes: int, *, whole: bool = False
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Every outermost safe unit of ``trace``, selectively where it may be, and those of them.

    What checkpointing every block does, as a candidate for the race: where recomputing a unit
    selectively would leave no feasible floor at ``budget_bytes`` (its product outputs held
    from its forward through its backward), it is tried whole, as checkpointing recomputes it;
    where that would not fit either, its outermost safe descendants are tried in its place.
    With ``whole``, every unit is tried whole only: what ``torch.utils.checkpoint`` on every
    block does. Both sorted, maybe empty; deterministic.
    """
    safe = sorted((u for u in trace.units if u.safe), key=lambda u: u.name)
    frontier = _outermost(safe)
    chosen: list[str] = []
    selective: list[str] = []
    while frontier:
        unit = frontier.pop(0)
        for partial in ([unit.name], []) if unit.selective_safe and not whole else ([],):
            trial = with_recompute(trace, [*chosen, unit.name], [*selective, *partial])
            if min_budget(build_lgm(trial, trace.chunk_bytes))[0] <= budget_bytes:
                chosen.append(unit.name)
                selective += partial
                break
        else:
            frontier += _outermost([u for u in safe if _inside(u.name, unit.name)])
    return tuple(sorted(chosen)), tuple(sorted(selective))


def recompute_candidates(
    trace: Trace, budget_bytes: int
) -> tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]:
    """The recomputations worth a trial at ``budget_bytes``: (units, those selective) each.

    The cheapest cover of the deficit (``choose_recompute``), every outermost unit selectively
    where it may be and whole (``recompute_outermost``), the fewest outermost units whole that
    cover the deficit, and last every outermost unit whole (what checkpointing every block
    does, which a race always holds: NOTE [dominated candidates] in
    ``activations/iteration_plan.py``), once each; none where nothing needs to leave memory.
    """
    cheapest = choose_recompute(trace, budget_bytes)
    if not cheapest[0]:
        return ()
    found = [cheapest]
    for option in (
        recompute_outermost(trace, budget_bytes),
        choose_recompute(trace, budget_bytes, whole_outermost=True),
    ):
        if option[0] and option not in found:
            found.append(option)
    every_block = recompute_outermost(trace, budget_bytes, whole=True)
    if every_block[0]:
        found = [*(f for f in found if f != every_block), every_block]
    return tuple(found)


def _upgrade(trace: Trace, unit: TraceUnit) -> tuple[float, int]:
    """(seconds per byte, bytes) recomputing ``unit`` whole adds to recomputing it selectively."""
    extra = inner_bytes(trace, unit) - selective_bytes(trace, unit)
    return (whole_s(unit) - unit.selective_s) / max(extra, 1), extra


def predicted_step_s(trace: Trace, plan: Plan | None) -> float:
    """Measured compute of ``trace`` plus the stall ``plan`` predicts (inf without a plan)."""
    if plan is None:
        return float("inf")
    return sum(s.duration_s for s in trace.steps) + plan.predicted_stall_s


def _inside(a: str, b: str) -> bool:
    """Whether module ``a`` is a descendant of module ``b``."""
    return a.startswith(b + ".")


def _outermost(units: Sequence[TraceUnit]) -> list[TraceUnit]:
    """Those of ``units`` inside none of the others, in order."""
    return [u for u in units if not any(_inside(u.name, o.name) for o in units)]


def _nested(a: str, b: str) -> bool:
    return a == b or _inside(a, b) or _inside(b, a)
