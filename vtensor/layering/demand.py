"""Demand layering: run a model's forward with its parameters streamed layer by layer from a file.

NOTE [demand layering] (docs/demand-layering.md): a *layer* is a module that owns parameters or
persistent buffers directly, or a module named in ``group`` with its subtree. Between uses its
tensors are ``meta`` placeholders; a forward pre-hook binds views of the layer's bytes and a
forward hook puts the placeholders back. The first forward loads each layer synchronously and
records the order of calls; later forwards follow it while a thread reads up to ``lookahead``
calls ahead into one preallocated buffer, at places fixed so the steady state allocates nothing.
A call whose forward encloses other calls gets a buffer of its own.
"""

import logging
import sys
from collections.abc import Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from vtensor.errors import LayeringError
from vtensor.layering.discovery import Discovery
from vtensor.layering.placement import enclosing_calls, place_calls, ring_positions
from vtensor.layering.reader import LayerReader
from vtensor.layering.records import (
    PACK_BYTES,
    Call,
    Layer,
    Slot,
    aligned_bytes,
    find_slots,
    make_layer,
    views,
)
from vtensor.layering.report import LayeringReport
from vtensor.layering.weightfile import ALIGN_BYTES, WeightFile
from vtensor.sizes import parse_bytes

__all__ = ["DemandLayering", "LayeringError", "LayeringReport"]

logger = logging.getLogger(__name__)


class DemandLayering(AbstractContextManager["DemandLayering"]):
    """Runs ``model``'s forward with its tensors streamed from a weight file, layer by layer.

    Usage::

        vtensor.write_weights(model.state_dict(), "model.vtw")
        with torch.device("meta"):
            model = build_model()  # no memory for parameters
        with vtensor.DemandLayering(model.eval(), "model.vtw", lookahead=1) as layered:
            logits = layered(x)  # or model(x) under torch.no_grad()
            print(layered.report())

    Args:
        model: the model in eval mode. Its parameters and persistent buffers may be on ``meta``;
            materialised ones are dropped (the weight file is the copy that is used).
        weights: path of a weight file (``vtensor.write_weights`` or safetensors), or an open
            ``WeightFile``.
        lookahead: calls read ahead of the running one (0: each is read just before it runs).
            Default 1, or as far as ``buffer_bytes`` has room when only that is given.
        buffer_bytes: the ring buffer's size, e.g. ``"64MiB"`` (default: the least that never
            makes a read wait for room at ``lookahead``).
        group: names of modules loaded as one layer with their whole subtree.
        resident: names of modules whose tensors are read once and kept.
        verify: check tensors' CRC-32 on the ``"first"`` read of each, ``"always"`` or ``"never"``.
        drop_page_cache: drop what was read from the page cache (``POSIX_FADV_DONTNEED``), so
            the file's bytes do not stay in RAM as cache; every forward then reads storage.
        direct_io: read with ``O_DIRECT``, bypassing the page cache (this project's format).
    """

    def __init__(
        self,
        model: nn.Module,
        weights: str | Path | WeightFile,
        *,
        lookahead: int | None = None,
        buffer_bytes: int | str | None = None,
        group: Iterable[str] = (),
        resident: Iterable[str] = (),
        verify: str = "first",
        drop_page_cache: bool = False,
        direct_io: bool = False,
    ) -> None:
        if (lookahead is not None and lookahead < 0) or verify not in ("first", "always", "never"):
            raise LayeringError(
                f"lookahead={lookahead!r} must be >= 0 and verify={verify!r} one of 'first', "
                "'always', 'never'"
            )
        self.model = model
        self._own_file = not isinstance(weights, WeightFile)
        self.file = (
            weights if isinstance(weights, WeightFile) else WeightFile(weights, direct_io=direct_io)
        )
        self._ring_limit = (
            None if buffer_bytes is None else parse_bytes(buffer_bytes, what="buffer_bytes")
        )
        self._lookahead = 1 if lookahead is None and buffer_bytes is None else lookahead
        self._reader = LayerReader(
            self.file, lookahead=self._lookahead, verify=verify, drop_page_cache=drop_page_cache
        )
        self._align = ALIGN_BYTES if self._reader.direct else PACK_BYTES
        self._hooks: list[RemovableHandle] = []
        self._running_hooks: list[RemovableHandle] = []
        self._owners: dict[int, tuple[str, str]] = {}
        self._layers: list[Layer] = []
        self._order: list[Layer] = []
        self._events: list[tuple[bool, int]] = []
        self._running: list[str] = []
        self._discovery: Discovery | None = None
        self._bound: dict[int, Call] = {}
        self._model_bytes = self._resident_bytes = self._allocated_bytes = 0
        self._forwards = self._calls_per_forward = 0
        try:
            self._build(set(group), set(resident))
        except BaseException:
            self.close()
            raise
        self.reset_stats()

    def _build(self, group: set[str], resident: set[str]) -> None:
        modules = dict(self.model.named_modules(remove_duplicate=False))
        self._modules = list(self.model.modules())
        unknown = sorted((group | resident) - modules.keys())
        if unknown:
            raise LayeringError(f"group/resident name modules {unknown} that the model lacks")
        found = find_slots(modules, group | resident)
        self._owners = found.owners
        self.file.check_matches(found.expected)
        for unit, slots in found.by_unit.items():
            for slot in slots:
                slot.entry = self.file.entries[slot.entry.name]
                self._model_bytes += slot.entry.nbytes
                if unit in resident:
                    setattr(slot.module, slot.attr, self._read_resident(slot))
                else:
                    setattr(slot.module, slot.attr, slot.placeholder)
            if unit not in resident:
                self._add_layer(make_layer(unit, modules[unit], slots, self._reader.direct))
        for name, tensor in [*self.model.named_parameters(), *self.model.named_buffers()]:
            _check_host(f"{name!r}", tensor, "cpu", "meta")  # meta: the placeholders
            if tensor.device.type == "meta" and tensor.untyped_storage()._cdata not in self._owners:
                raise LayeringError(
                    f"{name!r} is on the meta device and not in the weight file (a non-persistent "
                    "buffer): materialise it (model.to_empty(device='cpu') and initialise it) "
                    "before demand layering"
                )
        self._hooks.append(self.model.register_forward_pre_hook(self._start, prepend=True))
        self._hooks.append(self.model.register_forward_hook(self._end, always_call=True))
        for name, module in self.model.named_modules():  # who runs, for the first forward
            push = module.register_forward_pre_hook(
                lambda *_, name=name: self._running.append(name)
            )
            pop = module.register_forward_hook(self._pop_running, always_call=True)
            self._running_hooks += [push, pop]

    def _pop_running(self, *_: object) -> None:
        if self._running:
            self._running.pop()

    def _read_resident(self, slot: Slot) -> torch.Tensor:
        tensor = self.file.read_tensor(slot.entry.name)
        self._resident_bytes += slot.entry.nbytes
        return nn.Parameter(tensor, requires_grad=False) if slot.is_param else tensor

    def _add_layer(self, layer: Layer) -> None:
        self._layers.append(layer)
        enter = layer.module.register_forward_pre_hook(lambda *_: self._enter(layer))
        leave = layer.module.register_forward_hook(lambda *_: self._leave(layer), always_call=True)
        self._hooks += [enter, leave]

    # -- one forward ---------------------------------------------------------------------------

    def _start(self, _: nn.Module, args: tuple[Any, ...]) -> None:
        for i, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                _check_host(f"input {i}", arg, "cpu")
        if torch.is_grad_enabled():
            raise LayeringError(
                "demand layering runs inference only: call the model under torch.no_grad() or "
                "torch.inference_mode() (or call the DemandLayering object, which does)"
            )
        if any(m.training for m in self._modules):
            raise LayeringError(
                "the model is in training mode (BatchNorm statistics would be updated in a "
                "buffer that is released, dropout would be on): call model.eval() first"
            )
        self._reader.begin_forward()
        if self._reader.calls is None:
            self._order, self._events, self._running = [], [], []
            self._discovery = Discovery(self._owners, self._running)
            self._discovery.__enter__()  # type: ignore[no-untyped-call]

    def _enter(self, layer: Layer) -> None:
        calls = self._reader.calls
        if calls is None:  # first forward: read now, into a buffer of its own
            j = len(self._order)
            self._order.append(layer)
            self._events.append((True, j))
            call = Call(layer, aligned_bytes(layer.nbytes), None, [])
            call.bound = views(layer, call.buffer)
            self._reader.add_live(layer.nbytes)
            self._reader.fill(layer, call.buffer)
        else:
            j = self._reader.cursor + 1
            if j >= len(calls) or calls[j].layer is not layer:
                expected = calls[j].layer.name if j < len(calls) else "nothing"
                raise LayeringError(
                    f"module {layer.name!r} ran as layer call {j} of the forward, where the "
                    f"first forward ran {expected!r}: the order of calls changed (control flow "
                    "that depends on the input); demand layering needs the same order every "
                    "forward, so run such models resident or group the varying part"
                )
            call = calls[j]
            self._reader.wait_for(j)
        self._bound[j] = call
        for slot, view in zip(layer.slots, call.bound, strict=True):
            slot.bind(view)

    def _leave(self, layer: Layer) -> None:
        mine = [j for j, call in self._bound.items() if call.layer is layer]
        if not mine:
            return  # its pre-hook raised
        j = mine[-1]
        del self._bound[j]
        for slot in layer.slots:
            slot.bind(slot.placeholder)
        if self._reader.calls is None:
            self._events.append((False, j))
            self._reader.add_live(-layer.nbytes)
        else:
            self._reader.release(j)

    def _end(self, *_: object) -> None:
        failed = sys.exc_info()[1] is not None
        self._reader.stop_forward()
        for j in sorted(self._bound, reverse=True):  # left bound by an exception
            self._leave(self._bound[j].layer)
        self._reader.drop_unused(self._resident_bytes)  # read ahead but never used
        self._forwards += 1
        calls = self._reader.calls
        if self._discovery is not None:
            self._discovery.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            self._discovery = None
            if not failed:
                self._plan()
        elif calls is not None and self._reader.cursor != len(calls) - 1 and not failed:
            raise LayeringError(
                f"the forward ran {self._reader.cursor + 1} layer calls, the first forward ran "
                f"{len(calls)}: the order of calls changed; demand layering needs the same "
                "order every forward"
            )

    # -- the plan --------------------------------------------------------------------------------

    def _plan(self) -> None:
        enclosing = enclosing_calls(self._events)
        sizes = [0 if j in enclosing else layer.nbytes for j, layer in enumerate(self._order)]
        largest = max(sizes, default=0)
        if self._ring_limit is None:
            lookahead = len(sizes) if self._lookahead is None else self._lookahead
            at, capacity = place_calls(sizes, lookahead)
        elif self._ring_limit < largest:
            name = self._order[sizes.index(largest)].name
            raise LayeringError(
                f"buffer_bytes={self._ring_limit} is below the largest layer ({name!r}, "
                f"{largest} bytes): raise it to at least {largest}"
            )
        else:  # a ring: each call after the previous one, wrapping to 0 at the end
            capacity = self._ring_limit // self._align * self._align
            ring_calls = [j for j, size in enumerate(sizes) if size]
            positions = ring_positions([sizes[j] for j in ring_calls], capacity)
            at = dict(zip(ring_calls, positions, strict=True))
        ring = aligned_bytes(capacity)
        self._allocated_bytes = capacity
        calls = []
        for j, layer in enumerate(self._order):
            offset = at.get(j)
            if offset is None:  # not in the ring: a buffer of its own
                buffer = aligned_bytes(layer.nbytes)
                self._allocated_bytes += layer.nbytes
            else:
                buffer = ring[offset : offset + layer.nbytes]
            calls.append(Call(layer, buffer, offset, views(layer, buffer)))
        self._calls_per_forward = len(calls)
        for hook in self._running_hooks:
            hook.remove()
        self._reader.start(calls)
        logger.info(
            "demand layering: %d layers, %d calls per forward, ring %d bytes (model %d bytes), "
            "%d enclosing calls with their own buffers",
            len(self._layers),
            len(calls),
            capacity,
            self._model_bytes,
            len(enclosing),
        )

    # -- public ----------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward under ``torch.no_grad()``."""
        with torch.no_grad():
            return self.model(*args, **kwargs)

    def report(self) -> LayeringReport:
        """What was held and waited for since construction or the last ``reset_stats``."""
        reader = self._reader
        with reader.cond:
            return LayeringReport(
                model_bytes=self._model_bytes,
                buffer_bytes=self._allocated_bytes + self._resident_bytes,
                peak_live_bytes=reader.peak_live_bytes,
                lookahead=self._lookahead,
                layers=len(self._layers),
                calls=self._calls_per_forward,
                forwards=self._forwards,
                bytes_read=reader.bytes_read,
                read_s=reader.read_s,
                stall_s=reader.stall_s,
            )

    def reset_stats(self) -> None:
        """Start counting peaks, bytes and times afresh (the buffers stay)."""
        with self._reader.cond:
            self._reader.reset_stats(self._resident_bytes)
            self._forwards = 0

    def close(self) -> None:
        """Stop the reader and remove the hooks; the model's tensors stay meta placeholders."""
        self._reader.close()  # frees the calls' buffers
        for hook in self._hooks + self._running_hooks:
            hook.remove()
        self._hooks, self._running_hooks = [], []
        self._order = []
        if self._own_file:
            self.file.close()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _check_host(what: str, tensor: torch.Tensor, *allowed: str) -> None:
    """Demand layering reads weights into host memory: the model and its inputs are on the CPU."""
    if tensor.device.type not in allowed:
        raise LayeringError(
            f"{what} is on {tensor.device}: demand layering streams weights from the file into "
            "host memory and runs on the CPU only; move the model and its inputs to the CPU "
            "(model.cpu(), x.cpu())"
        )
