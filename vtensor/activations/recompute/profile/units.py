"""While profiling: which modules could be recomputed, what each saves, and whether it is safe.

NOTE [safe to recompute]
A recomputed forward must save exactly what the first one did, or the gradient is silently
wrong. While profiling, each candidate (every module with children, below the root) is marked
unsafe when it modifies an input in place, calls a custom autograd ``Function``, changes a plain
attribute of itself or a submodule, does not reproduce its outputs bit for bit from the same
inputs, RNG state and buffers, or runs more than once per iteration. Side effects outside Python
attributes and tensors stay the user's to exclude.

NOTE [no room to recompute]
A unit whose working set exceeds what the budget leaves beside the iteration's starting bytes
can never be recomputed: it is marked so and not checked (its checks would evict).

NOTE [one unit per tensors]
A module that saved exactly what one of its children did frees the same bytes at a higher cost:
it is no candidate.

NOTE [unit time]
A unit's recompute time is its check's second run, its forward alone (the first holds the
profile's own work); the mechanism's cost is added (NOTE [mechanism cost]).
"""

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from vtensor.activations.recompute.checkpointed import CallSnapshot, RecomputeTarget
from vtensor.activations.recompute.profile.checks import (
    OpenUnit,
    cuda_rng,
    plain_attributes,
    why_unsafe,
)
from vtensor.activations.recompute.profile.cost import MechanismCosts
from vtensor.activations.recompute.profile.highs import UnitHighs
from vtensor.activations.store.chunk_store import ChunkStore, VTensor
from vtensor.measure.clock import device_now
from vtensor.outputs import tensors_in
from vtensor.planner.recomputed import in_backward
from vtensor.planner.trace import TraceTensor, TraceUnit
from vtensor.sizes import format_bytes


class UnitTarget(RecomputeTarget, Protocol):
    """What the recorder reads of the iteration it profiles."""

    step_index: int
    store: ChunkStore

    def exclude_time(self, seconds: float) -> None:
        """Leave ``seconds`` out of the open step's measured duration."""
        ...

    def make_room(self, nbytes: int) -> None:
        """Evict activations so that ``nbytes`` about to be allocated fit the budget."""
        ...

    def room_bytes(self) -> int:
        """What the budget leaves beside the bytes the iteration began with."""
        ...


@dataclass
class _Seen:
    name: str
    first_step: int
    last_step: int
    forward_s: float
    vids: list[int]
    input_vids: list[int]
    why_unsafe: str = ""
    calls: int = 1
    working_bytes: int = 0
    same_as: str = ""  # a child unit that saved the same tensors (NOTE [one unit per tensors])


@dataclass
class UnitRecorder:
    """Forward hooks on the candidate modules of ``model`` for one profiled iteration."""

    model: nn.Module
    target: UnitTarget
    records: dict[int, VTensor]
    highs: UnitHighs = field(default_factory=UnitHighs)
    seen: dict[str, _Seen] = field(default_factory=dict)
    _open: dict[int, list[OpenUnit]] = field(default_factory=dict)

    def install(self) -> list[RemovableHandle]:
        """Hook every module with children below the root."""
        handles: list[RemovableHandle] = []
        for name, module in self.model.named_modules():
            if not name or not any(True for _ in module.children()):
                continue

            def pre(m: nn.Module, args: Any, kwargs: Any) -> None:
                self._pre(m, args, kwargs)

            def post(m: nn.Module, _args: Any, _kwargs: Any, output: Any, name: str = name) -> None:
                self._post(name, m, output)

            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post, with_kwargs=True))
        return handles

    def _pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.target.recomputing:
            return
        inputs = tensors_in((args, kwargs))
        self._open.setdefault(id(module), []).append(
            OpenUnit(
                first_step=self.target.step_index,
                first_vid=self.target.store.next_vid,
                started=device_now(self.target.device),
                input_storages={t.untyped_storage().data_ptr() for t in inputs},
                versions=[(t, t._version) for t in inputs],
                input_nodes={id(t.grad_fn) for t in inputs if t.grad_fn is not None},
                rng=torch.get_rng_state(),
                cuda_rng=cuda_rng(),
                buffers=[b.detach().clone() for b in module.buffers()],
                attributes=plain_attributes(module),
                call=CallSnapshot(args, kwargs),
                watch=self.highs.begin(),
            )
        )

    def _post(self, name: str, module: nn.Module, output: Any) -> None:
        if self.target.recomputing:
            return
        opened = self._open[id(module)].pop()
        forward_s = device_now(self.target.device) - opened.started
        working = self.highs.end(opened.watch)
        vids = list(range(opened.first_vid, self.target.store.next_vid))
        inputs = [
            v
            for v in vids
            if v in self.records
            and self.records[v].storage is not None
            and self.records[v].storage.data_ptr() in opened.input_storages  # type: ignore[union-attr]
        ]
        if name in self.seen:
            self.seen[name].calls += 1
            self.seen[name].why_unsafe = "it runs more than once per iteration"
            return
        same = self._same_child(name, vids)
        if same:  # NOTE [one unit per tensors]
            self.seen[name] = _Seen(
                name, opened.first_step, self.target.step_index, 0.0, vids, inputs
            )
            self.seen[name].same_as = same
            return
        began = time.perf_counter()
        room = self.target.room_bytes()
        if working > room:  # NOTE [no room to recompute]
            why = (
                f"its forward held {format_bytes(working)}, more than the "
                f"{format_bytes(max(room, 0))} the budget leaves beside the iteration's fixed bytes"
            )
            self.seen[name] = _Seen(
                name, opened.first_step, self.target.step_index, forward_s, vids, inputs, why
            )
            self.seen[name].working_bytes = working
            return
        # The checks rerun its forward unseen by readings: make room for its working set.
        self.target.make_room(working)
        why, again_s = why_unsafe(module, opened, output, self.target)
        forward_s = again_s or forward_s  # NOTE [unit time]
        self.target.exclude_time(time.perf_counter() - began)
        self.seen[name] = _Seen(
            name, opened.first_step, self.target.step_index, forward_s, vids, inputs, why
        )
        self.seen[name].working_bytes = working

    def _same_child(self, name: str, vids: list[int]) -> str:
        """A direct child unit of ``name`` that saved exactly ``vids`` ("" if none)."""
        if not vids:
            return ""
        for other, seen in self.seen.items():
            child = other.startswith(name + ".") and "." not in other[len(name) + 1 :]
            if child and seen.vids == vids and seen.calls == 1:
                return other
        return ""

    def units(
        self,
        position: dict[int, int],
        tensors: Sequence[TraceTensor],
        step_names: Sequence[str],
        costs: MechanismCosts,
    ) -> tuple[TraceUnit, ...]:
        """The candidates with inner tensors as trace units (``position``: store to trace vid)."""
        units = []
        for seen in self.seen.values():
            own = {i for i, step in enumerate(step_names) if in_backward(step, seen.name)}
            inputs = {position[v] for v in seen.input_vids if v in position}
            inner = tuple(
                position[v]
                for v in seen.vids
                if v in position
                and position[v] not in inputs
                and tensors[position[v]].use_steps
                and all(u in own for u in tensors[position[v]].use_steps)
            )
            if not inner or seen.same_as:
                continue
            unit = TraceUnit(
                name=seen.name,
                first_step=seen.first_step,
                last_step=seen.last_step,
                forward_s=seen.forward_s,
                inner_vids=inner,
                input_vids=tuple(sorted(inputs)),
                safe=not seen.why_unsafe,
                why_unsafe=seen.why_unsafe,
                working_bytes=seen.working_bytes,
            )
            units.append(dataclasses.replace(unit, overhead_s=costs.checkpoint_s))
        return tuple(units)
