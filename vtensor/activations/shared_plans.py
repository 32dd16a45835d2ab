"""The plan cache as one manager uses it: plans loaded and stored, decisions shared or followed.

NOTE [provisional plan]
A manager that follows another's decision (NOTE [one decider] in ``planner/claims.py``) neither
profiles, tries nor races. The decider publishes the best plan it knows beside the cache
(``<key digest>.provisional.json``, an entry like the cache's, checksummed): its profile's
plan once it has one, then, as each trial adds a candidate, the one that moves nothing priced
least where one does (NOTE [priced higher] in ``planner/dominance.py``), else the one
predicted fastest, and in the race the candidate with the least median time once every
candidate has run. The follower replays
the latest one in full (every hook point guarded, as for a plan made in this process), and
runs the reactive policy until there is one, or where one broke the budget here (that plan is
not replayed again; the next one published is). Once the decision is cached the follower loads
it as any cached plan; if the decider lets go undecided (it closed, and parked its progress:
NOTE [undecided plans]), the next follower to claim the key takes the progress up and decides.
The follower's iterations report plan source ``shared``. Every plan it replays keeps the budget
and trains bit-identically, as every candidate does: following changes only how fast.

A follower replays the latest published plan lean once a full replay of it here needed nothing
from the guard, as a manager does with its own plans (NOTE [lean replay]).

Two processes of the main job's micro class started together on an empty cache (2026-12-06,
a one-off script of 12-step rounds): before, each profiled, tried and raced, rounds of 1.83 and
1.99 s (first steps 0.62-0.67 s). Now the decider's round takes 1.74-2.01 s as before; the
follower runs five reactive steps (0.11-0.23 s) until the first plan is published, then
replays the decider's plans (44-80 ms; 75-80 ms while every replay was full): its round 1.25 s.
"""

import logging
import os
from collections.abc import Callable

from vtensor.activations.executor import PlanExecutor
from vtensor.activations.iteration_plan import IterationPlan
from vtensor.activations.margin import Profile
from vtensor.activations.race import PlanRace
from vtensor.activations.report import PlanSource
from vtensor.activations.undecided import Undecided, park, take_up
from vtensor.errors import VTensorError
from vtensor.planner.cache import PlanCache
from vtensor.planner.claims import DecisionClaims
from vtensor.planner.dominance import likely_fastest
from vtensor.planner.keys import PlanKey
from vtensor.planner.plan import Plan

logger = logging.getLogger(__name__)


class SharedPlans:
    """A manager's plans in a cache shared by processes: loaded, stored, parked, claimed, followed.

    Args:
        directory: the plan cache's directory.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.cache = PlanCache(directory)
        self.claims = DecisionClaims(directory)
        self._published: dict[str, Plan] = {}  # the plan last published per claimed key
        # Per followed key: the provisional file's mtime when read, its plan (None: none,
        # unreadable, or it broke the budget here), and whether a full replay here proved it
        # needs no guard, so that it replays lean (NOTE [lean replay]).
        self._seen: dict[str, tuple[int, Plan | None, bool]] = {}

    def load(self, key: PlanKey) -> tuple[Plan, bool] | None:
        """``key``'s cached plan, and whether an earlier manager proved it lean; None: a miss."""
        plan = self.cache.get(key)
        return None if plan is None else (plan, self.cache.replays_lean(key, plan))

    @property
    def load_s(self) -> float:
        """Seconds the last :meth:`load` took."""
        return self.cache.last_load_s

    def note_lean(self, key: PlanKey, plan: Plan) -> None:
        """Note beside ``key``'s cached ``plan`` that a full replay needed no guard."""
        self.cache.mark_lean(key, plan)

    def store(self, key: PlanKey, plan: Plan | None) -> None:
        """``key`` is decided: cache ``plan`` (None: no plan) and let the followers have it."""
        if plan is not None:
            try:
                self.cache.put(key, plan)
            except VTensorError as err:
                logger.warning("plan not cached: %s", err)
            self.cache.drop_undecided(key)  # decided (NOTE [undecided plans])
        self.settle(key)

    def park(self, key: PlanKey, undecided: Undecided) -> None:
        """Leave ``key``'s decision under way for the next manager (NOTE [undecided plans])."""
        park(self.cache, key, undecided)

    def take_up(self, key: PlanKey) -> Undecided | None:
        """The decision under way a closed manager left for ``key``, if any."""
        return take_up(self.cache, key)

    def decides(self, key: PlanKey) -> bool:
        """Whether this manager decides ``key``'s plan: it holds the claim, or has just taken it."""
        held = self.claims.holds(key)
        if not self.claims.claim(key):
            return False
        if not held:
            logger.info("deciding the plan of %s for the managers sharing its cache", key.digest())
        return True

    def refresh(self, key: PlanKey) -> None:
        """The decision of ``key`` goes on here: keep its claim fresh."""
        self.claims.refresh(key)

    def follow(
        self, signature: str, key: PlanKey, executor_of: Callable[[Plan], PlanExecutor]
    ) -> IterationPlan:
        """An iteration that follows the decider of ``key``: its provisional plan, or reactive."""
        _, plan, lean = self._provisional(key)
        executor = executor_of(plan) if plan is not None else None
        return IterationPlan(
            signature, PlanSource.SHARED, executor, False, key, lean=lean, following=True
        )

    def replayed(self, chosen: IterationPlan, guard_bytes: int) -> None:
        """A following iteration's full replay needed ``guard_bytes`` from the guard.

        At none, the same plan replays lean from the next iteration on (NOTE [lean replay]).
        """
        if chosen.executor is None or chosen.lean or guard_bytes or chosen.key is None:
            return
        digest = chosen.key.digest()
        mtime, plan, _ = self._seen.get(digest, (0, None, False))
        if plan is chosen.executor.plan:
            self._seen[digest] = (mtime, plan, True)

    def excuse(self, chosen: IterationPlan) -> bool:
        """A following iteration broke the budget: excused, and its plan dropped, if it had one."""
        if chosen.executor is None or chosen.key is None:
            return False  # reactive: the budget is infeasible, as a profile would have found
        digest = chosen.key.digest()
        mtime = self._seen.get(digest, (0, None, False))[0]
        self._seen[digest] = (mtime, None, False)  # until the decider publishes another
        logger.warning("a provisional plan broke the budget here: reactive until the next one")
        chosen.abandoned = True
        return True

    def publish(
        self,
        key: PlanKey,
        race: PlanRace | None,
        candidates: list[tuple[Plan, Profile]],
        unit_s: dict[str, tuple[float, float]],
    ) -> None:
        """Publish the best plan known for ``key``, which this manager decides.

        The race's leader, or else the likeliest fastest of the candidates (``unit_s``: what
        recomputing each unit costs; NOTE [provisional plan]).
        """
        digest = key.digest()
        if race is not None:
            best: Plan | None = race.leader()
        else:
            best = likely_fastest([plan for plan, _ in candidates], unit_s)
        if best is None or not self.claims.holds(key) or self._published.get(digest) is best:
            return
        self._published[digest] = best
        self.cache.put_provisional(key, best)

    def settle(self, key: PlanKey) -> None:
        """``key`` is decided (or proved infeasible) here: its provisional plan and claim go."""
        if not self.claims.holds(key):
            return
        self._published.pop(key.digest(), None)
        self.cache.drop_provisional(key)  # its own, or a parked decision's it took up
        self.claims.release(key)

    def close(self) -> None:
        """Let go of every claim, once the decisions under way are parked; published plans stay."""
        self.claims.release_all()
        self._published.clear()

    def _provisional(self, key: PlanKey) -> tuple[int, Plan | None, bool]:
        """The decider's provisional plan of ``key``, read again only when the file changed."""
        digest = key.digest()
        try:
            mtime = self.cache.provisional_path(key).stat().st_mtime_ns
        except OSError:
            return 0, None, False
        seen = self._seen.get(digest)
        if seen is None or seen[0] != mtime:
            seen = (mtime, self.cache.get_provisional(key), False)
            self._seen[digest] = seen
        return seen
