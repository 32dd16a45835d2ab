"""The layers of a model under demand layering: the tensors each loads, where, and as what views.

A *slot* is one managed tensor of a module; a *layer* packs its slots' bytes in one buffer, read
in runs; a *call* is one use of a layer in the forward, with its buffer and views.
"""

from dataclasses import dataclass

import torch
from torch import nn

from vtensor.io.tiers import round_up
from vtensor.layering.weightfile import ALIGN_BYTES, TensorEntry


@dataclass
class Slot:
    """One managed tensor: ``module.<attr>``, read from ``entry``, at ``offset`` in its layer."""

    module: nn.Module
    attr: str
    is_param: bool
    entry: TensorEntry
    placeholder: torch.Tensor  # on meta: no memory
    offset: int = 0

    def bind(self, tensor: torch.Tensor) -> None:
        """Make ``tensor`` the module's attribute (a dict store, far cheaper than setattr)."""
        if isinstance(self.module, nn.RNNBase):  # its setattr refreshes its flat weight list
            setattr(self.module, self.attr, tensor)
        elif self.is_param:
            self.module._parameters[self.attr] = tensor  # type: ignore[assignment]
        else:
            self.module._buffers[self.attr] = tensor


@dataclass
class Layer:
    """A module's slots (or a grouped subtree's), packed in one buffer of ``nbytes``."""

    name: str
    module: nn.Module
    slots: list[Slot]
    runs: list[tuple[int, list[tuple[int | None, int]]]]  # file offset, (buffer offset, bytes)
    nbytes: int  # the layer's buffer size


@dataclass
class Call:
    """One use of a layer in the forward: the buffer it is read into and its bound views."""

    layer: Layer
    buffer: torch.Tensor  # uint8: a ring slice, or the call's own buffer
    ring_offset: int | None  # None: its own buffer
    bound: list[torch.Tensor]  # per slot, the view bound while the call runs


@dataclass
class ModelSlots:
    """A model's managed tensors, by the layer or resident module that loads them."""

    by_unit: dict[str, list[Slot]]
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]]  # tensor name -> shape, dtype
    owners: dict[int, tuple[str, str]]  # placeholder storage -> (tensor name, its module's name)


PACK_BYTES = 64  # alignment of tensors in a buffer: a cache line, more than any dtype needs


def aligned_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 buffer of ``nbytes`` starting on a 4 KiB boundary (what O_DIRECT needs)."""
    raw = torch.empty(nbytes + ALIGN_BYTES, dtype=torch.uint8)
    start = -raw.data_ptr() % ALIGN_BYTES
    return raw[start : start + nbytes]


def views(layer: Layer, buffer: torch.Tensor) -> list[torch.Tensor]:
    """Per slot of ``layer``, its tensor as a view of ``buffer`` (a Parameter for parameters)."""
    bound: list[torch.Tensor] = []
    for slot in layer.slots:
        end = slot.offset + slot.entry.nbytes
        view = buffer[slot.offset : end].view(slot.entry.dtype).view(slot.entry.shape)
        bound.append(nn.Parameter(view, requires_grad=False) if slot.is_param else view)
    return bound


def find_slots(modules: dict[str, nn.Module], units: set[str]) -> ModelSlots:
    """Every parameter and persistent buffer of ``modules``, as a slot with a meta placeholder.

    A module named in ``units`` takes the slots of its whole subtree; a shared tensor gets one.
    """
    found = ModelSlots({}, {}, {})
    seen: set[tuple[int, str]] = set()
    placeholders: dict[int, torch.Tensor] = {}
    for name, module in modules.items():
        outer = [u for u in sorted(units) if u in ("", name) or name.startswith(u + ".")]
        unit = outer[0] if outer else name
        params = [(a, t, True) for a, t in module._parameters.items() if t is not None]
        buffers = [(a, t, False) for a, t in module._buffers.items() if t is not None]
        for attr, tensor, is_param in params + buffers:
            key = f"{name}.{attr}" if name else attr
            if not is_param and attr in module._non_persistent_buffers_set:
                continue
            found.expected[key] = (tuple(tensor.shape), tensor.dtype)
            if (id(module), attr) in seen:
                continue
            seen.add((id(module), attr))
            placeholder = placeholders.get(id(tensor))
            if placeholder is None:
                placeholder = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
                if is_param:
                    placeholder = nn.Parameter(placeholder, tensor.requires_grad)
                placeholders[id(tensor)] = placeholder
                found.owners[placeholder.untyped_storage()._cdata] = (key, name)
            entry = TensorEntry(key, tensor.dtype, tuple(tensor.shape), 0, 0, None)
            found.by_unit.setdefault(unit, []).append(
                Slot(module, attr, is_param, entry, placeholder)
            )
    return found


def make_layer(name: str, module: nn.Module, slots: list[Slot], direct: bool) -> Layer:
    """Place the slots' tensors in the layer's buffer and group their file bytes into runs.

    A run is a contiguous range of the file read with one ``preadv``; the padding between
    tensors lands in a scratch buffer (None), so the buffer holds the tensors packed.
    """
    align = ALIGN_BYTES if direct else PACK_BYTES
    runs: list[tuple[int, list[tuple[int | None, int]]]] = []
    placed: dict[str, int] = {}
    end = file_end = 0
    for entry in sorted({s.entry.name: s.entry for s in slots}.values(), key=lambda e: e.offset):
        nbytes = round_up(entry.nbytes, ALIGN_BYTES) if direct else entry.nbytes
        placed[entry.name] = at = round_up(end, align)
        end = at + nbytes
        if runs and file_end <= entry.offset < file_end + ALIGN_BYTES:
            pieces = runs[-1][1]
            pieces += [(None, entry.offset - file_end), (at, nbytes)]
        else:
            runs.append((entry.offset, [(at, nbytes)]))
        file_end = entry.offset + nbytes
    for slot in slots:
        slot.offset = placed[slot.entry.name]
    return Layer(name, module, slots, runs, round_up(end, align))
