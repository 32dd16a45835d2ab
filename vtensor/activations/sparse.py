"""Replays that move activations with module hooks only at the steps their plan acts at.

NOTE [sparse replay]
A lean replay of a plan that moves activations (NOTE [lean replay] in ``activations/lean.py``)
crossed every module boundary of the model: torch's global module hooks called the iteration at
each forward call and marked the autograd node of each module output, so that each step was
counted, checked against the plan's step names, and given its waits, its moves and its reading;
and it read the heap counter at every step the plan watches (29 a step on the main job's CNN at
the micro class's budget, 39 on MobileNetV2 at half its peak, 0.1-1.3 ms each). A sparse replay
hooks only the modules of the steps the plan acts at (``acting_steps``): the steps that issue an
eviction (and the step before, which starts its write early) or a restore; the watched steps the
plan predicts fullest, the only ones it reads at, as a quiet replay does; and every step whose
headroom the writes that may be in flight there exceed, where a wait may be due (NOTE [lean
waits]). A wait at an acting step keeps in flight what fits every step up to the next acting
one, where no write is issued. Each hooked module counts its calls, forward and backward apart:
the plan's ``k``-th step of that name is the ``k``-th call, and its index is taken from the plan
instead of counted (``SparseBoundaries``). The backward boundary of a call is a pre-hook on the
autograd node of its first tensor output, once per call. Against every hook, swapping alone took
3.8 ms a step less on the main job's CNN at the micro class's budget and 2.4 ms at the small
one's, and the hybrid on MobileNetV2 at half its peak 1.04-1.10x the unmanaged step against
1.14-1.15x (benchmarks/README.md, ``cover_mixes`` and "Sparse replays").

What the full hooks did besides is the matching of step names, which notices a run that leaves
the plan. The plan key fixes the architecture and the input signature, so only data-dependent
control flow could, and the saved tensors are still matched with the plan by position and size
(NOTE [passed]); a step index that does not follow the last one leaves the plan too, and so does
a run that saved fewer tensors than its plan by the end of backward. A sparse replay's counting
is proven first: the replays that check every saved tensor and step (every ``QUIET_RUN + 1``-th
lean replay, NOTE [quiet replay] in ``activations/quiet.py``) run the sparse hooks beside the full
ones and compare each index the counting gives with the step the full hooks opened; a plan
replays sparsely only after a check in which every acting step was reached and every index
matched (``QuietTurns.prove``), and never once a check disagreed (a module that returns an inner
module's output as it is, whose node carries the inner module's boundary; a module called twice
in one step). Readings and the guard act as in any lean replay, at the acting steps; a run that
leaves the plan leaves the lean replay, and with no module hooks outside the acting steps, its
guard acts at saved tensors and the acting steps only.
"""

from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from torch import nn

from vtensor.activations.executor import PlanExecutor
from vtensor.activations.model_state import ModelScan
from vtensor.activations.rebuild import REBUILT_KEY
from vtensor.outputs import tensors_in
from vtensor.planner.plan import Plan

AFTER_BACKWARD = "other:after-backward"
T = TypeVar("T")


def replays_sparsely(executor: PlanExecutor) -> bool:
    """Whether a lean replay of ``executor``'s plan can hook its acting steps only.

    A plan that moves activations whose acting steps are all module boundaries (or the end of
    backward, reached from the first backward step). Kept by the plan's digest.
    """
    plan = executor.plan
    return _kept(_HOOKABLE, plan, _hookable)


def _hookable(plan: Plan) -> bool:
    if not any(m.vid < plan.activation_count for m in plan.moves):
        return False
    names = plan.step_names
    for index in acting_steps(plan):
        phase, _, name = names[index].partition(":")
        if index and names[index] != AFTER_BACKWARD and (phase not in _PHASES or not name):
            return False
    return True


_PHASES = ("forward", "backward")


def acting_steps(plan: Plan) -> dict[int, int]:
    """The steps at which a replay of ``plan`` acts, each with its room (NOTE [sparse replay]).

    The first step; each move's eviction step, the step before it (which starts its write
    early) and its restore's step; the fullest watched steps (``fullest_steps``); every step
    whose headroom is below the bytes whose writes may be in flight there, from the step before
    an eviction's to its restore's. Where the end of backward is one, so is the first backward
    step, which marks it. A step's room is the least headroom of the steps from it to the next
    acting one: the writes its wait leaves in flight (NOTE [lean waits]). Kept by the plan's
    digest: a plan is replayed many times.
    """
    return _kept(_ACTING, plan, _acting_steps)


_ACTING: dict[str, dict[int, int]] = {}
_HOOKABLE: dict[str, bool] = {}
_OCCURRENCES: dict[str, dict[str, list[int]]] = {}
_KEPT = 64  # plans a cache keeps


def _kept(cache: dict[str, T], plan: Plan, make: Callable[[Plan], T]) -> T:
    """``make(plan)``, kept in ``cache`` by the plan's digest (of up to ``_KEPT`` plans)."""
    key = plan.digest()
    found = cache.get(key)
    if found is None:
        if len(cache) >= _KEPT:
            cache.clear()
        found = cache[key] = make(plan)
    return found


def _occurrences(plan: Plan) -> dict[str, list[int]]:
    """Each step name of ``plan`` with its indices, in order."""
    found: dict[str, list[int]] = {}
    for index, step in enumerate(plan.step_names):
        found.setdefault(step, []).append(index)
    return found


def fullest_steps(plan: Plan) -> tuple[int, ...]:
    """Of the steps ``plan`` watches, those it predicts fullest (least headroom): its peak."""
    headroom, steps = plan.step_headroom_bytes, plan.watched_steps
    if len(headroom) == len(plan.step_names) and steps:
        least = min(headroom[i] for i in steps)
        steps = tuple(i for i in steps if headroom[i] == least)
    return steps


def _acting_steps(plan: Plan) -> dict[int, int]:
    names, headroom = plan.step_names, plan.step_headroom_bytes
    steps = {0, *fullest_steps(plan)}
    moves = [m for m in plan.moves if m.vid < plan.activation_count]
    change = [0] * (len(names) + 1)  # of the bytes whose writes may be in flight
    for move in moves:
        steps.update((move.evict_step - 1, move.evict_step, move.prefetch_step))
        # From the step before its eviction's (started early) to its restore's, which waits.
        change[max(move.evict_step - 1, 0)] += move.evict_bytes
        change[min(move.prefetch_step, len(names))] -= move.evict_bytes
    writing = 0
    for index in range(len(names)):
        writing += change[index]
        if writing > (headroom[index] if index < len(headroom) else 0):
            steps.add(index)  # a wait may be due here
    if AFTER_BACKWARD in names and names.index(AFTER_BACKWARD) in steps:
        first = next((i for i, n in enumerate(names) if n.startswith("backward:")), None)
        steps.add(-1 if first is None else first)
    acting = sorted(s for s in steps if 0 <= s < len(names))
    ends = [*acting[1:], len(names)]
    if len(headroom) != len(names):
        return dict.fromkeys(acting, 0)  # no headroom known: wait for every write
    return {step: min(headroom[step:end]) for step, end in zip(acting, ends, strict=True)}


class Stepper(Protocol):
    """What the sparse hooks report to: the iteration."""

    recomputing: int
    step_index: int

    def begin_step(self, name: str, index: int | None = None) -> None:
        """Step ``index`` named ``name`` begins."""

    def leave_plan(self, why: str) -> None:
        """The run left the plan: the replay stops following it."""


class SparseBoundaries:
    """The module hooks of a sparse replay, or of its check beside the full hooks (``verify``).

    Also the ``Boundaries`` of a rebuilt graph (NOTE [one-node recomputation]): a rebuilt
    unit's modules mark their outputs as their first forward did.
    """

    def __init__(
        self,
        model: nn.Module,
        scan: ModelScan,
        plan: Plan,
        iteration: Stepper,
        acting: Mapping[int, int],
        *,
        verify: bool = False,
    ) -> None:
        self._iteration = iteration
        self._acting = frozenset(acting)
        self.rooms = acting  # NOTE [lean waits]: each acting step's room
        self.watched = frozenset(fullest_steps(plan))  # where it reads the tracked bytes
        self._verify = verify
        self.rebuilding = 0
        self._occurrences = _kept(_OCCURRENCES, plan, _occurrences)
        wanted = {plan.step_names[i] for i in self._acting}
        self._calls: dict[str, int] = {}  # by step name: the calls so far
        self._backward: dict[int, str] = {}
        self._handles: list[Any] = []
        self._last = 0
        self.hits: set[int] = set()  # the indices reached (``verify``)
        self.mismatch = ""  # the first index the counting gave that the full hooks did not
        # By name, not by walking the model's modules: this runs at every step.
        steps = (step.partition(":") for step in wanted)
        for name in sorted({name for phase, _, name in steps if phase in _PHASES and name}):
            module = scan.module(model, name)
            if module is None:
                continue
            if f"forward:{name}" in wanted:
                self._handles.append(module.register_forward_pre_hook(self._before(name)))
            if f"backward:{name}" in wanted:
                self._backward[id(module)] = f"backward:{name}"
                self._handles.append(module.register_forward_hook(self._after))
        after = self._occurrences.get(AFTER_BACKWARD, [])
        self._after_backward = after[0] if after and after[0] in self._acting else None

    def _before(self, name: str) -> Callable[..., None]:
        step = f"forward:{name}"

        def pre(_module: nn.Module, _args: Any) -> None:
            if not self._iteration.recomputing:  # a recomputation's forward steps are not steps
                self._reach(step)

        return pre

    def _after(self, module: nn.Module, _args: Any, output: Any) -> None:
        if not self._iteration.recomputing or self.rebuilding:
            self.mark(module, output)

    def mark(self, module: nn.Module, output: Any) -> None:
        """Put the backward boundary of ``module``'s call on its first output's node, once."""
        step = self._backward.get(id(module))
        if step is None:
            return
        node: Any = next((t.grad_fn for t in tensors_in(output) if t.grad_fn is not None), None)
        if node is None or REBUILT_KEY in node.metadata:  # a rebuilt graph gets them in backward
            return
        fired: list[bool] = []

        def began(_grads: Any) -> None:
            if not fired:
                fired.append(True)
                self._reach(step)

        node.register_prehook(began)

    def _reach(self, step: str) -> None:
        """Step ``step`` of the run begins: its index in the plan from the calls counted."""
        call = self._calls.get(step, 0)
        self._calls[step] = call + 1
        indices = self._occurrences.get(step, ())
        index = indices[call] if call < len(indices) else -1
        iteration = self._iteration
        if self._verify:
            if index != iteration.step_index and not self.mismatch:
                self.mismatch = f"call {call + 1} of {step} counted as step {index}"
            self.hits.add(index)
            return
        if index <= self._last:
            iteration.leave_plan(f"call {call + 1} of {step} is no step after {self._last}")
            return
        self._last = index
        if index in self._acting:
            self.hits.add(index)
            iteration.begin_step(step, index)

    def after_backward(self) -> None:
        """Backward has ended: its step, where the plan acts there."""
        if self._after_backward is not None and not self._verify:
            self._iteration.begin_step(AFTER_BACKWARD, self._after_backward)

    def proven(self, reached: int) -> bool:
        """Whether the check agreed: every index matched, every acting step up to ``reached``."""
        return not self.mismatch and not self.missed(reached)

    def missed(self, reached: int | None = None) -> list[int]:
        """The acting steps up to ``reached`` (default: all) that the run did not reach."""
        wanted = (i for i in self._acting if i > 0 and i != self._after_backward)
        return sorted(i for i in wanted if (reached is None or i <= reached) and i not in self.hits)

    def remove(self) -> None:
        """Take every hook off."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class BothBoundaries:
    """The full hooks and the sparse ones of a check: a rebuilt graph is marked for both."""

    def __init__(self, full: Any, sparse: SparseBoundaries) -> None:
        self._full, self._sparse = full, sparse

    @property
    def rebuilding(self) -> int:
        """Above 0 while a unit's graph is rebuilt in backward."""
        return int(self._full.rebuilding)

    @rebuilding.setter
    def rebuilding(self, value: int) -> None:
        self._full.rebuilding = self._sparse.rebuilding = value

    def mark(self, module: nn.Module, output: Any) -> None:
        """Give the nodes that made ``output`` the backward boundary of ``module``, in both."""
        self._full.mark(module, output)
        self._sparse.mark(module, output)
