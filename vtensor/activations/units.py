"""While profiling: which modules could be recomputed, what each saves, and whether it is safe.

NOTE [safe to recompute]
A recomputed forward must give back exactly what the first one saved, or backward computes a
silently wrong gradient. While an iteration is profiled, each candidate module (every module
with children, below the root) is checked as it runs, and marked unsafe, never to be
recomputed, when it:

- modifies an input in place (its inputs' version counters moved): a second forward would
  start from other values;
- calls a custom autograd ``Function`` (a ``BackwardCFunction`` node in the graph it built):
  its ``forward`` may have side effects that a second run repeats (the manager's own mask
  encoding has none: NOTE [mask encoding] in ``activations/encodings.py``);
- changes a plain attribute of itself or a submodule (a call counter, a cached flag): a second
  run would see or change other state;
- does not reproduce its outputs bit for bit when run again at once from the same inputs, the
  same RNG state and the same buffers (randomness outside torch's generators, state outside the
  module, data-dependent behaviour that the inputs do not determine);
- runs more than once per iteration (a shared module): its saved tensors have no one span.

A safe unit is also profiled for selective recomputation (``selective_profile.py``, NOTE
[selective recompute] in ``activations/selective.py``): a second run of its forward finds which
of its saved tensors product ops made, the time of the rest, and whether SAC's cache would be
modified in place (a product output modified in its forward, or leaving it), which makes it
unsafe to recompute selectively.

The check runs its forward a second time (without autograd), the selective profile a third
(with it), and both times are excluded from the step's measured duration. Control flow that
depends only on the inputs is safe: a second run
takes the same branch. What no check can see (a side effect outside Python attributes and
tensors, such as a write to a file) stays the user's to exclude.

NOTE [no room to recompute]
Recomputing a unit holds what its forward held (NOTE [recomputation's working set] in
``recorder.py``), whole or selectively (SAC's cache holds the product outputs from the forward
on), on top of at least the bytes the iteration began with (parameters, gradients, state,
inputs). A unit whose forward held more than the budget leaves beside those can never be
recomputed within it, so it is marked so and not checked: its checks ran its forward three
times more after making room for all it held, evicting what the rest of the iteration then
brought back. On the main job's CNN at its micro class's budget (25.9 MiB), the whole feature
extractor held 43.6 MiB: with its checks, the profiled step swapped 48 MiB out, 38 MiB of it to
make room for checks, and took 455 ms; without them 35 MiB (24 MiB) and 365 ms.

NOTE [one unit per tensors]
A module whose forward saved exactly what one of its children's did (a residual block's
wrapper around its body, whose add saves nothing) frees the same bytes recomputed, at the cost
of its child's forward and its own ops: it is no candidate of its own, and is left out of the
units unchecked. On the main job's CNN nine of its 47 units (``features.1`` to ``features.9``
around their ``body``) were such wrappers: their checks ran a third of the profile's forwards
again, and the covers took a wrapper or its body by the noise of their measured times.

NOTE [unit time]
A unit's forward time, what recomputing it whole costs, is that of the check's second run:
its forward alone. The first run's window held the profiled iteration's work at every hook
point and, as each unit inside it ended, that unit's snapshot, check and selective profile:
the main job's CNN's blocks measured 1.2-31 ms where recomputing one cost 0.3-5.3 ms, the
more so the more units a block holds (benchmarks/README.md, ``recompute_cost``), so the planner
ranked recomputing whole dearer than it is and took selective recomputation instead. What
the mechanism that runs it again costs of its own is added to it (NOTE [mechanism cost] in
``activations/rerun_cost.py``). What stays out: the second run has no autograd (a
recomputation has, for the graph it rebuilds, where one node's first run has none), and the
recomputation's allocations in backward (fresh pages under glibc's default settings): on the
main job's CNN a block recomputed whole behind one node was predicted at 0.6-2.8 ms and added
0.9-3.9 ms to the step, every block at once 12.8 ms against 14.8 ms. It runs
twice and the lesser time counts: one run alone put a stage of the main job's CNN at 4.2 ms in
one process and 3.4 ms in two others, enough to change the cheapest cover of its smallest
class (``features.1, features.2.body, features.3`` instead of ``features.2, features.3``).
"""

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from vtensor.activations.hooks import Removable
from vtensor.activations.rebuild import one_node
from vtensor.activations.recompute import CallSnapshot
from vtensor.activations.recorder import UnitHighs
from vtensor.activations.rerun_cost import MechanismCosts
from vtensor.activations.selective_profile import (
    ProfileTarget,
    SelectiveProfile,
    StartState,
    profile_selective,
    with_selective,
)
from vtensor.activations.store import ChunkStore, VTensor
from vtensor.activations.unit_checks import OpenUnit, cuda_rng, plain_attributes, why_unsafe
from vtensor.measure.clock import device_now
from vtensor.outputs import tensors_in
from vtensor.planner.recomputed import in_backward, through_one_node
from vtensor.planner.trace import TraceTensor, TraceUnit
from vtensor.sizes import format_bytes


class UnitTarget(ProfileTarget, Protocol):
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
    selective: SelectiveProfile | None = None
    output_bytes: int = 0
    one_node: bool = False
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

    def install(self) -> list[Removable]:
        """Hook every module with children below the root."""
        handles: list[Removable] = []
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
        # The checks run its forward again, thrice, where no reading sees them: room for what it
        # held, as for a recomputation (NOTE [recomputation's working set] in recorder.py).
        self.target.make_room(working)
        why, again_s = why_unsafe(module, opened, output, self.target)
        forward_s = again_s or forward_s  # NOTE [unit time]
        selective = None
        if not why:
            start = StartState(opened.rng, opened.cuda_rng, opened.buffers)
            call = opened.call.copy()
            selective = profile_selective(
                module, start, call, vids, self.records, self.target, forward_s
            )
        whole = not why and one_node(module, output, [t for t, _ in opened.versions])
        self.target.exclude_time(time.perf_counter() - began)
        returned = {t.untyped_storage().data_ptr(): t.nbytes for t in tensors_in(output)}
        self.seen[name] = _Seen(
            name, opened.first_step, self.target.step_index, forward_s, vids, inputs, why
        )
        self.seen[name].selective = selective
        self.seen[name].output_bytes = sum(returned.values())
        self.seen[name].one_node = whole
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
        """The candidates as trace units (``position``: store vid -> trace vid).

        A unit's inner tensors are those saved inside its forward, not its inputs, and used
        only by backward steps of itself or its submodules; units without any are left out.
        ``costs``: what each way of recomputing costs beyond the unit's ops (NOTE [mechanism
        cost] in ``activations/rerun_cost.py``).
        """
        units = []
        sizes = [t.nbytes for t in tensors]
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
                why_not_selective=seen.why_unsafe or "not profiled",
                output_bytes=seen.output_bytes,
                one_node=seen.one_node,
                working_bytes=seen.working_bytes,
            )
            if seen.selective is not None:
                unit = with_selective(unit, seen.selective, position, costs, sizes)
            # After its tail is known: a long one keeps it with checkpointing.
            way_s = costs.one_node_s if through_one_node(unit) else costs.checkpoint_s
            units.append(dataclasses.replace(unit, overhead_s=way_s))
        return tuple(units)
