"""Training with parameters, gradients and optimizer state offloaded to the storage tier."""

import contextlib
import functools
import logging
from os import PathLike
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from vtensor.errors import InfeasibleBudgetError, ParamOffloadError
from vtensor.io.chunk import DEFAULT_CHUNK_BYTES
from vtensor.io.engines import Tier, engine_for
from vtensor.offload.hooks import install_offload_hooks
from vtensor.offload.offloaded import ResidentMeter
from vtensor.offload.passes import OffloadPasses
from vtensor.offload.policy import Lookahead
from vtensor.offload.pool import OffloadPool
from vtensor.offload.records import describe_params
from vtensor.offload.report import ParamOffloadReport
from vtensor.offload.units import find_units, footprint, long_lived
from vtensor.offload.update import adopt_state
from vtensor.planner.trace import TensorKind
from vtensor.sizes import format_bytes, parse_bytes

logger = logging.getLogger(__name__)


class ParamOffload(contextlib.AbstractContextManager["ParamOffload"]):
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
        tier: where the tensors go between uses (NOTE [tier choice] in ``io/engines.py``);
            parameters are on the CPU, where ``auto`` and ``storage`` are the swap file.
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
        tier: Tier | str = Tier.AUTO,
    ) -> None:
        if lookahead < 0 or accumulation_steps < 1 or (max_grad_norm or 1.0) <= 0:
            raise ParamOffloadError(
                f"lookahead={lookahead} must be >= 0, accumulation_steps={accumulation_steps} "
                f">= 1 and max_grad_norm={max_grad_norm} > 0 or None"
            )
        self.model, self.optimizer = model, optimizer
        self.budget_bytes = parse_bytes(budget)
        self.units, kept = find_units(model, resident)
        self._params = describe_params(model, optimizer, self.units, kept, min_tensor_bytes)
        copies = 2 if accumulation_steps > 1 else 1
        self.footprint = footprint(self.units, self._params, copies)
        if self.budget_bytes < self.footprint.min_budget_bytes:
            raise InfeasibleBudgetError(
                self.budget_bytes,
                self.footprint.min_budget_bytes,
                f"layer {self.footprint.largest_unit}",
                f"parameters, gradients and optimizer state of that layer, of long-lived layers "
                f"({len(long_lived(self.units))} parameters) and of tensors under "
                f"{min_tensor_bytes} bytes must fit at once",
            )
        self.meter = ResidentMeter()
        chunk_size = parse_bytes(chunk_bytes, what="chunk_bytes")
        # ``describe_params`` refused any parameter off the CPU.
        self._engine = engine_for(
            torch.device("cpu"),
            tier=tier,
            host_capacity_bytes=None,
            storage_dir=storage_dir,
            drop_page_cache=drop_page_cache,
            encrypt=encrypt_storage,
            staging_bytes=chunk_size,
        )
        self.pool = OffloadPool(self._engine, self.meter, self.budget_bytes, chunk_size)
        self.passes = OffloadPasses(
            self.pool,
            optimizer,
            Lookahead(lookahead),
            self.units,
            self._params,
            accumulation_steps=accumulation_steps,
            max_grad_norm=max_grad_norm,
            norm_type=norm_type,
            min_tensor_bytes=min_tensor_bytes,
        )
        self._hooks: list[RemovableHandle] = []
        self._step_peaks: list[int] = []
        self._closed = False
        try:
            self._adopt_all()
            self._hooks += install_offload_hooks(model, self.passes)
            # NOTE [weights between steps]
            post, pre = model.register_state_dict_post_hook, model.register_load_state_dict_pre_hook
            # Functions, not bound methods: torch marks the hooks it is given.
            self._hooks.append(post(functools.partial(ParamOffload._copied_in, self)))  # type: ignore[no-untyped-call]
            self._hooks.append(pre(functools.partial(ParamOffload._refuse_load, self)))  # type: ignore[no-untyped-call]
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
            adopt_state(self.pool, self.optimizer, record, self.passes.min_tensor_bytes)
        for entry in list(self.pool.tensors):  # everything starts in the tier
            if not self.pool.is_fixed(entry):
                entry.start_write()
        self.pool.reap(block=True)

    # -- between steps ------------------------------------------------------------------------
    def _copied_in(
        self, _module: nn.Module, state: dict[str, Any], prefix: str, _meta: Any
    ) -> None:
        """Fill ``state_dict()`` with copies of the offloaded parameters' values.

        NOTE [weights between steps]
        Between its uses an offloaded parameter's storage holds no bytes, so the tensors
        ``state_dict()`` collects would read freed memory. Each one is brought in, copied and
        let go, one at a time, within the budget; the copies are the caller's. Loading weights
        into offloaded parameters is refused (``_refuse_load``): load them before the first
        step, or after ``close()``.
        """
        for record in self._params.values():
            key = prefix + record.name
            if key not in state or record.fixed:
                continue
            self.pool.acquire([record.entry], f"state_dict {record.name}")
            try:
                state[key] = record.param.detach().clone()
            finally:
                self.pool.release(record.entry)
        self.pool.reap(block=True)

    def _refuse_load(self, *_args: Any, **_kwargs: Any) -> None:
        if not self._closed:
            raise ParamOffloadError(
                "load_state_dict into a model whose parameters are offloaded: load the weights "
                "before its first managed step, or after the manager (or ParamOffload) is closed"
            )

    # -- update -------------------------------------------------------------------------------
    def step(self) -> torch.Tensor | None:
        """Finish the optimizer step after ``accumulation_steps`` backward passes.

        With ``max_grad_norm``, clip and update layer by layer and return the total norm;
        without, every parameter was updated as its gradient completed (None).
        """
        if self._closed:
            raise ParamOffloadError("this ParamOffload is closed; make a new one to train again")
        passes = self.passes
        if passes.in_backward or passes.backwards_done != passes.accumulation_steps:
            raise ParamOffloadError(
                f"step() after {passes.backwards_done} backward passes; accumulation_steps="
                f"{passes.accumulation_steps}: call step() once after that many loss.backward()"
            )
        total = passes.clip_and_update() if passes.max_grad_norm is not None else None
        passes.backwards_done = 0  # the next backward pass is the first of a new step
        self.pool.reap()
        self._step_peaks.append(self.meter.peak_bytes)
        self.meter.reset_peak()
        return total

    def plan_signature(self) -> str:
        """What a joint plan of the coming backward pass depends on (NOTE [one plan]).

        The settings that change which tensors exist and when, and the backward's place in its
        step: the first micro-batch creates the accumulated gradients, the last one updates.
        """
        passes = self.passes
        if passes.accumulation_steps == 1:
            position = "only"
        elif passes.backwards_done == 0:
            position = "first"
        elif passes.final:
            position = "last"
        else:
            position = "middle"
        clip = "none" if passes.max_grad_norm is None else f"{passes.norm_type}"
        optimizer = type(self.optimizer)
        return (
            f"param-offload/1;optimizer={optimizer.__module__}.{optimizer.__qualname__};"
            f"accumulation={passes.accumulation_steps};clip={clip};micro-batch={position};"
            f"fixed={','.join(sorted(r.name for r in self._params.values() if r.fixed))}"
        )

    # -- lifecycle ----------------------------------------------------------------------------
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
        """Bring every parameter and state tensor back and delete the swap file.

        Gradients of a step not finished with ``step()`` are dropped.
        """
        if self._closed:
            return
        self._closed = True
        self.passes.close_guard()
        for hook in self._hooks:
            hook.remove()
        for record in self._params.values():
            for extra in (record.acc, record.grad):
                if extra is not None:
                    self.pool.forget(extra)
            record.acc = record.grad = None
        self.pool.close()
        self._engine.close()
        logger.debug("parameter offloading closed: %s", format_bytes(self.meter.peak_bytes))

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: nothing more can be done
            self.close()
