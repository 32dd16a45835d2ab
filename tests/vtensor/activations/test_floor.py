"""The smallest budget a first iteration meets where a growth comes that the policy has not seen.

NOTE [unseen growth] in ``vtensor/activations/runtime/floor.py``: without a plan the policy makes
room only twice its reserve (plus the largest workspace) ahead, so a larger growth lands on all
that is resident; the floor there holds every byte of that point, the evicted ones included.
"""

from types import SimpleNamespace
from typing import Any

from vtensor.activations.runtime.floor import BudgetFloor
from vtensor.activations.runtime.recorder import IterationBooks
from vtensor.planner.reserves import MIN_BUDGET_MARGIN_BYTES

MIB = 1 << 20


def _floor(saved_bytes: int, resident_bytes: int) -> BudgetFloor:
    store: Any = SimpleNamespace(
        records={1: SimpleNamespace(nbytes=saved_bytes)}, device_bytes=lambda: resident_bytes
    )
    return BudgetFloor(store, IterationBooks(), budget_bytes=MIB)


def _policy(reserve_bytes: int, *, following_plan: bool = False) -> Any:
    return SimpleNamespace(
        reserve_bytes=reserve_bytes, transient_bytes=0, early_eviction=not following_plan
    )


def test_an_unseen_growth_holds_every_byte_of_its_point() -> None:
    floor = _floor(saved_bytes=5 * MIB, resident_bytes=1 * MIB)  # 4 MiB of it evicted
    floor.note_growth(6 * MIB, 3 * MIB, _policy(1 * MIB), "forward:out")
    assert floor.books.min_budget_bytes == 10 * MIB + MIN_BUDGET_MARGIN_BYTES
    assert floor.books.min_budget_step == "forward:out"


def test_a_growth_the_policy_made_room_for_leaves_the_floor_alone() -> None:
    floor = _floor(saved_bytes=5 * MIB, resident_bytes=1 * MIB)
    floor.note_growth(6 * MIB, 2 * MIB, _policy(1 * MIB), "forward:out")  # twice the reserve
    floor.note_growth(6 * MIB, 3 * MIB, _policy(1 * MIB, following_plan=True), "forward:out")
    assert floor.books.min_budget_bytes == 0
