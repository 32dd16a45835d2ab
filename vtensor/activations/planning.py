"""Where an iteration's swap plan comes from: this process's plans, the plan cache, or profiling."""

import dataclasses
import logging
import time
from collections.abc import Sequence
from os import PathLike

import torch
from torch import nn

from vtensor.activations.encoding_choice import EncodingChoice
from vtensor.activations.executor import PlanExecutor
from vtensor.activations.guarded_plan import plan_within_guard
from vtensor.activations.iteration_plan import IterationPlan, Trials, trials_of
from vtensor.activations.margin import Profile, plan_again, remake
from vtensor.activations.model_state import ModelScan
from vtensor.activations.plan_keys import PlanKeys, planner_version
from vtensor.activations.race import PlanRace
from vtensor.activations.report import PlanSource
from vtensor.activations.selective import load_sac
from vtensor.activations.shared_plans import SharedPlans
from vtensor.activations.store import ChunkStore
from vtensor.activations.undecided import Undecided
from vtensor.planner.keys import PlanKey
from vtensor.planner.plan import Plan
from vtensor.planner.recompute import predicted_step_s, recompute_candidates
from vtensor.planner.trace import Trace

logger = logging.getLogger(__name__)


class PlanBook:
    """Keeps a plan per input signature; profiles, plans and caches as needed.

    Args:
        budget_bytes: the budget plans are made for.
        chunk_bytes: chunk size (None: tensor granularity).
        cache_dir: plan cache directory shared by processes (None: no cache).
        planned: False to run the reactive policy only.
        count_workspaces: plans budget op workspaces.
        recompute: plans may recompute modules as well as swap (NOTE [hybrid plan]).
        encode_masks: iterations save clamps' inputs as bits (NOTE [mask encoding]); ``"auto"``:
            as the plans decide (NOTE [encoding decided] in ``activations/encoding_choice.py``).
    """

    def __init__(
        self,
        budget_bytes: int,
        chunk_bytes: int | None,
        cache_dir: str | PathLike[str] | None,
        planned: bool = True,
        count_workspaces: bool = False,
        recompute: bool = False,
        encode_masks: bool | str = False,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.chunk_bytes = chunk_bytes
        # The plan cache, where one of the managers sharing it decides (NOTE [one decider]).
        self.shared = SharedPlans(cache_dir) if cache_dir is not None else None
        self.planned = planned
        self.planner_version = planner_version(count_workspaces, recompute, encode_masks)
        self._keys_of = PlanKeys(budget_bytes, chunk_bytes, self.planner_version)
        self.encoding = EncodingChoice(encode_masks)
        self.count_workspaces = count_workspaces
        self._plans: dict[str, Plan | None] = {}  # None: the planner found no plan
        self.recompute = recompute
        if recompute:
            load_sac()  # NOTE [SAC's imports]: before any step of this manager
        # Signatures whose next iterations are trials, one candidate each (NOTE [hybrid plan]).
        self._trial: dict[str, Trials] = {}
        # Signatures whose cached plan broke the budget in a lean replay: profile them again.
        self._reprofile: set[str] = set()
        # Signatures whose plan a full replay has shown to need no guard: they replay lean.
        self._lean: set[str] = set()
        # Signatures whose hybrid and swap-only plans are replayed in turn (NOTE [plan race]).
        self._race: dict[str, PlanRace] = {}
        # The profile (trace, reserve, minimum budget) of each signature's kept plan until it is
        # planned again with a margin (NOTE [guard margin]), and of each candidate's in a race.
        self._profiles: dict[str, Profile] = {}
        self._candidates: dict[str, list[tuple[Plan, Profile]]] = {}
        # Each profiled signature's key, to leave its decision under way (NOTE [undecided plans]).
        self._keys: dict[str, PlanKey] = {}

    def for_iteration(
        self,
        model: nn.Module,
        scan: ModelScan,
        inputs: Sequence[torch.Tensor],
        device: torch.device,
        store: ChunkStore,
        params: str = "",
    ) -> IterationPlan:
        """Choose the plan (or profiling) for the coming iteration; then ``encoding.apply`` it.

        ``params`` is the parameter offloading's ``plan_signature()`` for a joint plan.
        """
        if not self.planned:
            return IterationPlan("", PlanSource.REACTIVE, None, False, None)
        key = self._keys_of.of(model, scan, inputs, device, params)
        signature = key.digest()
        race = self._race.get(signature)
        if self.shared is not None and (race is not None or signature in self._trial):
            self.shared.refresh(key)
        if race is not None:
            executor = self._executor(race.current(), store)
            return IterationPlan(
                signature, PlanSource.PLANNED, executor, False, key, racing=True, lean=race.lean()
            )
        if signature in self._plans:
            plan = self._plans[signature]
            if plan is None:
                return IterationPlan(signature, PlanSource.REACTIVE, None, False, key)
            return IterationPlan(
                signature,
                PlanSource.PLANNED,
                self._executor(plan, store),
                False,
                key,
                lean=signature in self._lean,
            )
        if signature in self._trial:
            return self._trial[signature].next_trial(signature, key)
        if self.shared is not None and signature not in self._reprofile:
            loaded = self.shared.load(key)
            if loaded is not None:
                self._plans[signature], lean = loaded
                if lean:  # proven in an earlier manager
                    self._lean.add(signature)
                executor = self._executor(loaded[0], store)
                chosen = IterationPlan(signature, PlanSource.CACHED, executor, False, key)
                chosen.cache_load_s, chosen.lean = self.shared.load_s, signature in self._lean
                return chosen
            if not self.shared.decides(key):  # NOTE [one decider]
                return self.shared.follow(signature, key, lambda plan: self._executor(plan, store))
            undecided = self.shared.take_up(key)  # NOTE [undecided plans]
            if undecided is not None:
                self._take(signature, key, undecided)
                return self.for_iteration(model, scan, inputs, device, store, params)
        units = self.recompute and not params  # activations alone, not with parameter offloading
        return IterationPlan(signature, PlanSource.PROFILED, None, True, key, find_units=units)

    def _plan(
        self, trace: Trace, reserve_bytes: int, min_bytes: int, margin_bytes: int = 0
    ) -> Plan | None:
        """The plan of ``trace`` that leaves the guard its headroom; None if there is none."""
        return plan_within_guard(
            trace, self.budget_bytes, self.chunk_bytes, reserve_bytes, min_bytes, margin_bytes
        )

    def plan_for(
        self,
        model: nn.Module,
        inputs: Sequence[torch.Tensor],
        device: torch.device,
        params: str = "",
    ) -> Plan | None:
        """The plan held in this process for these settings (None: none yet, or no plan)."""
        key = self._keys_of.of(model, ModelScan.of(model), inputs, device, params)
        return self._plans.get(key.digest())

    def _take(self, signature: str, key: PlanKey, undecided: Undecided) -> None:
        if undecided.trials is not None:
            self._trial[signature] = undecided.trials
        if undecided.race is not None:
            self._race[signature] = undecided.race
        self._candidates[signature], self._keys[signature] = undecided.candidates, key

    def close(self) -> None:
        """Leave each decision under way beside the plan cache (NOTE [undecided plans])."""
        if self.shared is None:
            return
        for signature in {*self._trial, *self._race} & self._keys.keys():
            trials, race = self._trial.get(signature), self._race.get(signature)
            undecided = Undecided(trials, race, self._candidates.get(signature, []))
            self.shared.park(self._keys[signature], undecided)
        self._trial.clear()  # left on disk: a manager used again takes them up from there
        self._race.clear()
        self.shared.close()

    def _executor(self, plan: Plan, store: ChunkStore) -> PlanExecutor:
        return PlanExecutor(plan, store, wait_early_evictions=self.count_workspaces)

    def abandon_trial(self, chosen: IterationPlan) -> bool:
        """Drop the candidate whose trial broke the budget (False: ``chosen`` was no trial).

        The next is tried; with none left, those that fitted race, or the only plan is kept.
        """
        trials = self._trial.get(chosen.signature)
        if trials is None or chosen.executor is not None:
            return False
        chosen.abandoned = True
        trials.pending.pop(0)
        if not trials.pending:
            del self._trial[chosen.signature]
            plan = self._race_or_only(chosen.signature, trials)
            if chosen.signature not in self._race:
                self._store(chosen, plan)
        return True

    def excuse(self, chosen: IterationPlan, was_lean: bool, over_bytes: int = 0) -> bool:
        """An iteration broke the budget by ``over_bytes``: whether it is excused (else it raises).

        A lean replay's plan is profiled again (NOTE [lean replay]: its minimum would not work);
        a trial drops its candidate, a racing one is made again lower or leaves the race (NOTE
        [disqualified] in ``activations/race.py``): their gradients are right, their peak was not.
        One not excused proves the budget infeasible: this manager lets go of its claim.
        """
        excused = self._excused(chosen, was_lean, over_bytes)
        if not excused and self.shared is not None and chosen.key is not None:
            self.shared.settle(chosen.key)  # NOTE [one decider]
        return excused

    def _excused(self, chosen: IterationPlan, was_lean: bool, over_bytes: int) -> bool:
        if chosen.following:
            return self.shared is not None and self.shared.excuse(chosen)
        if was_lean:
            self.forget(chosen)
            return True
        if chosen.racing and (race := self._race.get(chosen.signature)) is not None:
            chosen.abandoned = True  # ``over_bytes`` over: made again that much lower, once
            candidates = self._candidates.get(chosen.signature, [])
            remade = remake(candidates, race.current(), self._plan, over_bytes)
            if (winner := race.broke_budget(remade)) is not None:
                del self._race[chosen.signature]
                self._store(chosen, winner)
            elif not race.plans:
                self.forget(chosen)  # none left: profile again
            return True
        if abandoned := self.abandon_trial(chosen):
            logger.warning("recomputing %s broke the budget: dropped", chosen.recompute)
        return abandoned

    def _plan_with_margin(self, chosen: IterationPlan, plan: Plan, guard_bytes: int) -> None:
        """Plan ``chosen``'s signature again under the guard's margin, once per decision."""
        profile = self._profiles.pop(chosen.signature, None)  # once: the profile is used up
        if profile is None:
            return
        replanned = plan_again(self._plan, profile, plan, guard_bytes)  # NOTE [guard margin]
        if replanned is not None:
            self._store(chosen, replanned)

    def _note_lean(self, chosen: IterationPlan, plan: Plan) -> None:
        """Note beside the cached plan that a full replay of ``plan`` needed no guard."""
        if self.shared and chosen.key and self._plans.get(chosen.signature) is plan:
            self.shared.note_lean(chosen.key, plan)  # the next managers start lean

    def _store(self, chosen: IterationPlan, plan: Plan | None) -> None:
        candidates = self._candidates.pop(chosen.signature, None)
        if candidates is not None:  # a new decision: its profile allows one margin again
            self._profiles.pop(chosen.signature, None)
            for profile in (pr for p, pr in candidates if p is plan):
                self._profiles[chosen.signature] = profile
        self._plans[chosen.signature] = plan
        self._reprofile.discard(chosen.signature)
        if self.shared is not None and chosen.key is not None:
            self.shared.store(chosen.key, plan)

    def forget(self, chosen: IterationPlan) -> None:
        """Drop the plan ``chosen`` replayed: the next iteration is profiled (not cached)."""
        self._plans.pop(chosen.signature, None)
        self._race.pop(chosen.signature, None)
        self._lean.discard(chosen.signature)
        self._reprofile.add(chosen.signature)
        chosen.abandoned = True

    def after_iteration(
        self,
        chosen: IterationPlan,
        trace: Trace | None,
        reserve_bytes: int,
        min_budget_bytes: int = 0,
        wall_s: float = 0.0,
        guard_bytes: int = 0,
        state_to_come_bytes: int = 0,
    ) -> PlanSource:
        """Learn from a finished iteration; returns the source to report for it.

        ``reserve_bytes`` (the largest growth between two hook points) travels with the plan,
        so that a process replaying a cached plan guards the budget from its first step;
        ``min_budget_bytes``, the profiled iteration's stated minimum, too, for lean replays.
        ``wall_s`` is the iteration's wall time, which races candidate plans (NOTE [plan race]);
        ``guard_bytes`` what the guard evicted beyond the plan: a full replay that needed none
        lets the next replays go lean (NOTE [lean replay]); ``state_to_come_bytes`` the state
        its update makes, held by later iterations (NOTE [state to come]).
        """
        if chosen.key is not None:
            self._keys[chosen.signature] = chosen.key
        if chosen.following and self.shared is not None:
            self.shared.replayed(chosen, guard_bytes)  # NOTE [provisional plan]
            return PlanSource.FALLBACK if chosen.abandoned else chosen.source
        if chosen.abandoned:
            return PlanSource.FALLBACK
        if chosen.racing:
            return self._race_step(chosen, wall_s, guard_bytes)
        if chosen.executor is not None and not chosen.executor.active:
            self._plans.pop(chosen.signature, None)  # replan from the next iteration's trace
            self._lean.discard(chosen.signature)
            return PlanSource.FALLBACK
        if chosen.executor is not None and not chosen.lean:
            if guard_bytes == 0:
                if chosen.signature not in self._lean:  # noted once, not at every full replay
                    self._note_lean(chosen, chosen.executor.plan)
                self._lean.add(chosen.signature)
            else:
                self._lean.discard(chosen.signature)
                self._plan_with_margin(chosen, chosen.executor.plan, guard_bytes)
        if trace is not None and trace.incomplete:
            # Not a steady-state iteration (it created optimizer state): profile the next one.
            return chosen.source
        if chosen.source is PlanSource.PROFILED and trace is not None:
            trace = trace.holding(state_to_come_bytes)  # NOTE [state to come]
            begin = time.perf_counter()
            plan = self._choose(chosen, trace, reserve_bytes, min_budget_bytes)
            chosen.planning_s = time.perf_counter() - begin
            if chosen.signature in {*self._trial, *self._race, *self.encoding.unencoded}:
                self._publish(chosen)
                return chosen.source  # the next iterations try the recomputation, or encoding
            self._store(chosen, plan)
        return chosen.source

    def _race_step(self, chosen: IterationPlan, wall_s: float, guard_bytes: int) -> PlanSource:
        """Time one candidate's replay; store the winner when every candidate has run."""
        race = self._race.get(chosen.signature)
        if race is None:
            return PlanSource.RACED
        if chosen.executor is not None and not chosen.executor.active:
            del self._race[chosen.signature]  # the run diverged: profile it again
            return PlanSource.FALLBACK
        remade = None
        if guard_bytes > 0 and not chosen.lean:  # race it as it would be kept (NOTE [plan race])
            candidates = self._candidates.get(chosen.signature, [])
            remade = remake(candidates, race.current(), self._plan, guard_bytes)
        winner = race.record(wall_s, guard_bytes, chosen.lean, remade)
        if winner is None:
            self._publish(chosen)
        else:
            del self._race[chosen.signature]
            logger.info("%s", race.summary(winner))
            self._store(chosen, winner)
            if race.winner_clean():  # its replays go on lean (NOTE [plan race])
                self._lean.add(chosen.signature)
        return PlanSource.RACED

    def _choose(
        self, chosen: IterationPlan, trace: Trace, reserve_bytes: int, min_budget_bytes: int
    ) -> Plan | None:
        """The plan of a profiled trace; with recomputation, first a trial (NOTE [hybrid plan])."""
        signature = chosen.signature
        plan = self._plan(trace, reserve_bytes, min_budget_bytes)
        if plan is not None:
            plan = dataclasses.replace(plan, predicted_step_s=predicted_step_s(trace, plan))
        profile = (trace, reserve_bytes, min_budget_bytes)
        if self.encoding.defer(chosen, plan, profile):  # NOTE [encoding decided]
            return None
        unencoded = self.encoding.take(signature)
        others = [p for p, _ in unencoded]
        trials = self._trial.get(signature)
        if trials is not None:
            hybrid = trials.profiled(plan, predicted_step_s(trace, plan))
            if hybrid is not None:
                self._candidates.setdefault(signature, []).append((hybrid, profile))
            if trials.pending:
                return None  # the next iteration profiles the next candidate
            del self._trial[signature]
            return self._race_or_only(signature, trials)
        self._candidates[signature] = [] if plan is None else [(plan, profile)]
        self._candidates[signature] += unencoded
        if trace.units:
            # Judged at the budget: the model holds what a trial's recomputations hold (NOTE
            # [recomputation's working set] in activations/recorder.py).
            candidates = recompute_candidates(trace, self.budget_bytes)
            if candidates:
                self._trial[signature] = trials_of(trace, candidates, others, plan)
                return plan
        return self._race_or_only(signature, Trials([], others, plan)) if others else plan

    def _publish(self, chosen: IterationPlan) -> None:
        """Publish the best plan known for ``chosen``'s signature (NOTE [provisional plan])."""
        if self.shared is not None and chosen.key is not None:
            candidates = self._candidates.get(chosen.signature, [])
            trials = self._trial.get(chosen.signature)
            unit_s = trials.unit_s if trials is not None else {}
            race = self._race.get(chosen.signature)
            self.shared.publish(chosen.key, race, candidates, unit_s)

    def _race_or_only(self, signature: str, trials: Trials) -> Plan | None:
        """Race the candidates of ``trials`` (NOTE [plan race]); the only one if one, or None."""
        if len(candidates := trials.candidates()) < 2:
            return candidates[0] if candidates else None
        self._race[signature] = PlanRace(candidates, unit_s=trials.unit_s)
        return None
