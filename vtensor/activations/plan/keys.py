"""The plan cache's key of an iteration: the model, its inputs, the budget, the kind of plan."""

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from vtensor.activations.model_state import Fingerprint, ModelScan
from vtensor.planner.keys import PlanKey, input_signature
from vtensor.planner.lgm import PLANNER_VERSION


def planner_version(count_workspaces: bool, recompute: bool, encode_masks: bool | str) -> str:
    """The planner's version naming the kind of plan, so each kind stays apart in the cache."""
    masks = {True: "+masks", "auto": "+masks-auto"}.get(encode_masks, "")
    kinds = {"+workspaces": count_workspaces, "+recompute": recompute, masks: bool(masks)}
    return PLANNER_VERSION + "".join(k for k, on in kinds.items() if on)


@dataclass
class PlanKeys:
    """Makes the keys of one manager's iterations (its budget, chunks and kind of plan)."""

    budget_bytes: int
    chunk_bytes: int | None
    planner_version: str
    _fingerprint: Fingerprint = field(default_factory=Fingerprint)

    def of(
        self,
        model: nn.Module,
        scan: ModelScan,
        inputs: Sequence[torch.Tensor],
        device: torch.device,
        params: str,
    ) -> PlanKey:
        """The key of an iteration of ``model`` on ``inputs`` (``params``: a joint plan's)."""
        return PlanKey(
            architecture=self._fingerprint.of(model, scan),
            input_signature=input_signature(*inputs),
            dtype=scan.dtype,
            budget_bytes=self.budget_bytes,
            chunk_bytes=self.chunk_bytes,
            device_kind=device.type,
            planner_version=self.planner_version,
            torch_version=torch.__version__,
            params=params,
        )
