"""The parameter offloadings a manager makes and owns, one per model and optimizer."""

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from os import PathLike

import torch
from torch import nn

from vtensor.activations.model_state import ModelScan
from vtensor.activations.runtime.floor import floor_breakdown, offloading_floor
from vtensor.activations.runtime.iteration import Iteration
from vtensor.errors import InfeasibleBudgetError, VTensorError
from vtensor.offload.joint import (
    AUTO_OFFLOAD_SHARE,
    ParamOffload,
    ParamOffloadReport,
    check_joint,
    state_bytes,
)
from vtensor.sizes import format_bytes

logger = logging.getLogger(__name__)

_NOT_PLANNABLE = "parameters are offloaded on the CPU at chunk granularity"


@dataclass(frozen=True)
class OffloadSettings:
    """The manager's settings every offloading it makes takes."""

    chunk_bytes: int
    storage_dir: str | PathLike[str] | None
    encrypt_storage: bool
    drop_page_cache: bool
    min_tensor_bytes: int


@dataclass(frozen=True)
class StepSide:
    """The parameter side one step runs with.

    Attributes:
        params: the offloading planned with the activations: the caller's, or one ``owned``.
        optimizer: the optimizer whose state the manager budgets (None where ``params`` holds
            that state).
        user_optimizer: the optimizer the caller gave.
        owned: the offloading this manager made, if the step runs with one.
        probing: ``owned`` only measures (NOTE [offload probe]).
        to_come: the state the caller's optimizer creates at its first step.
    """

    params: ParamOffload | None
    optimizer: torch.optim.Optimizer | None
    user_optimizer: torch.optim.Optimizer | None
    owned: ParamOffload | None = None
    probing: bool = False
    to_come: int = 0

    @property
    def pending(self) -> int:
        """The state to come the manager budgets: an owned offloading's is its own."""
        return self.to_come if self.optimizer is not None else 0


class Offloads:
    """Offloads a model's parameter side under the manager's budget where it must.

    ``setting``: ``"auto"`` (NOTE [offload auto] in ``offload/joint.py``), ``True`` or ``False``.
    Each offloading is made at the first step that needs it and kept for the later ones.
    """

    def __init__(
        self,
        setting: bool | str,
        *,
        chunk_bytes: int,
        storage_dir: str | PathLike[str] | None,
        encrypt_storage: bool,
        drop_page_cache: bool,
        min_tensor_bytes: int,
    ) -> None:
        if setting not in (True, False, "auto"):
            raise VTensorError(f"offload_params={setting!r}: use True, False or 'auto'")
        self.setting = setting
        self._settings = OffloadSettings(
            chunk_bytes, storage_dir, encrypt_storage, drop_page_cache, min_tensor_bytes
        )
        self._made: dict[tuple[int, int], ParamOffload] = {}
        self._declined: set[tuple[int, int]] = set()  # offloaded once, found to fit as is

    def __bool__(self) -> bool:
        return bool(self._made)

    def for_step(
        self,
        model: nn.Module,
        scan: ModelScan,
        optimizer: torch.optim.Optimizer | None,
        budget_bytes: int,
        *,
        pending_bytes: int,
        plannable: str,
    ) -> tuple[ParamOffload | None, bool]:
        """The offloading ``model``'s step runs with, if any, and whether it only measures.

        ``pending_bytes``: state the optimizer's first step creates; ``plannable``: why a joint
        plan cannot run here ("" where it can).

        NOTE [offload probe]
        Below what offloading needs at least (its largest layer with gradient and state), the
        offloading is made at that least instead, and the step runs with it only to measure:
        the minimum it states is then the whole iteration's with the parameters offloaded,
        measured, not estimated. The probe is let go with the error (``discard``).
        A stated minimum must work under the setting that states it: where ``"auto"`` would
        keep the parameter side in memory at the offloaded minimum (it takes no more than
        ``AUTO_OFFLOAD_SHARE`` of it), the minimum stated is the iteration's with the side in
        memory, measured at each point of the same iteration: its bytes in use replaced by all
        of it (the pool's ``unoffloaded_bytes``), plus the state to come
        (``runtime/floor.py``'s ``offloading_floor``).
        """
        if optimizer is None or self.setting is False or not budget_bytes:
            return None, False
        key = (id(model), id(optimizer))
        if key in self._made:
            return self._made[key], False
        if key in self._declined:
            return None, False
        if plannable:
            if self.setting is True:
                raise VTensorError(f"offload_params=True: {plannable}")
            return None, False
        side = state_bytes(scan.parameters, scan.buffers, optimizer, pending_bytes)
        if self.setting == "auto" and side <= AUTO_OFFLOAD_SHARE * budget_bytes:
            return None, False
        probing = False
        try:
            offload = self._make(model, optimizer, budget_bytes)
        except InfeasibleBudgetError as below:  # NOTE [offload probe]
            offload = self._make(model, optimizer, below.min_budget_bytes)
            probing = True
        logger.info(
            "parameters, gradients and optimizer state (%s) offloaded under the budget",
            format_bytes(side),
        )
        self._made[key] = offload
        return offload, probing

    def _make(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, budget_bytes: int
    ) -> ParamOffload:
        s = self._settings
        return ParamOffload(
            model,
            optimizer,
            budget_bytes,
            chunk_bytes=s.chunk_bytes,
            storage_dir=s.storage_dir,
            encrypt_storage=s.encrypt_storage,
            drop_page_cache=s.drop_page_cache,
            min_tensor_bytes=s.min_tensor_bytes,
        )

    def side_for(
        self,
        model: nn.Module,
        scan: ModelScan,
        optimizer: torch.optim.Optimizer | None,
        params: ParamOffload | None,
        budget_bytes: int,
        device: torch.device,
        granularity: str,
        to_come: int,
    ) -> StepSide:
        """What one step of ``model`` runs with on the parameter side; a joint step is checked.

        ``granularity``: the manager's swap unit; ``to_come``: the state ``optimizer``'s first
        step creates.
        """
        chunked = granularity == "chunk"
        plannable = "" if device.type == "cpu" and chunked else _NOT_PLANNABLE
        side = StepSide(params, optimizer, optimizer, to_come=to_come)
        if params is None:
            owned, probing = self.for_step(
                model, scan, optimizer, budget_bytes, pending_bytes=to_come, plannable=plannable
            )
            if owned is not None:  # its optimizer's state is the offloading's (NOTE [one plan])
                side = StepSide(owned, None, optimizer, owned, probing, to_come)
        if side.params is not None:
            check_joint(
                side.params,
                model,
                side.optimizer,
                side.params.budget_bytes if side.probing else budget_bytes,  # NOTE [offload probe]
                device,
                f"granularity {granularity}",
                chunked=chunked,
            )
        return side

    def refusal(
        self,
        side: StepSide,
        iteration: Iteration,
        model: nn.Module,
        inputs: Sequence[torch.Tensor],
        budget_bytes: int,
    ) -> InfeasibleBudgetError:
        """The error an infeasible (or probing) step raises: the minimum it states, its parts."""
        books = iteration.books
        need = books.min_budget_bytes + side.pending
        breakdown = floor_breakdown(
            books,
            need,
            model,
            side.optimizer,
            inputs,
            side.pending,
            offloaded=side.params is not None,
        )
        step = books.min_budget_step
        if side.owned is not None and side.user_optimizer is not None:  # NOTE [offload probe]
            need, step, breakdown = offloading_floor(
                iteration.floor,
                side.owned,
                model,
                side.user_optimizer,
                inputs,
                side.to_come,
                probed=side.probing,
                always=self.setting is True,
            )
            if side.probing:
                self.discard(side.owned)
        return InfeasibleBudgetError(budget_bytes, need, step, breakdown=breakdown)

    def after_step(self, side: StepSide, fits: bool) -> None:
        """An owned offloading's step ends; where everything ``fits`` as is, it is let go."""
        if side.owned is None:
            return
        side.owned.step()  # every parameter was updated in backward: the step ends
        if self.setting == "auto" and fits:
            self.decline(side.owned)  # NOTE [offload auto]: everything fits as is

    def of_model(self, model: nn.Module) -> ParamOffload | None:
        """The offloading made for ``model``, if any (the first, where several optimizers)."""
        return next((o for (m, _), o in self._made.items() if m == id(model)), None)

    def decline(self, offload: ParamOffload) -> None:
        """A profile showed everything fits as is: stop offloading that model for good."""
        self._declined.update(k for k, v in self._made.items() if v is offload)
        self.discard(offload)

    def discard(self, offload: ParamOffload) -> None:
        """Close ``offload`` and forget it: its parameters are the model's own again."""
        self._made = {k: v for k, v in self._made.items() if v is not offload}
        offload.close()

    def reports(self) -> tuple[ParamOffloadReport, ...]:
        """What each offloading held and moved since it was made."""
        return tuple(offload.report() for offload in self._made.values())

    def close(self) -> None:
        """Bring every offloaded parameter back into memory."""
        for offload in self._made.values():
            offload.close()
        self._made.clear()
