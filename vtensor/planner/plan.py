"""Swap plans as plain data: which chunks of which vTensor leave and return at which step."""

import hashlib
import json
from dataclasses import dataclass, fields
from typing import Any

PLAN_SCHEMA_VERSION = 14


@dataclass(frozen=True)
class TensorMove:
    """The swap of one vTensor (a saved storage of the trace, by ``vid``).

    Attributes:
        vid: the vTensor, as numbered in the trace (order of first save).
        evict_bytes: bytes that leave the device: a whole number of tail chunks (at tensor
            granularity, the whole tensor).
        evict_step: step at which the eviction is issued (at or after the trace's
            ``evictable_step`` of the vTensor).
        prefetch_step: step at which the restore is issued (at or before its first use after
            ``evict_step``); ``len(step_names)`` means never: the vTensor has no later use.

    The bytes are absent during ``[evict_step, prefetch_step)``. A vTensor used at scattered
    steps may have several moves; their windows never overlap (``check_plan``).
    """

    vid: int
    evict_bytes: int
    evict_step: int
    prefetch_step: int


_MOVE_FIELDS = tuple(f.name for f in fields(TensorMove))


@dataclass(frozen=True)
class Plan:
    """A swap plan for one model, input signature and budget, replayed every iteration.

    Attributes:
        budget_bytes: the budget it was planned for.
        chunk_bytes: chunk size (None: whole tensors).
        moves: the swaps, ordered by ``evict_step`` then ``vid``.
        step_names: the trace's step names, to recognise a diverging iteration.
        tensor_bytes: the trace's vTensor sizes by vid, same purpose.
        tensor_names: the names of the parameter-side tensors by vid (empty for activations,
            which come first); empty when the plan has none (NOTE [one plan]).
        predicted_peak_bytes: the largest device bytes the model predicts at any step.
        predicted_stall_s: the transfer time the model predicts compute waits for.
        planner: name and version of the planner that made it.
        schema_version: bumped when fields change meaning.
        reserve_bytes: the headroom the budget guard kept when the plan was made (the
            largest growth between two hook points): a process replaying the plan keeps it
            from its first iteration.
        recompute: modules (qualified names) whose forward runs again in backward instead of
            keeping or swapping what it saves (NOTE [recompute]); the moves are planned for the
            iteration with them recomputed.
        predicted_step_s: the step time the planner predicts: measured compute, recomputation
            included, plus the predicted stall.
        min_budget_bytes: the smallest budget the profiled iteration it was planned from could
            have run at (NOTE [minimum budget]); a lean replay, which does not judge every hook
            point, reports it (NOTE [lean replay]).
        watched_steps: the steps at which a lean replay reads the tracked bytes: the predicted
            peak's, and of those predicted near the budget the ones NOTE [confirmed readings]
            keeps (``memory_model.watched_steps``).
        step_headroom_bytes: per step, the plan's budget less the bytes it predicts resident
            there: the writes a lean replay may leave in flight as the step begins (NOTE [lean
            waits]); empty: none.
        watched_events: the saved-tensor events a replay without module hooks reads the
            tracked bytes at, the first at or after each watched step: ``(vid, 0)`` its save,
            ``(vid, 1)`` its first unpack (NOTE [hookless replay]); empty: a watched step has
            none after it.
        encoded: made from an iteration whose clamps saved bits (NOTE [mask encoding]): its
            replays encode them too.
        step_reserve_bytes: per step, per hook event of it, the headroom the guard keeps
            there while a replay follows the plan, where it fills the budget (the trace's
            ``growth_bytes``, NOTE [step reserve] in ``planner/reserves.py``); empty:
            ``reserve_bytes`` everywhere.
    """

    budget_bytes: int
    chunk_bytes: int | None
    moves: tuple[TensorMove, ...]
    step_names: tuple[str, ...]
    tensor_bytes: tuple[int, ...]
    predicted_peak_bytes: int
    predicted_stall_s: float
    planner: str
    schema_version: int = PLAN_SCHEMA_VERSION
    reserve_bytes: int = 0
    tensor_names: tuple[str, ...] = ()
    recompute: tuple[str, ...] = ()
    predicted_step_s: float = 0.0
    min_budget_bytes: int = 0
    watched_steps: tuple[int, ...] = ()
    step_headroom_bytes: tuple[int, ...] = ()
    watched_events: tuple[tuple[int, int], ...] = ()
    encoded: bool = False
    step_reserve_bytes: tuple[tuple[int, ...], ...] = ()

    @property
    def activation_count(self) -> int:
        """How many of the vTensors (the first ones) are saved activations."""
        return (
            sum(1 for name in self.tensor_names if not name)
            if self.tensor_names
            else len(self.tensor_bytes)
        )

    @property
    def bytes_moved(self) -> int:
        """Bytes moved per iteration, out and back in."""
        return 2 * sum(m.evict_bytes for m in self.moves)

    def to_json(self) -> str:
        """Serialize to JSON text: that of ``dataclasses.asdict``, field by field.

        ``asdict`` copies every leaf on the way: 1.1 ms against 0.1 ms for the main job's plans
        (11.5 kB), in the first step of every manager that replays a cached plan (``digest``).
        The fields hold only numbers, strings, tuples of them and ``TensorMove``s, which JSON
        writes the same way either way.
        """
        plain = {f.name: getattr(self, f.name) for f in fields(self)}
        plain["moves"] = [{n: getattr(m, n) for n in _MOVE_FIELDS} for m in self.moves]
        return json.dumps(plain, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """Parse the output of :meth:`to_json`; raises ``ValueError`` on any mismatch."""
        raw: dict[str, Any] = json.loads(text)
        if raw.get("schema_version") != PLAN_SCHEMA_VERSION:
            raise ValueError(
                f"plan schema_version {raw.get('schema_version')!r} is not {PLAN_SCHEMA_VERSION}"
            )
        moves = tuple(TensorMove(**m) for m in raw.pop("moves"))
        return cls(
            moves=moves,
            step_names=tuple(raw.pop("step_names")),
            tensor_bytes=tuple(raw.pop("tensor_bytes")),
            tensor_names=tuple(raw.pop("tensor_names", ())),
            recompute=tuple(raw.pop("recompute", ())),
            watched_steps=tuple(raw.pop("watched_steps", ())),
            step_headroom_bytes=tuple(raw.pop("step_headroom_bytes", ())),
            step_reserve_bytes=tuple(tuple(r) for r in raw.pop("step_reserve_bytes", ())),
            watched_events=tuple((v, k) for v, k in raw.pop("watched_events", ())),
            **raw,
        )

    def digest(self) -> str:
        """A checksum of the plan's content (SHA-256 of its JSON), computed once per plan."""
        known: str | None = self.__dict__.get("_digest")
        if known is None:
            known = hashlib.sha256(self.to_json().encode()).hexdigest()
            object.__setattr__(self, "_digest", known)  # frozen: its fields never change
        return known
