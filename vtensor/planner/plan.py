"""Swap plans as plain data: which chunks of which vTensor leave and return at which step."""

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from vtensor.planner.trace import shallow, tuples_in

PLAN_SCHEMA_VERSION = 14


@dataclass(frozen=True)
class TensorMove:
    """``evict_bytes`` (whole tail chunks) of vTensor ``vid`` away in its window.

    ``prefetch_step == len(step_names)``: never restored. One vTensor's windows never overlap.
    """

    vid: int
    evict_bytes: int
    evict_step: int
    prefetch_step: int


@dataclass(frozen=True)
class Plan:
    """A swap plan for one model, input signature and budget, replayed every iteration.

    Attributes:
        moves: the swaps, ordered by ``evict_step`` then ``vid``.
        step_names, tensor_bytes: the trace's, to recognise a diverging iteration.
        tensor_names: the parameter-side tensors' names by vid, empty for activations (which
            come first) (NOTE [one plan]).
        reserve_bytes: the largest growth between two hook points while profiling.
        recompute: modules whose forward runs again in backward (NOTE [recompute]).
        predicted_step_s: measured compute, recomputation included, plus the predicted stall.
        min_budget_bytes: the profiled iteration's stated minimum (NOTE [minimum budget]).
        watched_steps: where a lean replay reads the tracked bytes (NOTE [confirmed readings]).
        step_headroom_bytes: per step, the budget less the predicted resident bytes (NOTE
            [lean waits]).
        watched_events: per watched step, the first event after it, ``(vid, 0)`` a save,
            ``(vid, 1)`` a first unpack (NOTE [hookless replay]).
        encoded: made where the clamps saved their output (NOTE [mask encoding]).
        step_reserve_bytes: per step and hook event, the headroom the guard keeps there (NOTE
            [step reserve]); empty: ``reserve_bytes`` everywhere.
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
        """JSON text, built field by field: ``asdict`` deep-copies every leaf, slow here."""
        plain = shallow(self)
        plain["moves"] = [shallow(m) for m in self.moves]
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
        return cls(moves=moves, **tuples_in(raw))

    def digest(self) -> str:
        """A checksum of the plan's content (SHA-256 of its JSON), computed once per plan."""
        known: str | None = self.__dict__.get("_digest")
        if known is None:
            known = hashlib.sha256(self.to_json().encode()).hexdigest()
            object.__setattr__(self, "_digest", known)  # frozen: its fields never change
        return known
