"""The parameter side of a profiled joint iteration (NOTE [one plan] in ``offload/joint.py``)."""

from dataclasses import dataclass, field

from vtensor.offload.offloaded import OffloadedTensor
from vtensor.offload.pool import OffloadPool
from vtensor.planner.trace import TensorKind, TraceTensor


@dataclass
class _Life:
    """What the recorder learns about one parameter-side tensor in one iteration."""

    nbytes: int
    dtype: str
    kind: TensorKind
    start: int
    existed: bool
    uses: set[int] = field(default_factory=set)
    pinned_at: int = -1
    end: int | None = None  # step at which it was forgotten
    dirty_step: int = -1


class ParamRecorder:
    """Listens to an ``OffloadPool`` during a profiled iteration (NOTE [one plan])."""

    def __init__(self, pool: OffloadPool) -> None:
        self.pool = pool
        self.step = 0
        self.created_state = False
        self._lives: dict[str, _Life] = {}
        for entry in pool.tensors:
            if not pool.is_fixed(entry):
                self._lives[entry.name] = self._life(entry, start=0, existed=True)

    @staticmethod
    def _life(entry: OffloadedTensor, start: int, existed: bool) -> _Life:
        dtype = str(entry.tensor.dtype).replace("torch.", "")
        return _Life(entry.nbytes, dtype, entry.kind, start, existed)

    # -- pool listener --------------------------------------------------------------------
    def adopted(self, entry: OffloadedTensor) -> None:  # noqa: D102
        if self.pool.is_fixed(entry):
            return
        if entry.kind is TensorKind.STATE:
            self.created_state = True  # a first update: later iterations will differ
        self._lives[entry.name] = self._life(entry, start=max(self.step, 0), existed=False)

    def used(self, entry: OffloadedTensor) -> None:  # noqa: D102
        life = self._lives.get(entry.name)
        if life is not None:
            if entry.pins == 0:
                life.pinned_at = self.step
            life.uses.add(self.step)

    def released(self, entry: OffloadedTensor) -> None:  # noqa: D102
        life = self._lives.get(entry.name)
        if life is None:
            return
        now = self.step
        if entry.pins == 0 and life.pinned_at >= 0:  # held from its pin to now: each step a use
            life.uses.update(range(life.pinned_at, now + 1))
            life.pinned_at = -1
        if not entry.clean:
            life.dirty_step = now

    def forgotten(self, entry: OffloadedTensor) -> None:  # noqa: D102
        life = self._lives.get(entry.name)
        if life is not None:
            now = self.step
            if life.pinned_at >= 0:
                life.uses.update(range(life.pinned_at, now + 1))
                life.pinned_at = -1
            life.uses.add(now)
            life.end = now

    def holds(self, entry: OffloadedTensor) -> bool:  # noqa: D102
        return False  # profiling: the pool's own policy decides

    # -- the iteration ----------------------------------------------------------------------
    def on_step(self, index: int) -> list[OffloadedTensor]:
        """Step ``index`` begins; nothing to read (profiling: the pool's own policy reads)."""
        self.step = index
        return []

    def read(self, entry: OffloadedTensor) -> None:
        """Never called: :meth:`on_step` asks for no reads."""
        raise AssertionError(f"a profiled iteration planned no read of {entry.name}")

    def resident_bytes(self) -> int:
        """Bytes of movable parameter-side tensors in memory (the trace plans them)."""
        return self.pool.meter.resident_bytes - self.pool.fixed_bytes

    def shed(self, nbytes: int) -> None:
        """Nothing is held while profiling: wait for the writes in flight."""
        self.pool.reap(block=True)

    def settle(self) -> None:
        """Wait for the pool's writes in flight, which hold their bytes until done."""
        self.pool.reap(block=True)

    def unoffloaded_bytes(self) -> int:
        """What its tensors would hold in memory now, were they never offloaded."""
        return self.pool.unoffloaded_bytes()

    def largest_bytes(self) -> int:
        """Bytes of its largest movable tensor, which moves whole."""
        return self.pool.largest_bytes()

    def pinned_bytes(self) -> int:
        """Bytes of movable parameter-side tensors that a use holds in memory now."""
        return self.pool.pinned_bytes()

    def trace_tensors(self, first_vid: int, n_steps: int) -> list[TraceTensor]:
        """The recorded tensors as trace tensors, by name, numbered from ``first_vid``."""
        tensors: list[TraceTensor] = []
        for name in sorted(self._lives):
            life = self._lives[name]
            now = n_steps - 1
            if life.pinned_at >= 0:  # still pinned when the iteration ended
                life.uses.update(range(life.pinned_at, now + 1))
            uses = tuple(sorted(u for u in life.uses if 0 <= u < n_steps))
            start = 0 if life.existed else min(life.start, n_steps - 1)
            tensors.append(
                TraceTensor(
                    vid=first_vid + len(tensors),
                    nbytes=life.nbytes,
                    dtypes=(life.dtype,),
                    saved_step=start,
                    evictable_step=start,
                    use_steps=tuple(u for u in uses if u >= start),
                    kind=life.kind,
                    name=name,
                    persistent=life.end is None,
                    whole=True,
                    dirty_step=life.dirty_step,
                )
            )
        return tensors
