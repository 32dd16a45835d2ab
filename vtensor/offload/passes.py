"""The passes of parameter offloading: what each forward, backward and update use pins and reads.

NOTE [parameter offloading] (docs/param-offload.md)
A forward pre-hook brings a unit's parameters in (NOTE [offload units]) and a forward hook lets
them go, noting which autograd saved (their use counts grew) and putting a prehook on the
unit's output nodes that brings those back before its backward. A post-accumulate-grad hook
takes each gradient as it completes: between micro-batches it is added to the accumulated
gradient, which leaves memory; in a step's last backward the parameter is updated at once (NOTE
[per-parameter update]), or, when clipping by global norm, the gradient's norm is kept for the
streamed clip-and-update pass of ``step()``. Reads for the next ``lookahead`` uses
(:class:`~vtensor.offload.policy.Lookahead`) start on the I/O thread as the budget allows.
"""

from collections import Counter
from typing import Any

import torch

from vtensor.offload.hooks import UseGuard, on_backward_start
from vtensor.offload.offloaded import OffloadedTensor
from vtensor.offload.policy import Event, Lookahead, Phase
from vtensor.offload.pool import OffloadPool
from vtensor.offload.records import ParamRecord, grew, use_counts
from vtensor.offload.units import Unit
from vtensor.offload.update import clip_, gradient_norm, total_norm, update_parameter
from vtensor.planner.trace import TensorKind


class OffloadPasses:
    """The hooks' target: routes the model's uses of its parameters to the pool, and reads ahead.

    ``params``: per parameter name, what offloading holds for it; the settings are the
    ``ParamOffload``'s.
    """

    def __init__(
        self,
        pool: OffloadPool,
        optimizer: torch.optim.Optimizer,
        policy: Lookahead,
        units: list[Unit],
        params: dict[str, ParamRecord],
        *,
        accumulation_steps: int,
        max_grad_norm: float | None,
        norm_type: float,
        min_tensor_bytes: int,
    ) -> None:
        self.pool, self.optimizer, self.policy = pool, optimizer, policy
        self.units, self.params = units, params
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm, self.norm_type = max_grad_norm, norm_type
        self.min_tensor_bytes = min_tensor_bytes
        self._running: Counter[str] = Counter()
        self._recording = True  # the first step: the guard checks, the policy learns the order
        self._forward_calls = self._backward_calls = 0
        self.backwards_done = 0
        self.in_backward = False
        self._bwd_pins: dict[str, list[OffloadedTensor]] = {}
        self._expected: dict[str, int] = {}  # gradients announced by a unit's backward
        self._units_begun: set[int] = set()  # units whose backward began in this backward
        self._saved: dict[int, set[str]] = {}  # unit -> parameters autograd saved (last forward)
        self._calls: list[tuple[Unit, dict[str, tuple[int, int]], list[Any]]] = []
        self._guard: UseGuard | None = None
        # Inside a MemoryManager step that shares the budget: its plan reads, not the lookahead.
        self.joint = False

    def close_guard(self) -> None:
        """End a first forward's use guard if one is open."""
        if self._guard is not None:
            self._guard.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            self._guard = None

    # -- forward ------------------------------------------------------------------------------
    def begin_forward(self) -> None:  # noqa: D102
        self._forward_calls = 0
        if not self.joint:
            # A forward outside the manager's steps (evaluation): a joint plan's hold ends.
            self.pool.listener = None
        if self._recording and self._guard is None:
            self._guard = UseGuard(self.params.values(), self.units, self._running)
            self._guard.__enter__()  # type: ignore[no-untyped-call]

    def end_forward(self) -> None:  # noqa: D102
        self.close_guard()
        while self._calls:  # a forward that raised left calls open
            self.end_call(self._calls[-1][0], None)

    def begin_call(self, unit: Unit) -> None:  # noqa: D102
        self._note(Event(Phase.FORWARD, unit.index), self._forward_calls)
        records = [self.params[n] for n in unit.params]
        self.pool.acquire([r.entry for r in records], f"forward of {unit.name or '<root>'}")
        self._running[unit.name] += 1
        grad_on = torch.is_grad_enabled()
        # Hold the AccumulateGrad nodes: made during the call, they would look like saves.
        nodes = [
            r.param.view_as(r.param).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
            for r in records
            if grad_on and r.param.requires_grad and not r.fixed
        ]
        counts = {r.name: use_counts(r) for r in records if not r.fixed}
        self._calls.append((unit, counts, nodes))
        self._prefetch(Phase.FORWARD, self._forward_calls)
        self._forward_calls += 1

    def end_call(self, unit: Unit, output: Any) -> None:  # noqa: D102
        if not self._calls or self._calls[-1][0] is not unit:
            return  # its pre-hook raised before the call began
        _, counts, nodes = self._calls.pop()
        self._running[unit.name] -= 1
        saved = {n for n, before in counts.items() if grew(use_counts(self.params[n]), before)}
        nodes.clear()
        self._saved[unit.index] = saved
        for name in unit.params:
            self.pool.release(self.params[name].entry)
        if output is None or not torch.is_grad_enabled():
            return
        on_backward_start(output, lambda: self._begin_backward(unit, saved))

    # -- backward -----------------------------------------------------------------------------
    @property
    def final(self) -> bool:
        """The running backward pass is the step's last (it updates)."""
        return self.backwards_done + 1 == self.accumulation_steps

    def _ensure_backward(self) -> None:
        if not self.in_backward:
            self.in_backward = True
            self._backward_calls = 0
            self._units_begun.clear()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _begin_backward(self, unit: Unit, saved: set[str]) -> None:
        self._ensure_backward()
        if unit.index in self._units_begun:  # another node of the same outputs
            return
        self._units_begun.add(unit.index)
        self._note(Event(Phase.BACKWARD, unit.index), self._backward_calls)
        needs, reserve = self._backward_need(unit, saved)
        entries = [e for group in needs.values() for e in group]
        self.pool.acquire(entries, f"backward of {unit.name or '<root>'}", reserve)
        for name, group in needs.items():
            self._bwd_pins.setdefault(name, []).extend(group)
        for name in unit.params:  # their gradients arrive later: keep room for them until then
            record = self.params[name]
            if record.param.requires_grad and name not in self._expected:
                self._expected[name] = record.entry.nbytes
                self.pool.reserved_bytes += record.entry.nbytes
        self._prefetch(Phase.BACKWARD, self._backward_calls)
        self._backward_calls += 1

    def _backward_need(
        self, unit: Unit, saved: set[str]
    ) -> tuple[dict[str, list[OffloadedTensor]], int]:
        """What a unit's backward pins per parameter until its gradient; the bytes it allocates."""
        needs: dict[str, list[OffloadedTensor]] = {}
        reserve = 0
        update_now = self.final and self.max_grad_norm is None
        for name in unit.params:
            record = self.params[name]
            if name in self._bwd_pins:
                continue
            entries = needs.setdefault(name, [])
            # A trainable parameter comes in for its backward whether or not the forward was
            # seen saving it: a convolution's weight is saved without its use count showing it.
            if name in saved or record.param.requires_grad:
                entries.append(record.entry)
            if record.param.requires_grad:
                reserve += record.entry.nbytes
                if record.acc is not None:
                    entries.append(record.acc)
                if update_now:
                    entries += record.state
                    reserve += 0 if record.state else record.state_bytes
        return needs, reserve

    def _end_backward(self) -> None:
        for entry in [e for group in self._bwd_pins.values() for e in group]:
            self.pool.release(entry)
        self._bwd_pins.clear()
        self.pool.reserved_bytes -= sum(self._expected.values())  # some will not come
        self._expected.clear()
        self.in_backward = False
        self.backwards_done += 1
        self._recording = False
        self.pool.reap()

    def take_gradient(self, record: ParamRecord) -> None:  # noqa: D102
        self._ensure_backward()
        grad = record.param.grad
        record.param.grad = None
        assert grad is not None
        pins = self._bwd_pins.pop(record.name, [])
        self.pool.reserved_bytes -= self._expected.pop(record.name, 0)
        self._keep_gradient(record, grad)
        for entry in pins:  # after the update: the parameter must not leave before it
            self.pool.release(entry)
        if self.joint:
            # Sharing a budget, the bytes its write-backs hold are no activation the guard could
            # evict: they leave before backward allocates more.
            self.pool.reap(block=True)

    def _keep_gradient(self, record: ParamRecord, grad: torch.Tensor) -> None:
        # Pinned from its adoption: making room for what follows must not write it away.
        name = f"{record.name}#grad"
        entry = self.pool.adopt(grad, name, TensorKind.GRAD, fixed=record.fixed, used=True)
        if record.acc is not None:
            acc = record.acc
            self.pool.acquire([acc], f"accumulating {record.name}")
            acc.complete()  # its last write may still be in flight
            # What AccumulateGrad does to a defined .grad: +=, exact and commutative.
            acc.tensor.add_(grad)
            if not self.pool.is_fixed(acc):
                acc.mark_dirty()
            self.pool.forget(entry)
            del grad
            record.acc = None
            entry = acc
        if not self.final:
            record.acc = entry
            self.pool.release(entry)
        elif self.max_grad_norm is not None:
            record.norm = gradient_norm(entry.tensor, self.norm_type)
            record.grad = entry
            self.pool.release(entry)
        else:
            update_parameter(self.pool, self.optimizer, record, entry, self.min_tensor_bytes)

    # -- update -------------------------------------------------------------------------------
    def clip_and_update(self) -> torch.Tensor:
        """Clip every kept gradient by the global norm and update, unit by unit."""
        pending = [(r, r.grad, r.norm) for r in self.params.values() if r.grad is not None]
        total = total_norm([(g.tensor, n) for _, g, n in pending if n is not None], self.norm_type)
        max_norm = self.max_grad_norm
        assert max_norm is not None
        by_unit: dict[int, list[tuple[ParamRecord, OffloadedTensor]]] = {}
        for record, grad, _ in pending:
            by_unit.setdefault(record.units[0] if record.units else -1, []).append((record, grad))
        for index in [*self.policy.update_order(len(self.units)), -1]:
            group = by_unit.get(index, [])
            self.pool.acquire([grad for _, grad in group], "clip-and-update")
            for record, grad in group:
                clip_(grad.tensor, max_norm, total)
                record.grad, record.norm = None, None
                update_parameter(self.pool, self.optimizer, record, grad, self.min_tensor_bytes)
        return total

    # -- prefetch -----------------------------------------------------------------------------
    def _note(self, event: Event, position: int) -> None:
        if self._recording:
            self.policy.record(event, position)

    def _prefetch(self, phase: Phase, position: int) -> None:
        if self.joint:
            return
        for event in self.policy.upcoming(phase, position):
            if not self.pool.prefetch(self._need(event)):
                return

    def _need(self, event: Event) -> list[OffloadedTensor]:
        unit = self.units[event.unit]
        if event.phase is Phase.FORWARD:
            return [self.params[n].entry for n in unit.params]
        needs = self._backward_need(unit, self._saved.get(unit.index, set()))[0]
        return [e for group in needs.values() for e in group]
