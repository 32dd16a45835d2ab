"""The offloaded tensors of one session under one budget: pins, prefetches, room, write-backs.

Mechanism only: callers say which tensors a use needs and may want soon; the pool keeps the
tensors in memory within the budget (NOTE [write-back residency] in ``offload/offloaded.py``).
"""

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from vtensor.errors import InfeasibleBudgetError
from vtensor.io.transfer import TransferEngine
from vtensor.offload.offloaded import OffloadedTensor, Residency, ResidentMeter
from vtensor.planner.trace import TensorKind
from vtensor.sizes import format_bytes

if TYPE_CHECKING:
    from vtensor.offload.joint_side import JointSide


class OffloadPool:
    """Owns the session's offloaded tensors and the meter of their resident bytes.

    A *fixed* tensor (small, or in a ``resident`` module) never leaves memory but is counted.
    :meth:`connect`-ed to a joint iteration (NOTE [one plan] in ``offload/joint.py``), its
    listener sees every move and may hold tensors, and every read is announced first.
    """

    def __init__(
        self, engine: TransferEngine, meter: ResidentMeter, budget_bytes: int, chunk_bytes: int
    ) -> None:
        self.engine = engine
        self.meter = meter
        self.budget_bytes = budget_bytes
        self.chunk_bytes = chunk_bytes
        self.tensors: list[OffloadedTensor] = []
        self._fixed: set[int] = set()
        self._alive: set[int] = set()
        self.reserved_bytes = 0  # kept free for gradients backward is about to produce
        self._wanted_order = itertools.count()
        self._wanted_at: dict[int, int] = {}
        self.fixed_bytes = 0  # bytes of fixed tensors: always in memory
        self.listener: JointSide | None = None  # a joint step's (None outside one or its hold)
        self._before_allocate: Callable[[int], None] | None = None
        self._unoffloaded = 0  # NOTE [offload probe] in activations/offloads.py

    def adopt(
        self, tensor: torch.Tensor, name: str, kind: TensorKind, *, fixed: bool, used: bool = False
    ) -> OffloadedTensor:
        """Start managing ``tensor`` of ``kind`` (resident now, counted from now on).

        ``used``: a use holds it from the start (a gradient about to be used), pinned before
        anything could let it go; its end is a :meth:`release` as after :meth:`acquire`.
        """
        entry = OffloadedTensor(tensor, name, self.engine, self.meter, self.chunk_bytes, kind)
        self.tensors.append(entry)
        self._alive.add(id(entry))
        if fixed:
            self._fixed.add(id(entry))
            self.fixed_bytes += entry.nbytes
            entry.pins = 1
        elif kind is not TensorKind.STATE:
            self._unoffloaded += entry.nbytes
        if self.listener is not None:
            self.listener.adopted(entry)
        if used:
            if self.listener is not None:
                self.listener.used(entry)
            entry.pins += 1
        return entry

    def forget(self, entry: OffloadedTensor) -> None:
        """Stop managing ``entry`` (a gradient after its update, a replaced state tensor)."""
        if self.listener is not None:
            self.listener.forgotten(entry)
        if id(entry) in self._fixed:
            self.fixed_bytes -= entry.nbytes
        entry.discard()
        self.tensors.remove(entry)
        self._alive.discard(id(entry))
        self._fixed.discard(id(entry))
        self._wanted_at.pop(id(entry), None)

    def is_fixed(self, entry: OffloadedTensor) -> bool:
        """True for tensors that never leave memory."""
        return id(entry) in self._fixed

    @staticmethod
    def missing_bytes(entries: list[OffloadedTensor]) -> int:
        """Bytes of ``entries`` that would have to be allocated to bring them in."""
        return sum(e.nbytes for e in {id(e): e for e in entries}.values() if not e.in_memory)

    # -- uses ---------------------------------------------------------------------------------
    def acquire(self, entries: list[OffloadedTensor], what: str, extra_bytes: int = 0) -> None:
        """Pin ``entries`` for a use that allocates ``extra_bytes`` more; wait only on reads."""
        self.make_room(self.missing_bytes(entries) + extra_bytes, what)
        # Counted again: making room may have dropped some of ``entries`` themselves. The bytes
        # the use allocates are announced with the reads: they come without a hook point.
        self._announce(self.missing_bytes(entries) + extra_bytes)
        for entry in entries:
            if self.listener is not None:
                self.listener.used(entry)
            entry.pins += 1
            entry.wanted = False
            self._wanted_at.pop(id(entry), None)
            entry.fetch()
        for entry in entries:
            if entry.state is Residency.READING:
                entry.complete()

    def release(self, entry: OffloadedTensor) -> None:
        """End one use of ``entry``; with its last one it starts leaving memory."""
        if self.is_fixed(entry) or id(entry) not in self._alive:
            return  # never leaves, or forgotten during the use (a gradient after its update)
        assert entry.pins > 0, f"{entry.name!r} released more often than acquired"
        entry.pins -= 1
        if self.listener is not None:
            self.listener.released(entry)
        self.let_go(entry)

    def prefetch(self, entries: list[OffloadedTensor]) -> bool:
        """Start reading ``entries`` if they fit the budget now; False if they do not."""
        self.reap()
        missing = self.missing_bytes(entries)
        held = self.meter.resident_bytes + self.reserved_bytes
        if held + missing > self.budget_bytes:
            return False
        self._announce(missing)
        for entry in entries:
            if not entry.pins and not self.is_fixed(entry):
                entry.wanted = True
                self._wanted_at[id(entry)] = next(self._wanted_order)
            entry.fetch()
        return True

    def _announce(self, nbytes: int) -> None:
        if nbytes and self._before_allocate is not None:
            self._before_allocate(nbytes)

    def must_read(self, entry: OffloadedTensor) -> bool:
        """True if ``entry`` is managed and not in memory: holding it needs a read."""
        return not entry.in_memory and id(entry) in self._alive

    # -- a joint step (NOTE [one plan]) -------------------------------------------------------
    def connect(self, listener: "JointSide | None", before_allocate: Callable[[int], None]) -> None:
        """For one joint iteration: ``listener`` sees every move; reads and uses announced first."""
        self.listener = listener
        self._before_allocate = before_allocate
        self._unoffloaded = sum(e.nbytes for e in self.tensors if not self.is_fixed(e))

    def disconnect(self, *, keep_listener: bool) -> None:
        """End a joint iteration; a replayed plan's listener may keep holding its tensors."""
        self._before_allocate = None
        if not keep_listener:
            self.listener = None

    def let_go(self, entry: OffloadedTensor) -> None:
        """Move an unpinned, unwanted tensor toward the tier: drop if clean, else write."""
        if entry.pins or entry.wanted or self.is_fixed(entry) or not entry.done():
            return
        if self.listener is not None and self.listener.holds(entry):
            return
        entry.complete()
        if entry.state is not Residency.RESIDENT:
            return
        if entry.clean:
            entry.drop()
        else:
            entry.start_write()

    def reap(self, *, block: bool = False) -> None:
        """Finish transfers that are done (all when ``block``) and release what they freed."""
        for entry in self.tensors:
            if entry.state in (Residency.WRITING, Residency.READING) and (block or entry.done()):
                entry.complete()
            self.let_go(entry)

    def make_room(self, nbytes: int, what: str) -> None:
        """Free room for ``nbytes`` or raise: unwanted tensors first, then the latest prefetches."""
        self.reap()
        nbytes += self.reserved_bytes
        if self.meter.resident_bytes + nbytes <= self.budget_bytes:
            return
        for entry in self._victims():
            entry.complete()
            entry.wanted = False
            if not entry.clean:
                entry.start_write()
                entry.complete()
            entry.drop()
            if self.meter.resident_bytes + nbytes <= self.budget_bytes:
                return
        need = self.meter.resident_bytes + nbytes
        raise InfeasibleBudgetError(
            self.budget_bytes,
            need,
            what,
            f"{format_bytes(self.meter.resident_bytes)} of parameters, gradients and optimizer "
            f"state are in use and {format_bytes(nbytes)} more are needed",
        )

    def unoffloaded_bytes(self) -> int:
        """What its movable tensors would hold in memory now, were they never offloaded.

        Since :meth:`connect`: the tensors it had then and every gradient since, even one used
        and forgotten (autograd keeps each until ``zero_grad``); new optimizer state is left
        out (state to come, which the minimum counts apart).
        """
        return self._unoffloaded

    def largest_bytes(self) -> int:
        """Bytes of the largest movable tensor: it moves whole."""
        return max((e.nbytes for e in self.tensors if not self.is_fixed(e)), default=0)

    def _victims(self) -> list[OffloadedTensor]:
        movable = [e for e in self.tensors if e.in_memory and not e.pins and not self.is_fixed(e)]
        return sorted(movable, key=lambda e: (e.wanted, -self._wanted_at.get(id(e), 0)))

    def close(self) -> None:
        """Bring every tensor back into memory and wait for all transfers."""
        for entry in self.tensors:
            entry.fetch()
            entry.complete()
