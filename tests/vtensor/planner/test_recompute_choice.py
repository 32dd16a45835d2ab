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
)
from vtensor.planner.recomputed import with_recompute
from vtensor.planner.trace import Phase, Trace, TraceStep, TraceTensor, TraceUnit


def test_nothing_is_recomputed_where_the_budget_does_not_bind() -> None:
    trace = unit_trace([("a", 0.01, 100 * KB, True), ("b", 0.01, 100 * KB, True)])
    assert choose_recompute(trace, demand(trace)) == ()


def test_the_cheapest_units_per_byte_cover_the_deficit_and_no_more() -> None:
    trace = unit_trace(
        [("a", 0.05, 100 * KB, True), ("b", 0.01, 100 * KB, True), ("c", 0.02, 100 * KB, True)]
    )
    assert choose_recompute(trace, demand(trace) - 50 * KB) == ("b",)
    assert choose_recompute(trace, demand(trace) - 150 * KB) == ("b", "c")


def test_an_unsafe_unit_is_never_recomputed() -> None:
    trace = unit_trace(
        [("a", 0.01, 100 * KB, False), ("b", 0.02, 100 * KB, True), ("c", 0.09, 100 * KB, True)]
    )
    assert choose_recompute(trace, demand(trace) - 150 * KB) == ("b", "c")


def test_nested_units_are_never_both_recomputed() -> None:
    trace = unit_trace(
        [("a", 0.01, 100 * KB, True), ("a.x", 0.001, 100 * KB, True), ("c", 0.05, 100 * KB, True)]
    )
    assert choose_recompute(trace, demand(trace) - 150 * KB) == ("a.x", "c")


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
    assert choose_recompute(trace, budget) == ("small",)


def test_every_outermost_unit_is_the_second_candidate() -> None:
    # "a.x" and "b.y" cover the deficit for 51 ms; checkpointing every block recomputes "a"
    # (around "a.x"), "b.y" (its unsafe parent's child) and "c".
    trace = unit_trace(
        [
            ("a", 0.06, 100 * KB, True),
            ("a.x", 0.001, 100 * KB, True),
            ("b", 0.05, 100 * KB, False),
            ("b.y", 0.05, 100 * KB, True),
            ("c", 0.2, 100 * KB, True),
        ]
    )
    budget = demand(trace) - 150 * KB
    cheapest = choose_recompute(trace, budget)
    assert cheapest == ("a.x", "b.y")
    # Unsafe "b" gives way to its safe child.
    assert recompute_outermost(trace, budget) == ("a", "b.y", "c")
    assert recompute_candidates(trace, budget) == (cheapest, ("a", "b.y", "c"))
    for cut in range(50, 400, 25):
        tight = demand(trace) - cut * KB
        candidates = recompute_candidates(trace, tight)
        assert len(set(candidates)) == len(candidates)  # each priced once
        every_block = recompute_outermost(trace, tight)
        assert not candidates or not every_block or candidates[-1] == every_block
    assert recompute_candidates(trace, demand(trace)) == ()  # nothing needs to leave


def test_an_option_that_alone_finishes_the_cover_for_less_time_is_taken() -> None:
    # NOTE [cheapest finish]: "big" frees the most per second (10 ms for 300 KB) and covers the
    # 150 KB deficit alone; "mid", recomputed last in backward, covers it too, for 8 ms.
    # Cheapest per byte first took "big".
    units: list[Unit] = [("mid", 0.008, 160 * KB, True), ("big", 0.010, 300 * KB, True)]
    trace = unit_trace([*units, ("s", 0.001, 20 * KB, True)])
    assert choose_recompute(trace, demand(trace) - 150 * KB) == ("mid",)
    # Where the ratio order's own cover is cheaper, it stands: "s" and "t" (2 ms) for 200 KB.
    cheap = unit_trace(
        [("big", 0.010, 300 * KB, True), ("s", 0.001, 100 * KB, True), ("t", 0.001, 100 * KB, True)]
    )
    assert choose_recompute(cheap, demand(cheap) - 150 * KB) == ("s", "t")


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
    chosen = recompute_outermost(trace, budget)
    assert "big" not in chosen and chosen
    assert min_budget(build_lgm(with_recompute(trace, chosen), None))[0] <= budget


def test_with_recompute_drops_inner_tensors_keeps_inputs_and_holds_the_working_set() -> None:
    trace = unit_trace([("a", 0.01, 100 * KB, True), ("b", 0.01, 200 * KB, True)])
    after = with_recompute(trace, ["b"])
    assert [t.nbytes for t in after.tensors] == [KB, 100 * KB, KB]
    assert [t.vid for t in after.tensors] == [0, 1, 2]
    assert after.tensors[2].evictable_step == -1  # b's input: held by the checkpoint
    held = [s.unmanaged_peak_bytes for s in after.steps]
    assert held == [0, 0, 200 * KB, 0]  # b's backward step holds its inner bytes
    assert inner_bytes(trace, trace.units[1]) == 200 * KB


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


def test_trace_units_and_plan_recompute_round_trip_through_json() -> None:
    trace = unit_trace([("a", 0.01, 100 * KB, True), ("b", 0.02, 200 * KB, False)])
    trace = dataclasses.replace(trace, recomputed=("a",))
    assert Trace.from_json(trace.to_json()) == trace
    # Written field by field, the text is what ``dataclasses.asdict`` would give.
    assert trace.to_json() == json.dumps(dataclasses.asdict(trace), sort_keys=True)
    plan = dataclasses.replace(
        plan_lgm(trace, demand(trace) - 50 * KB),
        recompute=("a",),
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
        units.append(unit)
    trace = unit_trace(units, draw(st.integers(0, 100)) * KB)
    full = demand(trace)
    return trace, int(full * draw(st.floats(0.2, 1.1)))


@settings(max_examples=60, deadline=None)
@given(_unit_traces())
def test_any_choice_is_safe_unnested_deterministic_and_plannable(case: tuple[Trace, int]) -> None:
    trace, budget = case
    for chosen in recompute_candidates(trace, budget):
        _assert_a_fitting_choice(trace, budget, chosen)
    assert recompute_candidates(trace, budget) == recompute_candidates(trace, budget)
    _assert_a_fitting_choice(trace, budget, recompute_outermost(trace, budget))


def _assert_a_fitting_choice(trace: Trace, budget: int, chosen: tuple[str, ...]) -> None:
    units = {u.name: u for u in trace.units}
    assert all(units[n].safe for n in chosen)
    assert not any(a != b and b.startswith(a + ".") for a in chosen for b in chosen)
    if chosen:
        after = with_recompute(trace, chosen)
        floor = min_budget(build_lgm(after, None))[0]
        assert floor <= budget
        plan = plan_lgm(after, budget)  # every needed tensor present when used, budget kept
        assert check_plan(plan, after, budget) == []


def test_every_block_comes_last_and_is_priced_once_where_it_is_also_the_cheapest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cheapest, every = ("a",), ("a", "b")
    monkeypatch.setattr(choice, "choose_recompute", lambda *_: cheapest)
    monkeypatch.setattr(choice, "recompute_outermost", lambda *_: every)
    trace = unit_trace([("a", 0.01, 100 * KB, True), ("b", 0.01, 100 * KB, True)])
    assert recompute_candidates(trace, 1) == (cheapest, every)
    monkeypatch.setattr(choice, "choose_recompute", lambda *_: every)
    assert recompute_candidates(trace, 1) == (every,)


def test_a_units_mechanism_cost_counts_against_covering_with_many_small_units() -> None:
    # NOTE [mechanism cost]: two small units free the deficit for 2 ms of forward, one big unit
    # for 4 ms; with 3 ms a unit of the mechanism's own work, the big one is the cheaper cover.
    units: list[Unit] = [
        ("s1", 0.001, 100 * KB, True),
        ("s2", 0.001, 100 * KB, True),
        ("big", 0.004, 220 * KB, True),
    ]
    trace = unit_trace(units)
    assert choose_recompute(trace, demand(trace) - 150 * KB) == ("s1", "s2")
    costly = dataclasses.replace(
        trace, units=tuple(dataclasses.replace(u, overhead_s=0.003) for u in trace.units)
    )
    assert choose_recompute(costly, demand(costly) - 150 * KB) == ("big",)
