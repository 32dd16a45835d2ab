"""Sparse replays whose saved-tensor hooks are in force only around the saves their plan moves.

NOTE [windowed saves]
A sparse replay (NOTE [sparse replay] in ``activations/sparse.py``) still ran the manager's
saved-tensor hooks on every saved tensor of the step: two Python calls from autograd each, to
place every saved storage in the plan by position and size, though most of them its plan never
moves (NOTE [passed] in ``activations/lean.py``). A windowed replay pushes the hooks only for
the module calls ("windows") inside which the plan's moved storages are saved, and pops them as
the call returns: the saves outside every window go to autograd as they would without the
manager, with autograd's own check of in-place changes.

Windows are module calls, not steps. A step runs from one module's pre-hook to the next one's,
and a context pushed inside a module (torch's checkpointing, a selective recomputation) may be
popped in the middle of a step: hooks pushed and popped at step boundaries would pop another's.
A module call is pushed by its forward pre-hook and popped by its forward hook (``always_call``,
so an exception pops it too), around whatever the module's forward pushes and pops itself. A
call is the ``k``-th call of its module in forward (a recomputation's calls and backward's are
not counted), as a sparse replay counts its acting steps.

What a windowed replay sees is learned, not guessed. The checking replays that prove a sparse
replay's counting (every ``QUIET_RUN + 1``-th lean replay, NOTE [quiet replay]) run the hooks
for the whole step, and log each save that reaches them with its plan position and the module
calls open around it (``SaveLog``): those at whose start nothing but the manager's own hooks
were in force, since where another's are, a windowed replay cannot push its own under them.
From the log, ``windows_of`` takes, for every save of a moved storage, the innermost such call
around it, and replays the log to find the positions a windowed replay places, in the order it
meets them (a storage first saved outside every window is placed at its first save inside one).
A plan replays windowed only once a check agreed (``QuietTurns.prove``), and only with the
windows of the last check; where a moved storage is saved outside every module call (by the
loss, after the model's forward), it replays with the hooks for the whole step, as before.

What it gives up: a windowed replay matches only the saves inside its windows with the plan,
so a run that leaves the plan outside them is noticed only at the next acting step or at the
end of backward, where fewer saves than the plan's leave it; and the guard that takes over can
evict only what was saved inside a window. A change of the run cannot make it swap wrongly: a
storage saved outside the windows is never evicted (autograd's own reference to it pins it, as
any reference outside the store does: ``ChunkStore.evictable``), and one placed at another's
position is swapped and restored as any other, its bytes unchanged.
"""

import contextlib
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from vtensor.activations.executor import PlanExecutor
from vtensor.activations.model_state import ModelScan
from vtensor.activations.store import VTensor

Call = tuple[str, int]  # a module's step name and the number of its forward call, from 0
_top_hooks: Callable[[bool], Any] = torch._C._autograd._top_saved_tensors_default_hooks
_graph_task: Callable[[], int] = torch._C._current_graph_task_id


@dataclass(frozen=True)
class SaveWindows:
    """The module calls a windowed replay hooks saves in, and the plan positions it places."""

    calls: frozenset[Call]
    order: tuple[int, ...]  # plan positions, in the order a windowed replay first sees them


class Counting(Protocol):
    """What a call counter asks of the iteration."""

    recomputing: int


def _counted(iteration: Counting) -> bool:
    """Whether a module call now is one of forward's (not a recomputation's or backward's)."""
    return not iteration.recomputing and _graph_task() == -1


class SaveLog:
    """A checking replay's saves, each with the module calls open around it (``windows_of``)."""

    def __init__(
        self, names: Mapping[int, str], executor: PlanExecutor, iteration: Counting
    ) -> None:
        self._names = names
        self._executor = executor
        self._iteration = iteration
        self.pack: Callable[..., Any] | None = None  # the manager's pack hook, once pushed
        self._calls: dict[str, int] = {}
        self._open: list[tuple[Call, bool] | None] = []  # (call, pushable); None: not counted
        self.events: list[tuple[int, tuple[Call, ...]]] = []
        self.complete = True  # False: a save whose position is unknown
        self._handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post, always_call=True),
        ]

    def _pre(self, module: nn.Module, _args: Any) -> None:
        name = self._names.get(id(module))
        if not name:
            return
        if not _counted(self._iteration):
            self._open.append(None)
            return
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        top = _top_hooks(False)
        self._open.append(((name, call), top is not None and top[0] is self.pack))

    def _post(self, module: nn.Module, _args: Any, _output: Any) -> None:
        if self._names.get(id(module)) and self._open:
            self._open.pop()

    def passed(self, position: int) -> None:
        """A save of the storage at ``position``, left to autograd."""
        self.events.append((position, tuple(c for c, ok in filter(None, self._open) if ok)))

    def adopted(self, record: VTensor) -> None:
        """A save of ``record``'s storage."""
        position = self._executor.position_of(record)
        if position is None:
            self.complete = False
            return
        self.passed(position)

    def windows(self) -> "SaveWindows | None":
        """The windows of the saves logged (``windows_of``); None where there are none."""
        if not self.complete:
            return None
        return windows_of(self.events, self._executor.moved)

    def remove(self) -> None:
        """Take its module hooks off."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def windows_of(
    events: Iterable[tuple[int, tuple[Call, ...]]], moved: Collection[int]
) -> SaveWindows | None:
    """The windows of a step whose saves were ``events`` (NOTE [windowed saves]).

    ``events``: each save's plan position and the calls open around it that a windowed replay
    could push its hooks at, outermost first. ``moved``: the plan positions the plan moves.
    None where a moved storage is saved outside every such call, or nothing moves.
    """
    events = list(events)
    calls: set[Call] = set()
    for position, open_calls in events:
        if position in moved:
            if not open_calls:
                return None
            calls.add(open_calls[-1])
    if not calls:
        return None
    order: list[int] = []
    seen: set[int] = set()
    for position, open_calls in events:
        if position not in seen and not calls.isdisjoint(open_calls):
            seen.add(position)
            order.append(position)
    return SaveWindows(frozenset(calls), tuple(order))


class WindowedSaves:
    """A windowed replay's hooks: ``pack`` and ``unpack`` pushed around its windows' calls."""

    def __init__(
        self,
        model: nn.Module,
        scan: ModelScan,
        windows: SaveWindows,
        hooks: tuple[Callable[..., Any], Callable[..., Any]],
        iteration: Counting,
    ) -> None:
        self._windows = windows.calls
        self._iteration = iteration
        self._context = saved_tensors_hooks(*hooks)
        # What is in force as the step begins: a window pushes only over that (NOTE [windowed
        # saves]), as a check's call is pushable only where the manager's hooks are on top.
        base = _top_hooks(False)
        self._base = base[0] if base is not None else None
        self._calls: dict[str, int] = {}
        self._pushed: list[bool] = []
        self._handles: list[Any] = []
        for name in sorted({name for name, _ in windows.calls}):  # by name: at every step
            module = scan.module(model, name)
            if module is not None:
                self._handles.append(module.register_forward_pre_hook(self._before(name)))
                self._handles.append(module.register_forward_hook(self._after, always_call=True))

    def _before(self, name: str) -> Callable[..., None]:
        def pre(_module: nn.Module, _args: Any) -> None:
            push = False
            if _counted(self._iteration):
                call = self._calls.get(name, 0)
                self._calls[name] = call + 1
                if (name, call) in self._windows:
                    top = _top_hooks(False)
                    push = (top[0] if top is not None else None) is self._base
            if push:
                self._context.__enter__()
            self._pushed.append(push)

        return pre

    def _after(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        if self._pushed and self._pushed.pop():
            self._context.__exit__(None, None, None)

    def remove(self) -> None:
        """Take its hooks off; pop what an unfinished call left pushed."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        while self._pushed:
            if self._pushed.pop():
                with contextlib.suppress(RuntimeError):
                    self._context.__exit__(None, None, None)
