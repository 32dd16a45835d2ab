"""Where an iteration's plan comes from: one decision per input signature, or the plan cache.

NOTE [one decision]
A signature's plan is decided once, in at most three iterations, from one calibrated model:

1. PROFILE: run the reactive policy and record. Its transfers calibrate the bandwidths; the
   option of least predicted step wins (swap only, or a recomputation).
2. REPROFILE, only if the choice recomputes or newly encodes: plan from what that really holds.
3. VALIDATE: replay in full. If the guard moved bytes or the step missed its prediction, correct
   the per-byte cost and plan once more; the least predicted stands.

The plan cache holds each plan from its first replay and marks those proven to replay lean. A
replay that leaves its plan is profiled again.
"""

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from os import PathLike

import torch
from torch import nn

from vtensor.activations.model_state import ModelScan
from vtensor.activations.plan.guarded import plan_within_guard
from vtensor.activations.plan.iteration_plan import NO_RECOMPUTATION, IterationPlan, Recomputation
from vtensor.activations.plan.keys import PlanKeys, planner_version
from vtensor.activations.replay.executor import PlanExecutor
from vtensor.activations.report import PlanSource
from vtensor.activations.store.chunk_store import ChunkStore
from vtensor.errors import VTensorError
from vtensor.planner.cache import PlanCache
from vtensor.planner.costs import Costs, Transfers, misses, recompute_s
from vtensor.planner.keys import PlanKey
from vtensor.planner.plan import Plan
from vtensor.planner.recompute import recompute_candidates
from vtensor.planner.recomputed import with_recompute
from vtensor.planner.trace import Trace

logger = logging.getLogger(__name__)

Profile = tuple[Trace, int, int]  # a profiled trace, its guard's reserve, its stated minimum


class Stage(StrEnum):
    """Where a signature's decision stands (NOTE [one decision])."""

    PROFILE = "profile"
    REPROFILE = "reprofile"
    VALIDATE = "validate"
    DECIDED = "decided"


@dataclass(frozen=True)
class Decision:
    """One signature's decision so far; each stage makes a new one.

    Attributes:
        plan: the plan to replay (None: none fits; the reactive policy runs).
        profiles: what the plan may be made again from: the first, then the reprofile's.
        choice, encode: what the reprofile recomputes, and whether its clamps encode.
        lean: a full replay of ``plan`` needed no guard (NOTE [lean replay]).
        maskable: the model has clamps to encode (NOTE [mask encoding]).
    """

    stage: Stage
    plan: Plan | None = None
    profiles: tuple[Profile, ...] = ()
    choice: Recomputation = NO_RECOMPUTATION
    encode: bool = False
    predicted_s: float = 0.0
    lean: bool = False
    cached: bool = False
    maskable: bool = False


class PlanBook:
    """Decides a plan per input signature (NOTE [one decision]) and keeps it in the cache.

    ``planned``: False runs the reactive policy only; the other settings are the manager's.
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
        self.cache = PlanCache(cache_dir) if cache_dir is not None else None
        self.planned = planned
        self._keys_of = PlanKeys(
            budget_bytes, chunk_bytes, planner_version(count_workspaces, recompute, encode_masks)
        )
        self.encode_masks = encode_masks
        self.count_workspaces = count_workspaces
        self.recompute = recompute
        self.costs = Costs()
        self._decisions: dict[str, Decision] = {}
        self.planning_s = 0.0  # the last decision step's time

    # -- the coming iteration -----------------------------------------------------------------
    def for_iteration(
        self,
        model: nn.Module,
        scan: ModelScan,
        inputs: Sequence[torch.Tensor],
        device: torch.device,
        store: ChunkStore,
        params: str = "",
    ) -> IterationPlan:
        """What the coming iteration runs with (``params``: a joint plan's signature)."""
        if not self.planned:
            return IterationPlan("", PlanSource.REACTIVE, encode=bool(self.encode_masks))
        key = self._keys_of.of(model, scan, inputs, device, params)
        signature = key.digest()
        decision = self._decisions.get(signature)
        load_s = 0.0
        if decision is None and self.cache is not None:
            plan = self.cache.get(key)
            load_s = self.cache.last_load_s
            if plan is not None:
                lean = self.cache.replays_lean(key, plan)
                decision = Decision(Stage.DECIDED, plan, lean=lean, cached=True)
                self._decisions[signature] = decision
        if decision is None:
            decision = Decision(Stage.PROFILE, maskable=bool(scan.maskable))
            self._decisions[signature] = decision
        if decision.stage is Stage.PROFILE:
            return IterationPlan(
                signature,
                PlanSource.PROFILED,
                record_trace=True,
                key=key,
                find_units=self.recompute and not params,
                encode=self.encode_masks is True,
            )
        if decision.stage is Stage.REPROFILE:
            return IterationPlan(
                signature,
                PlanSource.PROFILED,
                record_trace=True,
                key=key,
                recomputation=decision.choice,
                encode=decision.encode,
            )
        plan = decision.plan
        if plan is None:
            return IterationPlan(signature, PlanSource.REACTIVE, key=key)
        return IterationPlan(
            signature,
            PlanSource.CACHED if decision.cached else PlanSource.PLANNED,
            PlanExecutor(plan, store, wait_early_evictions=self.count_workspaces),
            key=key,
            encode=plan.encoded,
            lean=decision.lean,
            cache_load_s=load_s,
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
        decision = self._decisions.get(key.digest())
        return decision.plan if decision is not None else None

    # -- after it -----------------------------------------------------------------------------
    def excuse(self, chosen: IterationPlan, was_lean: bool) -> bool:
        """An iteration broke the budget: whether it is excused (else the budget is infeasible).

        A lean replay's plan is profiled again; a recomputation that broke it is dropped.
        """
        decision = self._decisions.get(chosen.signature)
        if decision is None:
            return False
        if was_lean:
            self._decisions[chosen.signature] = Decision(Stage.PROFILE, maskable=decision.maskable)
            return True
        if chosen.recompute.names and decision.profiles:
            logger.warning("recomputing %s broke the budget: dropped", chosen.recompute.names)
            first = decision.profiles[0]
            plan = self._plan(first)
            self._decisions[chosen.signature] = Decision(
                Stage.VALIDATE, plan, profiles=(first,), predicted_s=self._predict(first, plan)
            )
            return True
        return False

    def after_iteration(
        self,
        chosen: IterationPlan,
        trace: Trace | None,
        *,
        reserve_bytes: int,
        min_budget_bytes: int,
        wall_s: float,
        guard_bytes: int,
        state_to_come_bytes: int,
        moved: Transfers,
        excused: bool = False,
    ) -> PlanSource:
        """Take the decision's next stage from a finished iteration; its source to report.

        ``guard_bytes``: evicted beyond the plan; ``state_to_come_bytes``: NOTE [state to come].
        """
        decision = self._decisions.get(chosen.signature)
        if excused:
            return PlanSource.FALLBACK
        if decision is None:  # reactive
            return chosen.source
        if chosen.executor is not None and not chosen.executor.active:
            again = Decision(Stage.PROFILE, maskable=decision.maskable)  # diverged: again
            self._decisions[chosen.signature] = again
            return PlanSource.FALLBACK
        if trace is not None and trace.incomplete:
            return chosen.source  # it created optimizer state: profile the next one
        begin = time.perf_counter()
        profile = None
        if trace is not None:
            profile = (trace.holding(state_to_come_bytes), reserve_bytes, min_budget_bytes)
        stage, before = decision.stage, decision.plan
        if stage is Stage.PROFILE and profile is not None:
            self.costs = self.costs.calibrated(moved)
            decision = self._solved(profile, decision.maskable)
        elif stage is Stage.REPROFILE and profile is not None:
            decision = self._reprofiled(decision, profile, chosen.recompute)
        elif stage is Stage.VALIDATE and chosen.executor is not None:
            decision = self._validated(decision, chosen.executor.plan, wall_s, guard_bytes)
        elif stage is Stage.DECIDED and chosen.executor is not None and not chosen.lean:
            decision = self._proven(chosen, decision, guard_bytes)
        if decision.stage is not Stage.REPROFILE and decision.plan is not before:
            self._store(chosen.key, decision)
        elif decision.lean and stage is Stage.VALIDATE:
            self._mark_lean(chosen.key, decision)
        self._decisions[chosen.signature] = decision
        self.planning_s = time.perf_counter() - begin
        return chosen.source

    # -- the stages ---------------------------------------------------------------------------
    def _solved(self, profile: Profile, maskable: bool) -> Decision:
        """The profiled iteration's decision: the option predicted fastest (``solve``)."""
        trace = profile[0]
        plan = self._plan(profile)
        choice = self._solve(profile, plan)
        encode = trace.encoded or (
            self.encode_masks == "auto" and maskable and (plan is None or bool(plan.moves))
        )
        if choice.names or encode != trace.encoded:
            names = ", ".join(choice.names) or "nothing"
            logger.info("profiling again: recomputing %s, clamps encoded: %s", names, encode)
            return Decision(Stage.REPROFILE, plan, (profile,), choice, encode)
        return Decision(Stage.VALIDATE, plan, (profile,), predicted_s=self._predict(profile, plan))

    def _solve(self, profile: Profile, plan: Plan | None) -> Recomputation:
        """The recomputation of least predicted step (NOTE [calibrated model]); none is one."""
        trace = profile[0]
        if not trace.units:
            return NO_RECOMPUTATION
        best, best_s = NO_RECOMPUTATION, self._predict(profile, plan)
        for names in recompute_candidates(trace, self.budget_bytes):
            modelled = with_recompute(trace, names)
            option = self._plan((modelled, profile[1], profile[2]))
            if option is None:
                continue
            seconds = self.costs.step_s(modelled, option) + recompute_s(trace, names)
            logger.info("recomputing %s: predicted %.4f s a step", ", ".join(names), seconds)
            if seconds < best_s:
                best, best_s = Recomputation.of(trace, names), seconds
        return best

    def _reprofiled(self, decision: Decision, profile: Profile, done: Recomputation) -> Decision:
        """The plan of the reprofile, with what it recomputed."""
        plan = self._plan(profile, done)
        profiles = (*decision.profiles, profile)
        return Decision(Stage.VALIDATE, plan, profiles, predicted_s=self._predict(profile, plan))

    def _validated(
        self, decision: Decision, plan: Plan, wall_s: float, guard_bytes: int
    ) -> Decision:
        """The decision after its validating replay took ``wall_s`` (NOTE [one decision])."""
        if guard_bytes == 0 and not misses(decision.predicted_s, wall_s):
            return dataclasses.replace(decision, stage=Stage.DECIDED, lean=True)
        profile = decision.profiles[-1]
        self.costs = self.costs.corrected(plan, profile[0], wall_s)
        logger.info(
            "validating replay: %.4f s against %.4f s predicted, %d bytes moved by the guard: "
            "planned once more",
            wall_s,
            decision.predicted_s,
            guard_bytes,
        )
        options = [(p, self._plan(p, _done(plan, p), guard_bytes)) for p in decision.profiles]
        if guard_bytes == 0:
            options.append((profile, plan))  # what ran clean stands unless a plan is faster
        timed = [(self._predict(p, o), i, o) for i, (p, o) in enumerate(options) if o is not None]
        if not timed:
            return Decision(Stage.DECIDED, None)
        seconds, _, best = min(timed, key=lambda t: (t[0], -t[1]))
        lean = best is plan  # it ran clean: its replays go lean
        return Decision(Stage.DECIDED, best, decision.profiles, predicted_s=seconds, lean=lean)

    def _proven(self, chosen: IterationPlan, decision: Decision, guard_bytes: int) -> Decision:
        """A full replay of a decided plan that needed no guard: the plan replays lean."""
        if guard_bytes or decision.lean:
            return decision
        decision = dataclasses.replace(decision, lean=True)
        self._mark_lean(chosen.key, decision)
        return decision

    # -- plans --------------------------------------------------------------------------------
    def _plan(
        self, profile: Profile, done: Recomputation = NO_RECOMPUTATION, margin_bytes: int = 0
    ) -> Plan | None:
        """The plan of ``profile`` that leaves the guard its headroom; None if there is none."""
        trace, reserve_bytes, min_bytes = profile
        plan = plan_within_guard(
            trace,
            self.budget_bytes,
            self.chunk_bytes,
            reserve_bytes,
            min_bytes,
            margin_bytes,
            costs=self.costs,
        )
        if plan is None:
            return None
        return dataclasses.replace(
            plan,
            recompute=done.names,
            predicted_step_s=self.costs.step_s(trace, plan),
        )

    def _predict(self, profile: Profile, plan: Plan | None) -> float:
        return float("inf") if plan is None else self.costs.step_s(profile[0], plan)

    def _store(self, key: PlanKey | None, decision: Decision) -> None:
        if self.cache is None or key is None or decision.plan is None:
            return
        try:
            self.cache.put(key, decision.plan)
        except VTensorError as err:
            logger.warning("plan not cached: %s", err)
            return
        if decision.lean:
            self._mark_lean(key, decision)

    def _mark_lean(self, key: PlanKey | None, decision: Decision) -> None:
        if self.cache is not None and key is not None and decision.plan is not None:
            self.cache.mark_lean(key, decision.plan)  # the next managers start lean


def _done(plan: Plan, profile: Profile) -> Recomputation:
    """What ``profile`` recomputed: ``plan``'s recomputation if it was profiled with it."""
    if tuple(profile[0].recomputed) == plan.recompute:
        return Recomputation(plan.recompute)
    return NO_RECOMPUTATION
