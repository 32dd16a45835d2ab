"""The smallest budget an iteration could have run at, judged at each hook point."""

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from vtensor.activations.runtime.param_side import ResidentParams
from vtensor.activations.runtime.policy import ReactivePolicy
from vtensor.activations.runtime.recorder import IterationBooks
from vtensor.activations.store.chunk_store import ChunkStore, VTensor
from vtensor.errors import FloorBreakdown, VTensorError
from vtensor.offload.joint import (
    AUTO_OFFLOAD_SHARE,
    ParamOffload,
    offloaded_min_bytes,
    state_bytes,
)
from vtensor.planner.reserves import MIN_BUDGET_MARGIN_BYTES

# NOTE [unseen growth]
# Without a plan the policy makes room only ahead of growth it has seen: it starts evicting at
# the budget less twice its reserve (the largest growth seen) and the largest workspace. A
# growth beyond that arrives on whatever is resident: evicting down to that mark first would
# still leave too little room, so a first iteration meets the budget there only where the budget
# holds every byte of that point resident, the evicted ones included. That is the floor there,
# whatever could have been evicted: the smallest budget of a first iteration, not of a plan.


class BudgetFloor:
    """Keeps ``books.min_budget_bytes`` (NOTE [minimum budget]) and whether the budget broke."""

    def __init__(
        self,
        store: ChunkStore,
        books: IterationBooks,
        budget_bytes: int,
        params: ResidentParams | None = None,
    ) -> None:
        self.store = store
        self.books = books
        self.budget_bytes = budget_bytes
        self.params = params  # an offloaded parameter side sharing the budget
        self._prev_evictable = 0
        # NOTE [offload probe] in activations/offloads.py: the floor were the side in memory.
        self.unoffloaded_min_bytes = 0
        self.unoffloaded_step = ""

    def note_broken(self, live: int, step_name: str) -> None:
        """The budget broke before the policy could act: ``live`` bytes were needed."""
        if live > self.books.min_budget_bytes:
            self.books.min_budget_bytes = live + MIN_BUDGET_MARGIN_BYTES
            self.books.min_budget_step = step_name
        if self.params is not None:
            kept = live - self.params.resident_bytes() + self.params.unoffloaded_bytes()
            self._note_unoffloaded(kept + MIN_BUDGET_MARGIN_BYTES, step_name)

    def note_growth(
        self, live: int, growth_bytes: int, policy: ReactivePolicy, step_name: str
    ) -> None:
        """``growth_bytes`` arrived since the last point, ``live`` now (NOTE [unseen growth])."""
        ahead = 2 * policy.reserve_bytes + policy.transient_bytes
        if not policy.early_eviction or growth_bytes <= ahead:
            return  # a plan makes room, or the policy made room ahead of it
        away = sum(r.nbytes for r in self.store.records.values()) - self.store.device_bytes()
        floor = live + max(0, away) + MIN_BUDGET_MARGIN_BYTES
        if floor > self.books.min_budget_bytes:
            self.books.min_budget_bytes = floor
            self.books.min_budget_step = step_name
            self.books.min_budget_kept_bytes = sum(r.nbytes for r in self.store.records.values())
        if self.params is not None:
            resident = self.params.resident_bytes()
            self._note_unoffloaded(floor - resident + self.params.unoffloaded_bytes(), step_name)

    def _note_unoffloaded(self, floor: int, step_name: str) -> None:
        if floor > self.unoffloaded_min_bytes:
            self.unoffloaded_min_bytes = floor
            self.unoffloaded_step = step_name

    def note(
        self,
        need: int,
        pinned: VTensor | None,
        step_name: str,
        step_index: int,
        *,
        strict: bool = True,
    ) -> None:
        """Judge a hook point needing ``need`` bytes; ``strict``: above the budget breaks it."""
        evictable_now = 0
        for record in self.store.records.values():
            if record is pinned:
                continue
            nbytes = self.store.evictable_bytes(record)
            pending = record.pending
            if pending is not None and pending.outgoing:
                # Still resident while its write runs.
                nbytes = sum(c.nbytes for c in pending.chunks)
            evictable_now += nbytes
            # Evicted or being evicted: it was evictable when chosen.
            if record.vid not in self.books.evictable_step and (
                nbytes or pending is not None or record.offloaded_chunks()
            ):
                self.books.evictable_step[record.vid] = step_index
        # Only what was evictable at the previous point could have made room for this op.
        activations = evictable_now
        evictable = min(evictable_now, self._prev_evictable)
        self._prev_evictable = evictable_now
        if self.params is not None:
            # The same point with the whole parameter side in memory (NOTE [offload probe]).
            kept = need - self.params.resident_bytes() + self.params.unoffloaded_bytes()
            kept -= evictable
            self._note_unoffloaded(kept + MIN_BUDGET_MARGIN_BYTES + kept // 100, step_name)
            # Read ahead, not in use: at a lower budget, not read yet.
            evictable += self.params.resident_bytes() - self.params.pinned_bytes()
        # NOTE [minimum budget]: the floor is what could not be evicted at this point, plus a
        # margin for the heap counter's noise and run-to-run residency, so that retrying at the
        # stated minimum works.
        floor = need - evictable + MIN_BUDGET_MARGIN_BYTES + need // 100
        if floor > self.books.min_budget_bytes:
            self.books.min_budget_bytes = floor
            self.books.min_budget_step = step_name
            self.books.min_budget_kept_bytes = max(0, self.store.device_bytes() - activations)
            if self.params is not None:
                self.books.min_budget_param_bytes = self.params.pinned_bytes()
        if strict and need > self.budget_bytes:
            self.books.violated = True


def floor_breakdown(
    books: IterationBooks,
    min_budget_bytes: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    inputs: Sequence[torch.Tensor],
    pending_state_bytes: int,
    *,
    offloaded: bool,
) -> FloorBreakdown:
    """What holds ``min_budget_bytes``, the iteration's stated minimum (NOTE [minimum budget]).

    Unless ``offloaded``: parameters and buffers, gradients (all trainable ones where the floor
    lies in or after backward), optimizer state including what its first step creates. The
    working set is the rest beyond inputs and saved bytes that could not leave. Also estimated:
    the floor with the parameter side offloaded (less the state, plus twice the offloading's
    least holding).
    """
    params = grads = state = held = 0
    if offloaded:
        held = books.min_budget_param_bytes
    else:
        params = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
        late = not books.min_budget_step.startswith(("forward:", "other:start"))
        grads = sum(
            p.nbytes for p in model.parameters() if p.requires_grad and (late or p.grad is not None)
        )
        state = state_bytes(
            list(model.parameters()), list(model.buffers()), optimizer, pending_state_bytes
        )
        state -= params
        state -= sum(p.nbytes for p in model.parameters() if p.requires_grad)
    given = sum(t.nbytes for t in inputs)
    kept = books.min_budget_kept_bytes
    working = max(0, min_budget_bytes - params - grads - state - given - kept - held)
    breakdown = FloorBreakdown(params, grads, state, given, working, kept, offloaded_held=held)
    if optimizer is None or offloaded:
        return breakdown
    try:
        side = offloaded_min_bytes(model, optimizer)
    except VTensorError:
        return breakdown  # not offloadable (parameters off the CPU, a foreign optimizer)
    # The unit its backward updates, and the next one's read ahead.
    estimate = min_budget_bytes - breakdown.state + 2 * side
    return dataclasses.replace(breakdown, offloaded_floor_bytes=estimate)


def offloading_floor(
    floor: BudgetFloor,
    offload: ParamOffload,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: Sequence[torch.Tensor],
    state_to_come_bytes: int,
    *,
    probed: bool,
    always: bool,
) -> tuple[int, str, FloorBreakdown]:
    """The minimum an iteration with an offloading the manager made states, its step and parts.

    NOTE [offload probe] in ``activations/offloads.py``. ``state_to_come_bytes``: what the
    optimizer's first step creates (offloaded, each unit's update makes it in backward, where
    the floor counts it). ``probed``: the offloading was made at its own least budget to
    measure; ``always``: ``offload_params=True``, which offloads at any budget, where
    ``"auto"`` offloads only past ``AUTO_OFFLOAD_SHARE`` of the budget.
    """
    books = floor.books
    need = books.min_budget_bytes
    if probed:
        # Everything evictable was evicted at every point: its peak is what it needs, and a
        # budget that lets activations stay until a unit's backward begins must hold that
        # backward's own allocations then: its weight's gradient and its input's, each at most
        # the largest parameter (the probe's pool held no more than a unit).
        peak = books.peak_bytes
        need = max(need, offload.budget_bytes, peak + MIN_BUDGET_MARGIN_BYTES + peak // 100)
        need += 2 * offload.pool.largest_bytes()
    side = state_bytes(
        list(model.parameters()), list(model.buffers()), optimizer, 0
    )  # the state its updates made included
    needed = side > AUTO_OFFLOAD_SHARE * need  # offloaded at that budget under "auto" too
    if always or needed:
        parts = floor_breakdown(books, need, model, None, inputs, 0, offloaded=True)
        return need, books.min_budget_step, dataclasses.replace(parts, offload_needed=needed)
    # At that budget "auto" keeps the side in memory: the minimum is the iteration's with it
    # there, and offloading it (measured) is the way below.
    kept = max(need, floor.unoffloaded_min_bytes + state_to_come_bytes)
    step = floor.unoffloaded_step or books.min_budget_step
    at = dataclasses.replace(books, min_budget_step=step)
    parts = floor_breakdown(at, kept, model, optimizer, inputs, 0, offloaded=False)
    return kept, step, dataclasses.replace(parts, offloaded_floor_bytes=need)
