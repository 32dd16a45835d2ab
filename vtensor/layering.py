"""Demand layering: run a model's forward with its parameters streamed layer by layer from a file.

NOTE [demand layering] (docs/demand-layering.md): a *layer* is a module that owns parameters or
persistent buffers directly, or a module named in ``group`` with its whole subtree. Between uses
each of its tensors is a ``meta`` placeholder that holds no memory; a forward pre-hook binds views
of the layer's bytes, a forward hook puts the placeholders back. The first forward loads each
layer synchronously and records the order of calls (a module called twice is two calls); later
forwards must follow that order, while a background thread reads up to ``lookahead`` calls ahead
with ``preadv`` into one preallocated buffer, at places fixed by the plan so that the steady
state allocates nothing and calls held together never overlap. A call whose forward encloses
other calls (a parent that owns a parameter) gets a buffer of its own.
"""

import logging
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from vtensor.budget import parse_bytes
from vtensor.errors import VTensorError
from vtensor.layer_placement import enclosing_calls, place_calls, ring_positions
from vtensor.weightfile import ALIGN_BYTES, TensorEntry, WeightFile, memory_at

logger = logging.getLogger(__name__)


class LayeringError(VTensorError):
    """The model cannot be run with demand layering as called; the message says what to change."""


@dataclass(frozen=True)
class LayeringReport:
    """What demand layering held and waited for, since it started or since ``reset_stats``.

    Attributes:
        model_bytes: bytes of every parameter and persistent buffer (the resident model's).
        buffer_bytes: bytes allocated for streamed tensors: the ring, enclosing calls' own
            buffers and ``resident`` modules (fixed once the first forward is planned).
        peak_live_bytes: most bytes of layers read (or being read) and not yet released at one
            moment, plus resident modules; counted exactly by the manager, 4 KiB-rounded.
        lookahead: calls read ahead of the running one (None: as far as the ring allows).
        layers, calls: modules with tensors, and layer calls per forward.
        forwards, bytes_read, read_s, stall_s: forwards run, bytes read, seconds the reader
            spent in reads and checksums, seconds forwards waited for reads.
    """

    model_bytes: int
    buffer_bytes: int
    peak_live_bytes: int
    lookahead: int | None
    layers: int
    calls: int
    forwards: int
    bytes_read: int
    read_s: float
    stall_s: float


@dataclass
class _Slot:
    """One managed tensor: ``module.<attr>``, read from ``entry``, at ``offset`` in its layer."""

    module: nn.Module
    attr: str
    is_param: bool
    entry: TensorEntry
    placeholder: torch.Tensor  # on meta: no memory
    offset: int = 0

    def bind(self, tensor: torch.Tensor) -> None:
        """Make ``tensor`` the module's attribute (a dict store: setattr costs ~7 us)."""
        if isinstance(self.module, nn.RNNBase):  # its setattr refreshes its flat weight list
            setattr(self.module, self.attr, tensor)
        elif self.is_param:
            self.module._parameters[self.attr] = tensor  # type: ignore[assignment]
        else:
            self.module._buffers[self.attr] = tensor


@dataclass
class _Layer:
    name: str
    module: nn.Module
    slots: list[_Slot]
    runs: list[tuple[int, list[tuple[int | None, int]]]]  # file offset, (buffer offset, bytes)
    nbytes: int  # the layer's buffer size


@dataclass
class _Call:
    layer: _Layer
    buffer: torch.Tensor  # uint8: a ring slice, or the call's own buffer
    ring_offset: int | None  # None: its own buffer
    bound: list[torch.Tensor]  # per slot, the view bound while the call runs


_PACK_BYTES = 64  # alignment of tensors in a buffer: a cache line, more than any dtype needs


def _round_up(nbytes: int, multiple: int) -> int:
    return -(-nbytes // multiple) * multiple


def _aligned_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 buffer of ``nbytes`` starting on a 4 KiB boundary (what O_DIRECT needs)."""
    raw = torch.empty(nbytes + ALIGN_BYTES, dtype=torch.uint8)
    start = -raw.data_ptr() % ALIGN_BYTES
    return raw[start : start + nbytes]


def _views(layer: _Layer, buffer: torch.Tensor) -> list[torch.Tensor]:
    views: list[torch.Tensor] = []
    for slot in layer.slots:
        end = slot.offset + slot.entry.nbytes
        view = buffer[slot.offset : end].view(slot.entry.dtype).view(slot.entry.shape)
        views.append(nn.Parameter(view, requires_grad=False) if slot.is_param else view)
    return views


def _make_layer(name: str, module: nn.Module, slots: list[_Slot], direct: bool) -> _Layer:
    """Place the slots' tensors in the layer's buffer and group their file bytes into runs.

    A run is a contiguous range of the file read with one ``preadv``: its pieces land at the
    tensors' places and the padding between tensors in a scratch buffer (None), so the buffer
    holds the tensors packed. ``O_DIRECT`` needs every piece 4 KiB-aligned: the padding stays.
    """
    align = ALIGN_BYTES if direct else _PACK_BYTES
    runs: list[tuple[int, list[tuple[int | None, int]]]] = []
    placed: dict[str, int] = {}
    end = file_end = 0
    for entry in sorted({s.entry.name: s.entry for s in slots}.values(), key=lambda e: e.offset):
        nbytes = _round_up(entry.nbytes, ALIGN_BYTES) if direct else entry.nbytes
        placed[entry.name] = at = _round_up(end, align)
        end = at + nbytes
        if runs and file_end <= entry.offset < file_end + ALIGN_BYTES:
            pieces = runs[-1][1]
            pieces += [(None, entry.offset - file_end), (at, nbytes)]
        else:
            runs.append((entry.offset, [(at, nbytes)]))
        file_end = entry.offset + nbytes
    for slot in slots:
        slot.offset = placed[slot.entry.name]
    return _Layer(name, module, slots, runs, _round_up(end, align))


class _Discovery(TorchFunctionMode):
    """First forward only: turns the use of an unloaded tensor into a LayeringError.

    A function mode, not a dispatch mode: it sees the parameters themselves and costs no imports
    (a Python dispatch mode pulls in sympy, ~70 MB of RSS). Reading metadata such as ``.shape``
    of an unloaded tensor is fine: only calls that return tensors (or fail) count as uses.
    """

    def __init__(self, owners: dict[int, tuple[str, str]], running: list[str]) -> None:
        super().__init__()
        self.owners = owners  # placeholder storage -> (tensor name, its module's name)
        self.running = running  # names of the modules whose forward is running, innermost last

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        metas = (
            t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_meta
        )
        owner = next(
            filter(None, (self.owners.get(t.untyped_storage()._cdata) for t in metas)), None
        )
        if owner is None:
            return func(*args, **(kwargs or {}))
        try:
            result = func(*args, **(kwargs or {}))
        except Exception:
            result = torch.empty(0)  # failed on the placeholder: a use
        if not isinstance(result, torch.Tensor):
            return result
        user = self.running[-1] if self.running else ""
        raise LayeringError(
            f"tensor {owner[0]!r} is used in the forward of module {user!r}, outside the "
            f"forward of its own module {owner[1]!r} (a tied weight used functionally, or a "
            f"parent reading a child's tensor): pass resident=[{owner[1]!r}] to keep it loaded, "
            f"or group=[{user!r}] to load it with that module as one layer"
        )


class DemandLayering:
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
        self._verify, self._drop_cache = verify, drop_page_cache
        self._direct = self.file.direct_fd is not None
        self._align = ALIGN_BYTES if self._direct else _PACK_BYTES
        self._scratch = memoryview(bytearray(ALIGN_BYTES))  # the file's padding lands here
        self._verified: set[str] = set()
        self._cond = threading.Condition()
        self._hooks: list[RemovableHandle] = []
        self._running_hooks: list[RemovableHandle] = []
        self._owners: dict[int, tuple[str, str]] = {}
        self._layers: list[_Layer] = []
        self._calls: list[_Call] | None = None  # None until the first forward is planned
        self._order: list[_Layer] = []
        self._events: list[tuple[bool, int]] = []
        self._running: list[str] = []
        self._discovery: _Discovery | None = None
        self._bound: dict[int, _Call] = {}
        self._live: dict[int, _Call] = {}
        self._reader: threading.Thread | None = None
        self._closing = self._active = self._reading = False
        self._failure: tuple[int, BaseException] | None = None
        self._cursor, self._next_read, self._read_done = -1, 0, 0
        self._model_bytes = self._resident_bytes = self._allocated_bytes = 0
        self._live_bytes = self._peak_live_bytes = self._forwards = self._bytes_read = 0
        self._read_s = self._stall_s = 0.0
        self._calls_per_forward = 0
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
        units: dict[str, list[_Slot]] = {}
        expected: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        seen: set[tuple[int, str]] = set()
        placeholders: dict[int, torch.Tensor] = {}
        for name, module in modules.items():
            outer = [
                u for u in sorted(group | resident) if u in ("", name) or name.startswith(u + ".")
            ]
            unit = outer[0] if outer else name
            params = [(a, t, True) for a, t in module._parameters.items() if t is not None]
            buffers = [(a, t, False) for a, t in module._buffers.items() if t is not None]
            for attr, tensor, is_param in params + buffers:
                key = f"{name}.{attr}" if name else attr
                if not is_param and attr in module._non_persistent_buffers_set:
                    continue
                expected[key] = (tuple(tensor.shape), tensor.dtype)
                if (id(module), attr) in seen:
                    continue
                seen.add((id(module), attr))
                placeholder = placeholders.get(id(tensor))
                if placeholder is None:
                    placeholder = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
                    if is_param:
                        placeholder = nn.Parameter(placeholder, tensor.requires_grad)
                    placeholders[id(tensor)] = placeholder
                    self._owners[placeholder.untyped_storage()._cdata] = (key, name)
                entry = TensorEntry(key, tensor.dtype, tuple(tensor.shape), 0, 0, None)
                units.setdefault(unit, []).append(_Slot(module, attr, is_param, entry, placeholder))
        self.file.check_matches(expected)
        for unit, slots in units.items():
            for slot in slots:
                slot.entry = self.file.entries[slot.entry.name]
                self._model_bytes += slot.entry.nbytes
                if unit in resident:
                    setattr(slot.module, slot.attr, self._read_resident(slot))
                else:
                    setattr(slot.module, slot.attr, slot.placeholder)
            if unit not in resident:
                self._add_layer(_make_layer(unit, modules[unit], slots, self._direct))
        kept = {id(p) for p in placeholders.values()}
        for name, tensor in [*self.model.named_parameters(), *self.model.named_buffers()]:
            if tensor.device.type == "meta" and id(tensor) not in kept:
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

    def _read_resident(self, slot: _Slot) -> torch.Tensor:
        tensor = self.file.read_tensor(slot.entry.name)
        self._resident_bytes += slot.entry.nbytes
        return nn.Parameter(tensor, requires_grad=False) if slot.is_param else tensor

    def _add_layer(self, layer: _Layer) -> None:
        self._layers.append(layer)
        enter = layer.module.register_forward_pre_hook(lambda *_: self._enter(layer))
        leave = layer.module.register_forward_hook(lambda *_: self._leave(layer), always_call=True)
        self._hooks += [enter, leave]

    # -- one forward ---------------------------------------------------------------------------

    def _start(self, *_: object) -> None:
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
        with self._cond:
            while self._reading:
                self._cond.wait()
            self._cursor, self._next_read, self._read_done = -1, 0, 0
            self._live.clear()
            self._failure = None
            self._active = True
            self._cond.notify_all()
        if self._calls is None:
            self._order, self._events, self._running = [], [], []
            self._discovery = _Discovery(self._owners, self._running)
            self._discovery.__enter__()  # type: ignore[no-untyped-call]

    def _enter(self, layer: _Layer) -> None:
        if self._calls is None:  # first forward: read now, into a buffer of its own
            j = len(self._order)
            self._order.append(layer)
            self._events.append((True, j))
            call = _Call(layer, _aligned_bytes(layer.nbytes), None, [])
            call.bound = _views(layer, call.buffer)
            self._add_live(layer.nbytes)
            self._account(*self._fill(layer, call.buffer))
        else:
            j = self._cursor + 1
            if j >= len(self._calls) or self._calls[j].layer is not layer:
                expected = self._calls[j].layer.name if j < len(self._calls) else "nothing"
                raise LayeringError(
                    f"module {layer.name!r} ran as layer call {j} of the forward, where the "
                    f"first forward ran {expected!r}: the order of calls changed (control flow "
                    "that depends on the input); demand layering needs the same order every "
                    "forward, so run such models resident or group the varying part"
                )
            call = self._calls[j]
            with self._cond:
                self._cursor = j
                if self._may_read():  # wake the reader only to read: each wake-up costs GIL turns
                    self._cond.notify_all()
                started = time.perf_counter()
                while self._read_done <= j and self._failure is None:
                    self._cond.wait()
                self._stall_s += time.perf_counter() - started
                if self._read_done <= j and self._failure is not None:
                    raise self._failure[1]
        self._bound[j] = call
        for slot, view in zip(layer.slots, call.bound, strict=True):
            slot.bind(view)

    def _leave(self, layer: _Layer) -> None:
        mine = [j for j, call in self._bound.items() if call.layer is layer]
        if not mine:
            return  # its pre-hook raised
        call = self._bound.pop(mine[-1])
        for slot in layer.slots:
            slot.bind(slot.placeholder)
        if self._calls is None:
            self._events.append((False, mine[-1]))
            self._add_live(-layer.nbytes)
        else:
            with self._cond:
                if self._live.pop(mine[-1], None) is not None:
                    self._add_live(-layer.nbytes)
                if self._may_read():
                    self._cond.notify_all()
        del call

    def _end(self, *_: object) -> None:
        failed = sys.exc_info()[1] is not None
        with self._cond:
            self._active = False
            while self._reading:
                self._cond.wait()
        for j in sorted(self._bound, reverse=True):  # left bound by an exception
            self._leave(self._bound[j].layer)
        with self._cond:
            self._live.clear()  # read ahead but never used, after an exception
            self._live_bytes = self._resident_bytes
        self._forwards += 1
        if self._discovery is not None:
            self._discovery.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            self._discovery = None
            if not failed:
                self._plan()
        elif self._calls is not None and self._cursor != len(self._calls) - 1 and not failed:
            raise LayeringError(
                f"the forward ran {self._cursor + 1} layer calls, the first forward ran "
                f"{len(self._calls)}: the order of calls changed; demand layering needs the same "
                "order every forward"
            )

    # -- the plan and the reader ---------------------------------------------------------------

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
        ring = _aligned_bytes(capacity)
        calls = []
        for j, layer in enumerate(self._order):
            offset = at.get(j)
            if offset is None:
                buffer = _aligned_bytes(layer.nbytes)
            else:
                buffer = ring[offset : offset + layer.nbytes]
            calls.append(_Call(layer, buffer, offset, _views(layer, buffer)))
        self._allocated_bytes = capacity + sum(
            layer.nbytes for j, layer in enumerate(self._order) if not sizes[j]
        )
        self._calls, self._calls_per_forward = calls, len(calls)
        for hook in self._running_hooks:
            hook.remove()
        self._reader = threading.Thread(
            target=self._read_loop, name="vtensor-layering", daemon=True
        )
        self._reader.start()
        logger.info(
            "demand layering: %d layers, %d calls per forward, ring %d bytes (model %d bytes), "
            "%d enclosing calls with their own buffers",
            len(self._layers),
            len(calls),
            capacity,
            self._model_bytes,
            len(enclosing),
        )

    def _may_read(self) -> bool:
        """Whether the next call may be read now (under the lock)."""
        assert self._calls is not None
        j = self._next_read
        if not self._active or self._failure is not None or j >= len(self._calls):
            return False
        if self._lookahead is not None and j > self._cursor + self._lookahead:
            return False
        call = self._calls[j]
        if call.ring_offset is None:
            return True
        begin, end = call.ring_offset, call.ring_offset + call.layer.nbytes
        return not any(
            held.ring_offset is not None
            and held.ring_offset < end
            and begin < held.ring_offset + held.layer.nbytes
            for held in self._live.values()
        )

    def _read_loop(self) -> None:
        assert self._calls is not None
        while True:
            with self._cond:
                while not self._closing and not self._may_read():
                    self._cond.wait()
                if self._closing:
                    return
                j = self._next_read
                call = self._calls[j]
                self._next_read, self._reading = j + 1, True
                self._live[j] = call
                self._add_live(call.layer.nbytes)
            failure: BaseException | None = None
            try:
                nbytes, seconds = self._fill(call.layer, call.buffer)
            except Exception as exc:  # raised in the forward that needs this call
                failure, nbytes, seconds = exc, 0, 0.0
            with self._cond:
                self._reading = False
                self._account(nbytes, seconds)
                if failure is None:
                    self._read_done = j + 1
                else:
                    self._failure = (j, failure)
                self._cond.notify_all()

    def _fill(self, layer: _Layer, buffer: torch.Tensor) -> tuple[int, float]:
        """Read ``layer``'s bytes into ``buffer`` (any thread; ``preadv`` releases the GIL)."""
        started = time.perf_counter()
        base = buffer.data_ptr()
        nbytes = 0
        for file_offset, pieces in layer.runs:
            views = [
                self._scratch[:n] if at is None else memory_at(base + at, n) for at, n in pieces
            ]
            self.file.read(file_offset, views, direct=self._direct)
            run_bytes = sum(n for _, n in pieces)
            if self._drop_cache and not self._direct:
                self.file.drop_cache(file_offset, run_bytes)
            nbytes += run_bytes
        for slot in layer.slots:
            name = slot.entry.name
            if self._verify == "always" or (self._verify == "first" and name not in self._verified):
                self.file.check_crc(slot.entry, memory_at(base + slot.offset, slot.entry.nbytes))
                self._verified.add(name)
        return nbytes, time.perf_counter() - started

    def _add_live(self, nbytes: int) -> None:
        self._live_bytes += nbytes
        self._peak_live_bytes = max(self._peak_live_bytes, self._live_bytes)

    def _account(self, nbytes: int, seconds: float) -> None:
        self._bytes_read += nbytes
        self._read_s += seconds

    # -- public ----------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward under ``torch.no_grad()``."""
        with torch.no_grad():
            return self.model(*args, **kwargs)

    def report(self) -> LayeringReport:
        """What was held and waited for since construction or the last ``reset_stats``."""
        with self._cond:
            return LayeringReport(
                model_bytes=self._model_bytes,
                buffer_bytes=self._allocated_bytes + self._resident_bytes,
                peak_live_bytes=self._peak_live_bytes,
                lookahead=self._lookahead,
                layers=len(self._layers),
                calls=self._calls_per_forward,
                forwards=self._forwards,
                bytes_read=self._bytes_read,
                read_s=self._read_s,
                stall_s=self._stall_s,
            )

    def reset_stats(self) -> None:
        """Start counting peaks, bytes and times afresh (the buffers stay)."""
        with self._cond:
            self._live_bytes = self._peak_live_bytes = self._resident_bytes
            self._forwards, self._bytes_read, self._read_s, self._stall_s = 0, 0, 0.0, 0.0

    def close(self) -> None:
        """Stop the reader and remove the hooks; the model's tensors stay meta placeholders."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._reader is not None:
            self._reader.join()
            self._reader = None
        for hook in self._hooks + self._running_hooks:
            hook.remove()
        self._hooks, self._running_hooks = [], []
        self._calls, self._order = None, []  # frees the buffers
        if self._own_file:
            self.file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
