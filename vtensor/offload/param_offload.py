"""Training with parameters, gradients and optimizer state offloaded to the storage tier.

NOTE [parameter offloading] (docs/param-offload.md)
Each unit's (NOTE [offload units]) parameters are brought in by a forward pre-hook and let go
by a forward hook; the forward hook also sees which of them autograd saved (their use counts
grew) and puts a prehook on the autograd nodes of the unit's outputs, which brings those back in
before the unit's backward. A post-accumulate-grad hook takes each gradient as it completes:
between micro-batches it is added to the parameter's accumulated gradient, which then leaves
memory; in the last backward of a step the parameter is updated at once (NOTE [per-parameter
update]), or, when clipping by global norm, the gradient's norm is kept and the gradient leaves
memory until ``step()`` runs a streamed clip-and-update pass. Reads for the next ``lookahead``
uses start on the I/O thread as far as the budget allows; a use waits only on reads still in
flight. The policy (what to prefetch) is :class:`vtensor.offload.policy.Lookahead`.
"""

import contextlib
import logging
from collections import Counter
from os import PathLike
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from vtensor.errors import InfeasibleBudgetError
from vtensor.io.chunk import DEFAULT_CHUNK_BYTES
from vtensor.io.tiers import StorageTier
from vtensor.io.transfer import FileTransferEngine
from vtensor.offload.guard import UseGuard
from vtensor.offload.hooks import install_offload_hooks, on_backward_start
from vtensor.offload.offloaded import OffloadedTensor, ResidentMeter
from vtensor.offload.policy import Event, Lookahead, Phase
from vtensor.offload.pool import OffloadPool
from vtensor.offload.records import (
    ParamRecord,
    adopt_state,
    describe_params,
    grew,
    update_parameter,
    use_counts,
)
from vtensor.offload.report import ParamOffloadReport
from vtensor.offload.units import (
    ParamOffloadError,
    Unit,
    find_units,
    footprint,
    long_lived,
)
from vtensor.offload.update import clip_, gradient_norm, total_norm
from vtensor.planner.trace import TensorKind
from vtensor.sizes import format_bytes, parse_bytes

logger = logging.getLogger(__name__)


class ParamOffload:
    """Trains ``model`` with its parameters, gradients and optimizer state under ``budget``.

    Usage::

        with vtensor.ParamOffload(model, optimizer, budget="64MiB", max_grad_norm=1.0) as po:
            for x, y in loader:
                loss_fn(model(x), y).backward()
                po.step()  # instead of optimizer.step(); no zero_grad needed
            print(po.report())

    Args:
        model: the model; its parameters must be on the CPU.
        optimizer: a per-parameter ``torch.optim`` optimizer over exactly the trainable
            parameters (SGD, Adam, AdamW, ...); it is stepped one parameter at a time.
        budget: bytes of parameters, gradients and optimizer state in memory at once.
        lookahead: uses (layers) read ahead of the running one, budget permitting.
        accumulation_steps: backward passes (micro-batches) per ``step()``.
        max_grad_norm: clip gradients by global norm to this (None: no clipping).
        norm_type: the norm for clipping.
        resident: names of modules whose parameters stay in memory.
        min_tensor_bytes: smaller tensors stay in memory (counted), not worth a transfer.
        chunk_bytes, storage_dir, encrypt_storage, drop_page_cache: as for ``MemoryManager``.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        budget: int | float | str,
        *,
        lookahead: int = 1,
        accumulation_steps: int = 1,
        max_grad_norm: float | None = None,
        norm_type: float = 2.0,
        resident: tuple[str, ...] = (),
        min_tensor_bytes: int = 4096,
        chunk_bytes: int | str = DEFAULT_CHUNK_BYTES,
        storage_dir: str | PathLike[str] | None = None,
        encrypt_storage: bool = True,
        drop_page_cache: bool = True,
    ) -> None:
        if lookahead < 0 or accumulation_steps < 1 or (max_grad_norm or 1.0) <= 0:
            raise ParamOffloadError(
                f"lookahead={lookahead} must be >= 0, accumulation_steps={accumulation_steps} "
                f">= 1 and max_grad_norm={max_grad_norm} > 0 or None"
            )
        self.model, self.optimizer = model, optimizer
        self.budget_bytes = parse_bytes(budget)
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm, self.norm_type = max_grad_norm, norm_type
        self.policy = Lookahead(lookahead)
        self.units, kept = find_units(model, resident)
        self._min_tensor_bytes = min_tensor_bytes
        self._params = describe_params(model, optimizer, self.units, kept, min_tensor_bytes)
        lasting = long_lived(self.units)
        managed = {r.name for r in self._params.values() if not r.fixed}
        self.footprint = footprint(
            self.units,
            {r.name: r.param for r in self._params.values()},
            {r.name: r.state_bytes for r in self._params.values()},
            managed,
            2 if accumulation_steps > 1 else 1,
        )
        if self.budget_bytes < self.footprint.min_budget_bytes:
            raise InfeasibleBudgetError(
                self.budget_bytes,
                self.footprint.min_budget_bytes,
                f"layer {self.footprint.largest_unit}",
                f"parameters, gradients and optimizer state of that layer, of long-lived "
                f"layers ({len(lasting)} parameters) and of tensors under {min_tensor_bytes} "
                "bytes must fit at once",
            )
        self.meter = ResidentMeter()
        self._engine = FileTransferEngine(
            StorageTier(storage_dir, drop_page_cache), encrypt=encrypt_storage
        )
        self.pool = OffloadPool(
            self._engine,
            self.meter,
            self.budget_bytes,
            parse_bytes(chunk_bytes, what="chunk_bytes"),
        )
        self._owners: dict[int, tuple[str, frozenset[str]]] = {}
        self._running: Counter[str] = Counter()
        self._hooks: list[RemovableHandle] = []
        self._schedule: list[Event] = []
        self._recording = True
        self._forward_calls = self._backward_calls = self._update_calls = 0
        self._backwards_done = 0
        self._in_backward = False
        self._bwd_pins: dict[str, list[OffloadedTensor]] = {}
        self._expected: dict[str, int] = {}  # gradients announced by a unit's backward
        self._units_begun: set[int] = set()  # units whose backward began in this backward
        self._saved: dict[int, set[str]] = {}  # unit -> parameters autograd saved (last forward)
        self._calls: list[tuple[Unit, dict[str, tuple[int, int]], list[Any]]] = []
        self._guard: UseGuard | None = None
        self._step_peaks: list[int] = []
        self._closed = False
        # True while a MemoryManager replays a joint plan (NOTE [one plan]): reads are then
        # the plan's, not the lookahead's.
        self._plan_driven = False
        self._joint_step = False  # inside a MemoryManager step that shares the budget
        try:
            self._adopt_all()
            handles = install_offload_hooks(model, self.units, list(self._params.values()), self)
            self._hooks += handles
        except BaseException:
            self.close()
            raise
        self.meter.reset_peak()

    # -- setup --------------------------------------------------------------------------------
    def _adopt_all(self) -> None:
        for record in self._params.values():
            record.entry = self.pool.adopt(
                record.param, record.name, TensorKind.PARAM, fixed=record.fixed
            )
            adopt_state(self.pool, self.optimizer, record, self._min_tensor_bytes)
            if not record.fixed:
                owners = frozenset(self.units[i].name for i in record.units)
                self._owners[record.entry.storage._cdata] = (record.name, owners)
        for entry in list(self.pool.tensors):  # everything starts in the tier
            if not self.pool.is_fixed(entry):
                entry.start_write()
        self.pool.reap(block=True)

    # -- forward ------------------------------------------------------------------------------
    def begin_forward(self) -> None:  # noqa: D102
        self._check_open()
        self._forward_calls = 0
        if not self._joint_step:
            # A forward outside the manager's steps (evaluation, say): a joint plan's hold on
            # what it kept resident ends; the next joint step reads what its plan needs.
            self.pool.end_hold()
        if self._recording and self._guard is None:
            self._guard = UseGuard(self._owners, self._running)
            self._guard.__enter__()  # type: ignore[no-untyped-call]

    def end_forward(self) -> None:  # noqa: D102
        if self._guard is not None:
            self._guard.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            self._guard = None
        while self._calls:  # a forward that raised left calls open
            self.end_call(self._calls[-1][0], None)

    def begin_call(self, unit: Unit) -> None:  # noqa: D102
        self._note(Event(Phase.FORWARD, unit.index), self._forward_calls)
        records = [self._params[n] for n in unit.params]
        self.pool.acquire([r.entry for r in records], f"forward of {unit.name or '<root>'}")
        self._running[unit.name] += 1
        grad_on = torch.is_grad_enabled()
        # Hold each AccumulateGrad node through the call so that its creation does not look
        # like a saved reference when the use counts are compared afterwards.
        nodes = [
            r.param.view_as(r.param).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
            for r in records
            if grad_on and r.param.requires_grad and not r.fixed
        ]
        counts = {r.name: use_counts(r) for r in records if not r.fixed}
        self._calls.append((unit, counts, nodes))
        self._prefetch(Phase.FORWARD, self._forward_calls, reserve_bytes=0)
        self._forward_calls += 1

    def end_call(self, unit: Unit, output: Any) -> None:  # noqa: D102
        if not self._calls or self._calls[-1][0] is not unit:
            return  # its pre-hook raised before the call began
        _, counts, nodes = self._calls.pop()
        self._running[unit.name] -= 1
        saved = {n for n, before in counts.items() if grew(use_counts(self._params[n]), before)}
        nodes.clear()
        self._saved[unit.index] = saved
        for name in unit.params:
            self.pool.release(self._params[name].entry)
        if output is None or not torch.is_grad_enabled():
            return
        on_backward_start(output, lambda: self._begin_backward(unit, saved))

    # -- backward -----------------------------------------------------------------------------
    @property
    def _final(self) -> bool:
        return self._backwards_done + 1 == self.accumulation_steps

    def _ensure_backward(self) -> None:
        if not self._in_backward:
            self._in_backward = True
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
            record = self._params[name]
            if record.param.requires_grad and name not in self._expected:
                self._expected[name] = record.entry.nbytes
                self.pool.reserved_bytes += record.entry.nbytes
        self._prefetch(Phase.BACKWARD, self._backward_calls, 0)
        self._backward_calls += 1

    def _backward_need(
        self, unit: Unit, saved: set[str]
    ) -> tuple[dict[str, list[OffloadedTensor]], int]:
        """Per parameter, what a unit's backward pins (until that gradient is in).

        Also the bytes the backward will allocate: its gradients, first-step optimizer state.
        """
        needs: dict[str, list[OffloadedTensor]] = {}
        reserve = 0
        update_now = self._final and self.max_grad_norm is None
        for name in unit.params:
            record = self._params[name]
            if name in self._bwd_pins:
                continue
            entries = needs.setdefault(name, [])
            if name in saved or (update_now and record.param.requires_grad):
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
        for name in list(self._bwd_pins):
            self._unpin_backward(name)
        self.pool.reserved_bytes -= sum(self._expected.values())
        self._expected.clear()
        self._in_backward = False
        self._backwards_done += 1
        if self._recording:
            self._recording = False
        self.pool.reap()

    def _unpin_backward(self, name: str) -> None:
        for entry in self._bwd_pins.pop(name, []):
            self.pool.release(entry)

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

    def _keep_gradient(self, record: ParamRecord, grad: torch.Tensor) -> None:
        # Pinned from here on: making room for what follows must not take the gradient away.
        entry = self.pool.adopt(grad, f"{record.name}#grad", TensorKind.GRAD, fixed=record.fixed)
        self.pool.acquire([entry], f"gradient of {record.name}")
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
        if not self._final:
            record.acc = entry
            self.pool.release(entry)
        elif self.max_grad_norm is not None:
            record.norm = gradient_norm(entry.tensor, self.norm_type)
            record.grad = entry
            self.pool.release(entry)
        else:
            update_parameter(self.pool, self.optimizer, record, entry, self._min_tensor_bytes)

    # -- update -------------------------------------------------------------------------------
    def step(self) -> torch.Tensor | None:
        """Finish the optimizer step after ``accumulation_steps`` backward passes.

        Without clipping every parameter was already updated as its gradient completed; with
        ``max_grad_norm`` this clips and updates layer by layer and returns the total norm.
        """
        self._check_open()
        if self._in_backward or self._backwards_done != self.accumulation_steps:
            raise ParamOffloadError(
                f"step() after {self._backwards_done} backward passes; accumulation_steps="
                f"{self.accumulation_steps}: call step() once after that many loss.backward()"
            )
        total = None
        if self.max_grad_norm is not None:
            total = self._clip_and_update(self.max_grad_norm)
        self._backwards_done = 0
        self.pool.reap()
        self._step_peaks.append(self.meter.peak_bytes)
        self.meter.reset_peak()
        return total

    def _clip_and_update(self, max_norm: float) -> torch.Tensor:
        pending = [r for r in self._params.values() if r.grad is not None]
        norms = [
            (r.grad.tensor, r.norm) for r in pending if r.grad is not None and r.norm is not None
        ]
        total = total_norm(norms, self.norm_type)
        order = self.policy.update_order(self._schedule, len(self.units))
        by_unit = {i: [r for r in pending if r.units and r.units[0] == i] for i in order}
        by_unit[-1] = [r for r in pending if not r.units]
        self._update_calls = 0
        for index in [*order, -1]:
            self._note(Event(Phase.UPDATE, index), self._update_calls)
            records = by_unit.get(index, [])
            grads = [r.grad for r in records if r.grad is not None]
            self.pool.acquire(grads, "clip-and-update")
            self._prefetch(Phase.UPDATE, self._update_calls, reserve_bytes=0)
            self._update_calls += 1
            for record in records:
                grad = record.grad
                assert grad is not None
                clip_(grad.tensor, max_norm, total)
                record.grad, record.norm = None, None
                update_parameter(self.pool, self.optimizer, record, grad, self._min_tensor_bytes)
        return total

    # -- prefetch -----------------------------------------------------------------------------
    def _note(self, event: Event, position: int) -> None:
        if self._recording:
            self.policy.record(self._schedule, event, position)

    def _prefetch(self, phase: Phase, position: int, reserve_bytes: int) -> None:
        if self._plan_driven:
            return
        upcoming = self.policy.upcoming(self._schedule, phase, position, final=self._final)
        for event in upcoming:
            if not self.pool.prefetch(self._need(event), reserve_bytes):
                return

    def _need(self, event: Event) -> list[OffloadedTensor]:
        if event.unit < 0:
            return []
        unit = self.units[event.unit]
        records = [self._params[n] for n in unit.params]
        if event.phase is Phase.FORWARD:
            return [r.entry for r in records]
        if event.phase is Phase.BACKWARD:
            needs = self._backward_need(unit, self._saved.get(unit.index, set()))[0]
            return [e for group in needs.values() for e in group]
        grads = [r.grad for r in records if r.grad is not None]
        return [*(r.entry for r in records), *grads, *(e for r in records for e in r.state)]

    # -- joint plans --------------------------------------------------------------------------
    def begin_joint(self, *, plan_driven: bool) -> None:
        """A ``MemoryManager`` step that shares the budget begins (its ``JointStep``).

        ``plan_driven``: a joint plan decides the reads; the lookahead reads nothing ahead.
        """
        self._joint_step, self._plan_driven = True, plan_driven

    def end_joint(self) -> None:
        """The joint step ended: the lookahead reads ahead again."""
        self._joint_step = self._plan_driven = False

    def plan_signature(self) -> str:
        """What a joint plan of the coming backward pass depends on (NOTE [one plan]).

        The settings that change which tensors exist and when they are used, and the position
        of the backward pass in its step: the first micro-batch of an accumulating step creates
        the accumulated gradients, the last one updates, the others only accumulate.
        """
        if self.accumulation_steps == 1:
            position = "only"
        elif self._backwards_done == 0:
            position = "first"
        elif self._final:
            position = "last"
        else:
            position = "middle"
        clip = "none" if self.max_grad_norm is None else f"{self.norm_type}"
        optimizer = type(self.optimizer)
        return (
            f"param-offload/1;optimizer={optimizer.__module__}.{optimizer.__qualname__};"
            f"accumulation={self.accumulation_steps};clip={clip};micro-batch={position};"
            f"fixed={','.join(sorted(r.name for r in self._params.values() if r.fixed))}"
        )

    # -- lifecycle ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ParamOffloadError("this ParamOffload is closed; make a new one to train again")

    def report(self) -> ParamOffloadReport:
        """Bytes held and moved since construction (peaks per ``step()``)."""
        return ParamOffloadReport(
            budget_bytes=self.budget_bytes,
            min_budget_bytes=self.footprint.min_budget_bytes,
            param_bytes=self.footprint.param_bytes,
            grad_bytes=self.footprint.grad_bytes,
            state_bytes=self.footprint.state_bytes,
            resident_bytes=self.meter.resident_bytes,
            peak_resident_bytes=max([*self._step_peaks, self.meter.peak_bytes]),
            step_peak_bytes=tuple(self._step_peaks),
            bytes_out=self.meter.bytes_out,
            bytes_in=self.meter.bytes_in,
            stall_s=self.meter.stall_s,
            steps=len(self._step_peaks),
        )

    def close(self) -> None:
        """Bring every parameter and state tensor back into memory and delete the swap file.

        Gradients of a step not finished with ``step()`` are dropped.
        """
        if self._closed:
            return
        self._closed = True
        if self._guard is not None:
            self._guard.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            self._guard = None
        for hook in self._hooks:
            hook.remove()
        pool = getattr(self, "pool", None)
        if pool is not None:
            for record in self._params.values():
                for extra in (record.acc, record.grad):
                    if extra is not None:
                        pool.forget(extra)
                record.acc = record.grad = None
            pool.close()
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.close()
        logger.debug("parameter offloading closed: %s", format_bytes(self.meter.peak_bytes))

    def __enter__(self) -> "ParamOffload":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: nothing more can be done
            self.close()
