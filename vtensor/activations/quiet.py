"""Lean replays that leave saved tensors alone: hooks only at the steps the plan watches.

NOTE [quiet replay]
A hookless replay (NOTE [hookless replay] in ``activations/lean.py``) of a plan that moves no
activation still runs the manager's saved-tensor hooks on every saved tensor: it matches each
with the plan by position and size, which is what notices a run that leaves the plan, and reads
the tracked bytes at the plan's watched events. Those hooks are Python calls from autograd, two
per saved tensor (193 a 43 ms step on the main job's CNN), and its smallest class's plan
watched 25 events a step. A quiet replay installs no saved-tensor hooks and no global module
hooks. It reads the tracked bytes only at the watched steps the plan predicts fullest (its
predicted peak, ``watched_modules``): through a forward pre-hook on the module of a forward
step, or, for a backward step, a forward hook on its module that puts a pre-hook on the
autograd node of the module's output (where NOTE [hookless replay]'s module hooks would begin
that step), at every call of that module. The other watched steps' readings find bytes no trace
explains early enough for the guard to act (NOTE [confirmed readings] in
``planner/memory_model.py``); a quiet replay has nothing the guard could move. Recomputation and
the encoding are module wrappers and run as in any replay. The main job's rounds went from
1.10-1.11x, 1.24-1.25x and 1.34-1.35x the unmanaged round to 1.06-1.07x, 1.15-1.17x and
1.22-1.23x (medium, small, micro; benchmarks/README.md, ``main_round``).

What it gives up is the matching. The plan key already fixes the architecture and the input
signature, so only data-dependent control flow can make a run leave the plan, and a plan that
moves nothing has nothing to restore wrongly: what a divergence threatens is the budget, which
the reading at the predicted peak still judges. So the first lean replay of a plan, and every
``QUIET_RUN + 1``-th after it, is a hookless replay that matches every saved tensor and reads at
every watched step; the others are quiet. The count is kept by the plan's digest, for the
managers of one process that share a plan cache (a manager without one keeps its own): the main
job opens a manager a round, and each began with a checking replay, about 3 ms a round on its
smallest class (12 steps of 40 ms), though the plan and its last check were the same. A full
replay matches every saved tensor too, so the lean replays that follow one begin a quiet run: in
a race (NOTE [plan race]) each candidate's first lean replay follows its full one, and timed as
a checking replay, a few percent slower than a quiet one, it lost against the leader's
confirming replays, which were quiet. A reading over the budget in a quiet replay leaves the
lean replay as any does, and the plan is profiled again next time, but nothing saved before it
can be evicted in that iteration (no saved tensor went through the manager): the budget of that
one iteration is broken by what the plan did not predict, and reported. A saved tensor modified
in place stops the backward with autograd's own error, as it would without the manager, instead
of ``InPlaceModificationError``.

A plan that moves activations takes the same turns: between two checking replays its lean
replays are sparse (NOTE [sparse replay] in ``activations/sparse.py``), and each checking
replay checks the sparse replay's counting of steps beside its own.
"""

import enum
import os
from collections.abc import Callable
from os import PathLike
from typing import Any, Protocol

from torch import nn

from vtensor.activations.executor import PlanExecutor
from vtensor.activations.lean import replays_hookless
from vtensor.activations.model_state import ModelScan
from vtensor.activations.sparse import fullest_steps, replays_sparsely
from vtensor.activations.windows import SaveWindows
from vtensor.outputs import tensors_in
from vtensor.planner.plan import Plan

QUIET_RUN = 7  # quiet replays between two that match every saved tensor


def watched_modules(plan: Plan) -> list[tuple[str, str]] | None:
    """(phase, module name) of the steps a quiet replay reads at; None if one is no boundary.

    Of the steps ``plan`` watches, those it predicts fullest (least headroom): its predicted
    peak (NOTE [quiet replay]).
    """
    found = []
    for step in fullest_steps(plan):
        phase, _, name = plan.step_names[step].partition(":")
        if phase not in ("forward", "backward") or not name:
            return None
        found.append((phase, name))
    return found


def replays_quietly(executor: PlanExecutor) -> bool:
    """Whether a lean replay of ``executor``'s plan may be quiet (NOTE [quiet replay])."""
    plan = executor.plan
    return (
        replays_hookless(executor)
        and bool(plan.watched_steps)
        and not plan.moves
        and (watched_modules(plan) is not None)
    )


class Turn(enum.Enum):
    """How a replay of a plan runs (NOTE [quiet replay], NOTE [sparse replay])."""

    CHECK = "check"  # every saved tensor and every step matched with the plan
    CHECK_SPARSE = "check-sparse"  # the same, the sparse replay's counting checked beside
    QUIET = "quiet"  # a plan that moves nothing: hooks at its fullest watched steps only
    SPARSE = "sparse"  # a plan that moves activations: hooks at the steps it acts at only


class QuietTurns:
    """Which lean replays of a plan skip the checks: all but every ``QUIET_RUN + 1``-th.

    And which plans' sparse replays were proven by a check (NOTE [sparse replay]).
    """

    def __init__(self) -> None:
        self._since: dict[str, int] = {}  # by plan digest: quiet replays since the last check
        self._proven: dict[str, bool] = {}  # by plan digest: what the checks found
        self._windows: dict[str, SaveWindows | None] = {}  # by plan digest: the last check's

    @classmethod
    def shared(cls, plan_cache_dir: str | PathLike[str] | None) -> "QuietTurns":
        """The count of the managers of this process that share ``plan_cache_dir``.

        A manager without a plan cache gets a count of its own (NOTE [quiet replay]).
        """
        if plan_cache_dir is None:
            return cls()
        return _SHARED.setdefault(os.path.realpath(plan_cache_dir), cls())

    def take(self, executor: PlanExecutor, lean: bool = True) -> Turn:
        """How this iteration's replay of ``executor``'s plan runs.

        A full replay (``lean`` false) checks every saved tensor: the lean replays after it
        begin a quiet run. A plan that moves activations replays sparsely only once a check
        proved its counting, and is checked again at each check.
        """
        key = executor.plan.digest()
        if not lean:
            self._since[key] = 0
            return Turn.CHECK
        sparse = replays_sparsely(executor)
        if not (sparse or replays_quietly(executor)):
            return Turn.CHECK
        proven = self._proven.get(key)
        checks = Turn.CHECK_SPARSE if sparse and proven is not False else Turn.CHECK
        since = self._since.get(key)
        if since is not None and since < QUIET_RUN:
            self._since[key] = since + 1
            if not sparse:
                return Turn.QUIET
            return Turn.SPARSE if proven else checks
        self._since[key] = 0  # this one matches every saved tensor
        return checks

    def prove(
        self, executor: PlanExecutor, agreed: bool, windows: SaveWindows | None = None
    ) -> None:
        """A check of ``executor``'s plan found its sparse counting ``agreed`` with the steps.

        ``windows``: what it found of the saves (NOTE [windowed saves]); None: a sparse
        replay of the plan runs the saved-tensor hooks for the whole step.
        """
        key = executor.plan.digest()
        self._proven[key] = agreed and self._proven.get(key, True)
        self._windows[key] = windows if self._proven[key] else None

    def windows(self, executor: PlanExecutor) -> SaveWindows | None:
        """The windows a sparse replay of ``executor``'s plan pushes its hooks in, if any."""
        return self._windows.get(executor.plan.digest())


_SHARED: dict[str, QuietTurns] = {}  # by plan cache directory (NOTE [quiet replay])


class Reader(Protocol):
    """What the readings go to: the iteration."""

    recomputing: int

    def check_boundary(self, where: str = "") -> None:
        """Read the tracked bytes at a watched step (NOTE [lean replay])."""


class WatchedBoundaries:
    """The quiet replay's readings: hooks on the modules of the plan's watched steps only."""

    def __init__(
        self,
        model: nn.Module,
        scan: ModelScan,
        plan: Plan,
        iteration: Reader,
    ) -> None:
        self._iteration = iteration
        self._handles: list[Any] = []
        for phase, name in watched_modules(plan) or []:
            module = scan.module(model, name)
            if module is None:
                continue  # not this model's (the plan key would have differed)
            step = f"{phase}:{name}"
            if phase == "forward":
                self._handles.append(module.register_forward_pre_hook(self._before(step)))
            else:
                self._handles.append(module.register_forward_hook(self._marks(step)))

    def _before(self, step: str) -> Callable[..., None]:
        def pre(_module: nn.Module, _args: Any) -> None:
            if not self._iteration.recomputing:  # a recomputation's forward steps are not steps
                self._iteration.check_boundary(step)

        return pre

    def _marks(self, step: str) -> Callable[..., None]:
        def post(_module: nn.Module, _args: Any, output: Any) -> None:
            for tensor in tensors_in(output):
                if tensor.grad_fn is not None:
                    tensor.grad_fn.register_prehook(
                        lambda _grads: self._iteration.check_boundary(step)
                    )
                    return  # one read per call, at the first output's node

        return post

    def remove(self) -> None:
        """Take every hook off."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
