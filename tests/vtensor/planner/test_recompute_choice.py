"""The choice of what to recompute (NOTE [hybrid plan] in vtensor/planner/recompute.py)."""

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vtensor.planner.recompute as choice
from tests.vtensor.planner.unit_traces import KB, Unit, demand, unit_trace
from vtensor.planner.belady import plan_lgm
from vtensor.planner.lgm import build_lgm, min_budget
from vtensor.planner.memory_model import check_plan
from vtensor.planner.plan import Plan
from vtensor.planner.recompute import (
    choose_recompute,
    inner_bytes,
    recompute_candidates,
    recompute_outermost,
    selective_bytes,
)
from vtensor.planner.recomputed import ONE_NODE_MAX_TAIL_SHARE, through_one_node, with_recompute
from vtensor.planner.trace import Phase, Trace, TraceStep, TraceTensor, TraceUnit


def test_nothing_is_recomputed_where_the_budget_does_not_bind() -> None:
    trace = unit_trace([("a", 0.01, 100 * KB, True), ("b", 0.01, 100 * KB, True)])
    assert choose_recompute(trace, demand(trace)) == ((), ())


def test_the_cheapest_units_per_byte_cover_the_deficit_and_no_more() -> None:
    trace = unit_trace(
        [("a", 0.05, 100 * KB, True), ("b", 0.01, 100 * KB, True), ("c", 0.02, 100 * KB, True)]
    )
    assert choose_recompute(trace, demand(trace) - 50 * KB) == (("b",), ())
    assert choose_recompute(trace, demand(trace) - 150 * KB) == (("b", "c"), ())


def test_an_unsafe_unit_is_never_recomputed() -> None:
    trace = unit_trace(
        [("a", 0.01, 100 * KB, False), ("b", 0.02, 100 * KB, True), ("c", 0.09, 100 * KB, True)]
    )
    assert choose_recompute(trace, demand(trace) - 150 * KB) == (("b", "c"), ())


def test_nested_units_are_never_both_recomputed() -> None:
    trace = unit_trace(
        [("a", 0.01, 100 * KB, True), ("a.x", 0.001, 100 * KB, True), ("c", 0.05, 100 * KB, True)]
    )
    assert choose_recompute(trace, demand(trace) - 150 * KB) == (("a.x", "c"), ())


def test_a_unit_whose_working_set_in_backward_does_not_fit_is_left_to_swapping() -> None:
    # "big" saves four 100 KB pieces over four forward steps, each evictable from the next
    # step on: swapping brings them back one by one, recomputation all at once in its backward.
    names = [f"forward:big.{i}" for i in range(4)] + ["forward:small"]
    names += ["backward:small"] + [f"backward:big.{i}" for i in reversed(range(4))]
    steps = tuple(
        TraceStep(i, n, Phase(n.split(":")[0]), 0.01, 0, 0, 0) for i, n in enumerate(names)
    )
    tensors = [TraceTensor(i, 100 * KB, ("float32",), i, i + 1, (9 - i,)) for i in range(4)]
    tensors += [TraceTensor(4, 50 * KB, ("float32",), 4, 5, (5,))]
    units = (
        TraceUnit("big", 0, 3, 0.001, (0, 1, 2, 3), (), True),
        TraceUnit("small", 4, 4, 0.01, (4,), (), True),
    )
    trace = Trace(steps, tuple(tensors), 0, 0, 0, None, "cpu", units=units)
    budget = 250 * KB
    assert min_budget(build_lgm(trace, None))[0] <= budget  # swapping alone fits
    assert min_budget(build_lgm(with_recompute(trace, ["big"]), None))[0] > budget
    assert choose_recompute(trace, budget) == (("small",), ())


def test_every_outermost_unit_is_the_second_candidate_selective_where_it_may_be() -> None:
    # "a" whole (its 150 KB for 60 ms) costs more than "a" selectively and "b.y" (51 ms): the
    # cheapest cover and the fewest outermost units whole differ.
    trace = unit_trace(
        [
            ("a", 0.06, 100 * KB, True, 0.001, 50 * KB),
            ("a.x", 0.001, 100 * KB, True),
            ("b", 0.05, 100 * KB, False),
            ("b.y", 0.05, 100 * KB, True),
            ("c", 0.2, 100 * KB, True),
        ]
    )
    budget = demand(trace) - 150 * KB
    cheapest = choose_recompute(trace, budget)
    assert cheapest == (("a", "b.y"), ("a",))
    assert choose_recompute(trace, budget, whole_outermost=True) == (("a",), ())
    # Unsafe "b" gives way to its safe child; "a" is recomputed selectively, "c" whole.
    assert recompute_outermost(trace, budget) == (("a", "b.y", "c"), ("a",))
    assert recompute_candidates(trace, budget) == (
        cheapest,
        recompute_outermost(trace, budget),
        choose_recompute(trace, budget, whole_outermost=True),
        recompute_outermost(trace, budget, whole=True),
    )
    # The fourth: every outermost unit whole, as checkpointing every block would. It is always
    # the last, equal to an earlier option or not: the race keeps it (NOTE [dominated
    # candidates]).
    assert recompute_outermost(trace, budget, whole=True) == (("a", "b.y", "c"), ())
    for cut in range(50, 400, 25):
        tight = demand(trace) - cut * KB
        candidates = recompute_candidates(trace, tight)
        assert candidates[-1] == recompute_outermost(trace, tight, whole=True)
        assert len(set(candidates)) == len(candidates)
    assert recompute_candidates(trace, demand(trace)) == ()  # nothing needs to leave


def test_an_option_that_alone_finishes_the_cover_for_less_time_is_taken() -> None:
    # NOTE [cheapest finish]: "big" frees the most per second (10 ms for 300 KB) and covers the
    # 150 KB deficit alone; "mid", recomputed last in backward, covers it too, for 8 ms.
    # Cheapest per byte first took "big".
    units: list[Unit] = [("mid", 0.008, 160 * KB, True), ("big", 0.010, 300 * KB, True)]
    trace = unit_trace([*units, ("s", 0.001, 20 * KB, True)])
    assert choose_recompute(trace, demand(trace) - 150 * KB) == (("mid",), ())
    # Where the ratio order's own cover is cheaper, it stands: "s" and "t" (2 ms) for 200 KB.
    cheap = unit_trace(
        [("big", 0.010, 300 * KB, True), ("s", 0.001, 100 * KB, True), ("t", 0.001, 100 * KB, True)]
    )
    assert choose_recompute(cheap, demand(cheap) - 150 * KB) == (("s", "t"), ())


def test_the_third_candidate_recomputes_as_few_outermost_units_whole_as_cover_the_deficit() -> None:
    # What checkpointing the cheapest blocks does: no selective unit (no dispatch mode), no
    # unit inside another, and no more than the deficit needs.
    trace = unit_trace(
        [
            ("a", 0.01, 100 * KB, True, 0.001, 50 * KB),
            ("a.x", 0.0001, 100 * KB, True),
            ("b", 0.05, 100 * KB, False),
            ("b.y", 0.001, 100 * KB, True),
            ("c", 0.2, 100 * KB, True),
        ]
    )
    budget = demand(trace) - 150 * KB
    assert choose_recompute(trace, budget) == (("a.x", "b.y"), ())  # cheaper, inside others
    # Outermost: "a" (its inner 150 KB, whole) and "b.y" (its unsafe parent's child); not "c".
    assert choose_recompute(trace, budget, whole_outermost=True) == (("a", "b.y"), ())
    # A smaller deficit: the cheapest per byte alone.
    assert choose_recompute(trace, budget + 100 * KB, whole_outermost=True) == (("b.y",), ())


def test_an_outermost_unit_whose_selective_option_does_not_fit_is_tried_whole() -> None:
    # a's product output (300 KB), which selective checkpointing keeps from a's forward through
    # its backward, would sit beside b's tensors in b's backward; whole, a's tensors come back
    # only in its own backward, as checkpointing every block does.
    trace = unit_trace([("a", 0.01, 100 * KB, True, 0.001, 300 * KB), ("b", 0.01, 200 * KB, True)])
    budget = 450 * KB
    floor = {
        name: min_budget(build_lgm(with_recompute(trace, ["a"], partial), None))[0]
        for name, partial in (("selective", ["a"]), ("whole", []))
    }
    assert floor["whole"] <= budget < floor["selective"], floor
    assert recompute_outermost(trace, budget) == (("a", "b"), ())


def _big_with_two_blocks() -> Trace:
    """One outermost unit holding two blocks, each saving 100 KB used in its own backward."""
    names = ["forward:big.0", "forward:big.1", "backward:big.1", "backward:big.0"]
    steps = tuple(
        TraceStep(i, n, Phase(n.split(":")[0]), 0.01, 0, 0, 0) for i, n in enumerate(names)
    )
    tensors = [TraceTensor(i, 100 * KB, ("float32",), i, i + 1, (3 - i,)) for i in range(2)]
    units = (
        TraceUnit("big", 0, 1, 0.002, (0, 1), (), True),
        TraceUnit("big.0", 0, 0, 0.001, (0,), (), True),
        TraceUnit("big.1", 1, 1, 0.0005, (1,), (), True),
    )
    return Trace(steps, tuple(tensors), 0, 0, 0, None, "cpu", units=units)


def test_an_outermost_unit_whose_working_set_does_not_fit_gives_way_to_its_children() -> None:
    trace = _big_with_two_blocks()
    budget = 150 * KB
    assert min_budget(build_lgm(with_recompute(trace, ["big"]), None))[0] > budget
    chosen, _ = recompute_outermost(trace, budget)
    assert "big" not in chosen and chosen
    assert min_budget(build_lgm(with_recompute(trace, chosen), None))[0] <= budget


def test_the_third_candidate_gives_way_to_the_blocks_of_an_outermost_unit_that_does_not_fit() -> (
    None
):
    # The main job's CNN is one outermost feature stack (and a head): recomputed whole, the
    # stack brings all its tensors back at once, which no small budget holds. The fewest
    # blocks whole that cover the deficit are then its children, cheapest per byte first, as
    # checkpointing the cheapest blocks would do; before, the candidate was the head alone.
    trace = _big_with_two_blocks()
    budget = 150 * KB
    assert min_budget(build_lgm(with_recompute(trace, ["big"]), None))[0] > budget
    chosen = choose_recompute(trace, budget, whole_outermost=True)
    assert chosen == (("big.1",), ())  # the cheaper per byte covers the 50 KB deficit
    assert min_budget(build_lgm(with_recompute(trace, chosen[0]), None))[0] <= budget


def test_with_recompute_drops_inner_tensors_keeps_inputs_and_holds_the_working_set() -> None:
    trace = unit_trace([("a", 0.01, 100 * KB, True), ("b", 0.01, 200 * KB, True)])
    after = with_recompute(trace, ["b"])
    assert [t.nbytes for t in after.tensors] == [KB, 100 * KB, KB]
    assert [t.vid for t in after.tensors] == [0, 1, 2]
    assert after.tensors[2].evictable_step == -1  # b's input: held by the checkpoint
    held = [s.unmanaged_peak_bytes for s in after.steps]
    assert held == [0, 0, 200 * KB, 0]  # b's backward step holds its inner bytes
    assert inner_bytes(trace, trace.units[1]) == 200 * KB


def test_a_unit_recomputed_through_one_node_also_holds_its_output_gradient() -> None:
    # NOTE [one-node recomputation]: the engine keeps the node's incoming gradient until its
    # backward returns; through checkpointing the unit's last op frees it.
    trace = unit_trace([("a", 0.01, 100 * KB, True), ("b", 0.01, 200 * KB, True)])
    b = dataclasses.replace(trace.units[1], output_bytes=50 * KB)
    checkpointed = dataclasses.replace(trace, units=(trace.units[0], b))
    one_node = dataclasses.replace(
        trace, units=(trace.units[0], dataclasses.replace(b, one_node=True))
    )
    held = [s.unmanaged_peak_bytes for s in with_recompute(checkpointed, ["b"]).steps]
    assert held == [0, 0, 200 * KB, 0]
    held = [s.unmanaged_peak_bytes for s in with_recompute(one_node, ["b"]).steps]
    assert held == [0, 0, 250 * KB, 0]


def test_a_unit_recomputed_through_one_node_leaves_its_inputs_free_to_move() -> None:
    # NOTE [one node's inputs]: the node saves them through the manager's hooks; checkpointing's
    # frame holds them from the forward to the backward.
    units = [("a", 0.01, 100 * KB, True), ("b", 0.01, 200 * KB, True), ("c", 0.01, KB, True)]
    trace = unit_trace(units)
    b = dataclasses.replace(trace.units[1], one_node=True)
    one_node = dataclasses.replace(trace, units=(trace.units[0], b, trace.units[2]))
    checkpointed = with_recompute(trace, ["b"])
    after = with_recompute(one_node, ["b"])
    assert checkpointed.tensors[2].evictable_step == -1
    assert after.tensors[2].evictable_step == trace.tensors[2].evictable_step  # b's input
    assert after.tensors[2].use_steps == (4,)  # b's backward: the steps it holds them
    floors = build_lgm(after, None).floors()
    assert floors[2] < build_lgm(checkpointed, None).floors()[2]  # away during c's steps


def test_a_unit_whose_forward_ends_in_a_long_tail_stays_with_checkpointing() -> None:
    # NOTE [one node or checkpointing]: checkpointing stops after the unit's last save, one
    # node runs the whole forward again.
    unit = TraceUnit("u", 0, 0, 0.010, (1,), (0,), True, one_node=True)
    assert ONE_NODE_MAX_TAIL_SHARE < 0.5
    assert through_one_node(unit)
    assert through_one_node(dataclasses.replace(unit, tail_s=0.010 * ONE_NODE_MAX_TAIL_SHARE))
    assert not through_one_node(dataclasses.replace(unit, tail_s=0.005))  # half its forward
    assert not through_one_node(dataclasses.replace(unit, one_node=False))


def test_a_recomputed_tensor_is_held_from_the_units_backward_to_its_own_last_use() -> None:
    # NOTE [recomputed lifetimes]: all come back at the unit's first backward step; each is
    # freed after the step that uses it, as torch's checkpoint drops it at its unpack.
    names = ["forward:u.0", "forward:u.1", "backward:u.1", "backward:u.0", "backward:stem"]
    steps = tuple(
        TraceStep(i, n, Phase(n.split(":")[0]), 0.01, 0, 0, 0) for i, n in enumerate(names)
    )
    tensors = (
        TraceTensor(0, 300 * KB, ("float32",), 0, 1, (3,)),  # used last, at backward:u.0
        TraceTensor(1, 100 * KB, ("float32",), 1, 2, (2,)),  # used at backward:u.1
    )
    unit = TraceUnit("u", 0, 1, 0.001, (0, 1), (), True)
    trace = Trace(steps, tensors, 0, 0, 0, None, "cpu", units=(unit,))
    held = [s.unmanaged_peak_bytes for s in with_recompute(trace, ["u"]).steps]
    assert held == [0, 0, 400 * KB, 300 * KB, 0]


def test_a_cheap_selective_option_is_taken_and_whole_where_it_frees_more_at_equal_cost() -> None:
    # a: its non-product ops cost a tenth of its forward, selective frees half: selective.
    # b: its non-product ops cost its whole forward: whole frees twice the bytes for the same.
    trace = unit_trace(
        [("a", 0.01, 100 * KB, True, 0.001, 100 * KB), ("b", 0.01, 100 * KB, True, 0.01, 100 * KB)]
    )
    assert choose_recompute(trace, demand(trace) - 50 * KB) == (("a",), ("a",))
    trace = unit_trace([("b", 0.01, 100 * KB, True, 0.01, 100 * KB), ("c", 0.05, 100 * KB, True)])
    assert choose_recompute(trace, demand(trace) - 50 * KB) == (("b",), ())


def test_a_unit_unsafe_to_recompute_selectively_is_recomputed_whole_or_not_at_all() -> None:
    trace = unit_trace([("a", 0.01, 100 * KB, True, 0.001, 100 * KB), ("c", 0.05, 100 * KB, True)])
    unit = dataclasses.replace(trace.units[0], selective_safe=False, why_not_selective="x")
    trace = dataclasses.replace(trace, units=(unit, trace.units[1]))
    assert choose_recompute(trace, demand(trace) - 50 * KB) == (("a",), ())


def test_with_recompute_models_a_selective_unit() -> None:
    trace = unit_trace(
        [("a", 0.01, 100 * KB, True, 0.001, 30 * KB), ("b", 0.01, 200 * KB, True, 0.002, 50 * KB)]
    )
    trace = dataclasses.replace(
        trace, units=(trace.units[0], dataclasses.replace(trace.units[1], product_bytes=7 * KB))
    )
    after = with_recompute(trace, ["a", "b"], ["b"])
    # a whole: its inner and product tensors gone; b selective: both leave the trace too.
    assert [t.nbytes for t in after.tensors] == [KB, KB]
    assert after.tensors[1].evictable_step == -1  # b's input: held by the checkpoint
    held = [s.unmanaged_peak_bytes for s in after.steps]
    # b (forward step 1, backward step 2): its product output and the 7 KB SAC's cache holds
    # from its forward through its backward, its freed inner bytes in its backward.
    assert held == [0, 57 * KB, 257 * KB, 130 * KB]
    assert selective_bytes(trace, after_units(trace)["b"]) == 200 * KB - 7 * KB


def after_units(trace: Trace) -> dict[str, TraceUnit]:
    return {u.name: u for u in trace.units}


def test_trace_units_and_plan_recompute_round_trip_through_json() -> None:
    trace = unit_trace([("a", 0.01, 100 * KB, True, 0.001, 10 * KB), ("b", 0.02, 200 * KB, False)])
    trace = dataclasses.replace(trace, recomputed=("a",), selective=("a",))
    assert Trace.from_json(trace.to_json()) == trace
    # Written field by field, the text is what ``dataclasses.asdict`` would give.
    assert trace.to_json() == json.dumps(dataclasses.asdict(trace), sort_keys=True)
    plan = dataclasses.replace(
        plan_lgm(trace, demand(trace) - 50 * KB),
        recompute=("a",),
        selective=("a",),
        predicted_step_s=0.5,
    )
    assert Plan.from_json(plan.to_json()) == plan


@st.composite
def _unit_traces(draw: st.DrawFn) -> tuple[Trace, int]:
    count = draw(st.integers(1, 6))
    units = []
    for i in range(count):
        parent = draw(st.one_of(st.none(), st.integers(0, max(0, i - 1))))
        name = f"u{i}" if parent is None or parent >= i else f"u{parent}.s{i}"
        unit: Unit = (
            name,
            draw(st.floats(1e-4, 0.1)),
            draw(st.integers(1, 300)) * KB,
            draw(st.booleans()),
        )
        if draw(st.booleans()):
            unit = (*unit, draw(st.floats(1e-5, 0.1)), draw(st.integers(1, 300)) * KB)
        units.append(unit)
    trace = unit_trace(units, draw(st.integers(0, 100)) * KB)
    full = demand(trace)
    return trace, int(full * draw(st.floats(0.2, 1.1)))


@settings(max_examples=60, deadline=None)
@given(_unit_traces())
def test_any_choice_is_safe_unnested_deterministic_and_plannable(case: tuple[Trace, int]) -> None:
    trace, budget = case
    for chosen, selective in recompute_candidates(trace, budget):
        _assert_a_fitting_choice(trace, budget, chosen, selective)
    assert recompute_candidates(trace, budget) == recompute_candidates(trace, budget)
    _assert_a_fitting_choice(trace, budget, *recompute_outermost(trace, budget))


def _assert_a_fitting_choice(
    trace: Trace, budget: int, chosen: tuple[str, ...], selective: tuple[str, ...]
) -> None:
    units = {u.name: u for u in trace.units}
    assert all(units[n].safe for n in chosen)
    assert set(selective) <= set(chosen) and all(units[n].selective_safe for n in selective)
    assert not any(a != b and b.startswith(a + ".") for a in chosen for b in chosen)
    if chosen:
        after = with_recompute(trace, chosen, selective)
        floor = min_budget(build_lgm(after, None))[0]
        assert floor <= budget
        plan = plan_lgm(after, budget)  # every needed tensor present when used, budget kept
        assert check_plan(plan, after, budget) == []


def test_every_block_whole_comes_last_even_where_it_is_also_the_cheapest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    every, selective = (("a", "b"), ()), (("a", "b"), ("a",))
    monkeypatch.setattr(choice, "choose_recompute", lambda *_, **__: every)
    monkeypatch.setattr(
        choice, "recompute_outermost", lambda *_, whole=False: every if whole else selective
    )
    trace = unit_trace([("a", 0.01, 100 * KB, True), ("b", 0.01, 100 * KB, True)])
    assert recompute_candidates(trace, 1) == (selective, every)


def test_a_units_mechanism_cost_counts_against_covering_with_many_small_units() -> None:
    # NOTE [mechanism cost]: two small units free the deficit for 2 ms of forward, one big unit
    # for 4 ms; with 3 ms a unit of the mechanism's own work, the big one is the cheaper cover.
    units: list[Unit] = [
        ("s1", 0.001, 100 * KB, True),
        ("s2", 0.001, 100 * KB, True),
        ("big", 0.004, 220 * KB, True),
    ]
    trace = unit_trace(units)
    assert choose_recompute(trace, demand(trace) - 150 * KB) == (("s1", "s2"), ())
    costly = dataclasses.replace(
        trace, units=tuple(dataclasses.replace(u, overhead_s=0.003) for u in trace.units)
    )
    assert choose_recompute(costly, demand(costly) - 150 * KB) == (("big",), ())
