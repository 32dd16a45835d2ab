"""A decision between candidate plans still under way, kept beside the plan cache between managers.

NOTE [undecided plans]
With recomputation, a signature's plan is decided over several iterations: the profile, one
trial per candidate recomputation, then the race (NOTE [plan race]). A manager closed before
the decision (a round shorter than that; in deployment, a client process per message) lost it,
and the next manager began again with a profile, so no hybrid plan ever reached the cache. A
manager with a plan cache now leaves the decision's progress beside the cache's entries as it
closes: the candidates still to try, the plans made so far, the race's times and turn, and each
candidate's profile (so that a candidate can still be made again under the guard's margin).
The next manager with no plan for that key, in this process or another, takes the progress up
(the file goes then; it is written again if that manager too closes undecided) and goes on
from the next trial or the next turn of the race. Progress holds plans and traces: sizes,
times and step names, never a tensor's values. Times measured by another process join the race
as they are; the race keeps each candidate's median time, so a slow process can cost a
candidate the race, never correctness: every candidate keeps the budget and trains bit-identically.
Unreadable progress is ignored with a warning, and the next iteration profiles again.
"""

import logging
from dataclasses import dataclass, field
from typing import Any

from vtensor.activations.iteration_plan import Trials
from vtensor.activations.margin import Profile
from vtensor.activations.race import PlanRace
from vtensor.errors import VTensorError
from vtensor.planner.cache import PlanCache
from vtensor.planner.keys import PlanKey
from vtensor.planner.plan import Plan
from vtensor.planner.trace import Trace

logger = logging.getLogger(__name__)

UNDECIDED_SCHEMA_VERSION = 1


@dataclass
class Undecided:
    """One signature's decision under way: trials to run, or a race, and the candidates' profiles.

    ``candidates`` pairs each candidate plan with the profile it was made from; its plans are
    the same objects as the trials' or the race's (``PlanBook`` finds them by identity).
    """

    trials: Trials | None = None
    race: PlanRace | None = None
    candidates: list[tuple[Plan, Profile]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON; shared plans are written once and referred to by index."""
        plans: list[Plan] = []

        def ref(plan: Plan | None) -> int | None:
            if plan is None:
                return None
            for index, known in enumerate(plans):
                if known is plan:
                    return index
            plans.append(plan)
            return len(plans) - 1

        trials = None
        if self.trials is not None:
            trials = {
                "pending": [[list(n), list(s)] for n, s in self.trials.pending],
                "plans": [ref(p) for p in self.trials.plans],
                "swap_only": ref(self.trials.swap_only),
                "growth": {n: list(g) for n, g in self.trials.growth.items()},
                "encoded": self.trials.encoded,
                "one_node": list(self.trials.one_node),
                "cached": list(self.trials.cached),
                "kept": [[list(n), list(s)] for n, s in self.trials.kept],
                "unit_s": self.trials.unit_s,
            }
        race = None
        if self.race is not None:
            race = {
                "plans": [ref(p) for p in self.race.plans],
                "times": self.race.times,
                "turn": self.race.turn,
                "clean": self.race.clean,
                "leans": self.race.leans,
                "unit_s": self.race.unit_s,
            }
        candidates = [
            [ref(plan), trace.to_json(), reserve, minimum]
            for plan, (trace, reserve, minimum) in self.candidates
        ]
        return {
            "schema_version": UNDECIDED_SCHEMA_VERSION,
            "plans": [p.to_json() for p in plans],
            "trials": trials,
            "race": race,
            "candidates": candidates,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Undecided":
        """Parse :meth:`to_dict`'s output.

        Raises:
            ValueError, TypeError, KeyError, IndexError: the data is not such output.
        """
        if raw.get("schema_version") != UNDECIDED_SCHEMA_VERSION:
            raise ValueError(f"schema version {raw.get('schema_version')!r}")
        plans = [Plan.from_json(text) for text in raw["plans"]]

        def plan(index: int | None) -> Plan | None:
            return None if index is None else plans[index]

        def some(index: int) -> Plan:
            return plans[index]

        trials = None
        if raw["trials"] is not None:
            t = raw["trials"]
            pending = [(tuple(n), tuple(s)) for n, s in t["pending"]]
            if not pending:
                raise ValueError("trials with no candidate left to try")
            growth = {str(n): (int(w), int(s)) for n, (w, s) in t.get("growth", {}).items()}
            plans_so_far, swap_only = [some(i) for i in t["plans"]], plan(t["swap_only"])
            whole = tuple(str(n) for n in t.get("one_node", ()))
            kept = tuple((tuple(n), tuple(s)) for n, s in t.get("kept", ()))
            encoded = bool(t.get("encoded"))
            cached = tuple(str(n) for n in t.get("cached", ()))
            trials = Trials(pending, plans_so_far, swap_only, growth, encoded, whole, kept, cached)
            # Written before candidates were priced: none is priced higher (NOTE [priced higher]).
            trials.unit_s = _prices(t)
        race = None
        if raw["race"] is not None:
            r = raw["race"]
            race = PlanRace([some(i) for i in r["plans"]])
            times = [[float(x) for x in ts] for ts in r["times"]]
            clean = [bool(c) for c in r["clean"]]
            # Progress written before lean times were told apart: its times count as full ones.
            leans = [
                [bool(x) for x in ls] for ls in r.get("leans", [[False] * len(t) for t in times])
            ]
            if len(times) != len(race.plans) or len(clean) != len(race.plans):
                raise ValueError("race times or flags do not match its plans")
            if [len(t) for t in times] != [len(ls) for ls in leans]:
                raise ValueError("race times and their lean flags do not match")
            race.times, race.clean, race.leans = times, clean, leans
            race.turn = int(r["turn"])
            race.unit_s = _prices(r)
            if not 0 <= race.turn < len(race.plans):
                raise ValueError(f"race turn {race.turn} of {len(race.plans)} plans")
        if trials is None and race is None:
            raise ValueError("neither trials nor a race")
        candidates = [
            (some(i), (Trace.from_json(trace), int(reserve), int(minimum)))
            for i, trace, reserve, minimum in raw["candidates"]
        ]
        return cls(trials, race, candidates)


def _prices(raw: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """The units' prices of parked trials or race (none in progress written before them)."""
    return {str(n): (float(w), float(s)) for n, (w, s) in raw.get("unit_s", {}).items()}


def park(cache: PlanCache, key: PlanKey, undecided: Undecided) -> None:
    """Leave ``undecided`` beside ``cache`` for the next manager of ``key``; warn if it cannot."""
    try:
        cache.put_undecided(key, undecided.to_dict())
    except VTensorError as err:
        logger.warning("the decision under way is not kept: %s", err)


def take_up(cache: PlanCache, key: PlanKey) -> Undecided | None:
    """The decision under way that a closed manager left for ``key``, if any (removed from disk)."""
    progress = cache.take_undecided(key)
    if progress is None:
        return None
    try:
        undecided = Undecided.from_dict(progress)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        logger.warning("ignoring the decision under way of %s: %s", key.digest(), exc)
        return None
    logger.info(
        "taking up the decision under way: %s",
        "a race" if undecided.race is not None else "trials of recomputation",
    )
    return undecided
