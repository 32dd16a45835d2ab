"""The reactive swap policy: evict the vTensors used farthest ahead, prefetch the nearest."""

import logging

from vtensor.activations.store.chunk_store import ChunkStore, VTensor
from vtensor.planner.plan import Plan
from vtensor.planner.reserves import GUARD_MIN_BYTES

logger = logging.getLogger(__name__)


# NOTE [deterministic reaping]: while profiling or reacting, every eviction started before a hook
# point completes there, so the trace depends on hook events, not disk speed. While a plan is
# replayed, writes run on (counted live) and are waited for only when the headroom needs them.


class ReactivePolicy:
    """Keeps the tracked device bytes under a budget by evicting exactly the deficit.

    NOTE [reactive watermarks]
    Hooks see a tensor only after its op allocated it, so the policy keeps a ``reserve``: the
    largest growth seen between two enforcement points. Above ``budget - reserve`` it evicts and
    waits; above ``budget - 2 * reserve`` it starts writes early to overlap compute.

    NOTE [guard takes whole remainders]
    While a plan is replayed, the guard cuts a victim by the deficit once; a victim already cut
    goes whole, since each cut copies its resident prefix (``resize_``).
    """

    name = "reactive"

    def __init__(self, store: ChunkStore, budget_bytes: int, prefetch_depth: int = 2) -> None:
        self.store = store
        self.budget_bytes = budget_bytes
        self.reserve_bytes = 0
        # The largest growth outside recomputations (NOTE [recomputed growth]).
        self.plan_reserve_bytes = 0
        self.transient_bytes = 0  # the largest workspace seen inside one op (profiling)
        # Headroom kept while replaying a plan (NOTE [planned headroom]).
        self.guard_bytes = store.chunk_bytes or GUARD_MIN_BYTES
        self.prefetch_depth = prefetch_depth
        # Off while a plan is replayed: the plan moves bytes early, the policy only guards.
        self.early_eviction = True
        # The plan's reserves per step and hook event, and the one in force (None:
        # ``reserve_bytes``; NOTE [step reserve] in planner/reserves.py).
        self.step_reserves: tuple[tuple[int, ...], ...] = ()
        self.step_reserve: int | None = None
        self._now: tuple[int, ...] | None = None  # the running step's reserves by hook event

    def keep_reserve(self, nbytes: int, recomputed_bytes: int = 0) -> None:
        """Keep at least ``nbytes`` of headroom from now on (a growth between hook points).

        NOTE [recomputed growth]
        Recomputing a unit brings all it saved back at once, where no hook can make room.
        Without a plan, room is made before each recomputation (NOTE [regrowth bound]). A plan
        places those bytes itself, so its guard keeps only the growth outside recomputations
        (``plan_reserve_bytes``); else it would evict what the plan did not.
        """
        self.plan_reserve_bytes = max(self.plan_reserve_bytes, nbytes - recomputed_bytes)
        if not self.early_eviction:
            nbytes -= recomputed_bytes  # a replayed plan placed them
        self.reserve_bytes = max(self.reserve_bytes, nbytes)

    def use_plan(self, plan: Plan | None) -> None:
        """Guard the replay of ``plan`` (None: no plan): its reserve and its reserves per point."""
        if plan is not None:
            self.use_reserve(plan.reserve_bytes)
        self.use_step_reserves(plan.step_reserve_bytes if plan is not None else ())

    def use_step_reserves(self, reserves: tuple[tuple[int, ...], ...]) -> None:
        """The plan about to be replayed keeps these per step and hook event (empty: its one)."""
        self.step_reserves = reserves
        self._now = None
        self.step_reserve = None

    def at_step(self, index: int, *, following: bool) -> None:
        """Step ``index`` begins; ``following``: it follows its plan (NOTE [step reserve])."""
        known = following and 0 <= index < len(self.step_reserves)
        self._now = self.step_reserves[index] if known else None
        self.at_event(0)

    def at_plan_step(self, index: int, *, active: bool) -> None:
        """A replay's step ``index`` begins; ``active``: it follows its plan."""
        self.at_step(index, following=active)
        self.follow_plan(active)

    def at_event(self, event: int) -> None:
        """Hook event ``event`` of the step running now (a reading follows)."""
        if self._now is None:
            self.step_reserve = None
        else:
            self.step_reserve = self._now[event] if event < len(self._now) else 0

    def use_reserve(self, nbytes: int) -> None:
        """Keep the growth the replayed plan's profile measured (not the largest seen)."""
        self.reserve_bytes = nbytes
        self.plan_reserve_bytes = nbytes

    def keep_transient(self, nbytes: int) -> None:
        """Keep room for an op workspace of ``nbytes`` (measured while profiling)."""
        self.transient_bytes = max(self.transient_bytes, nbytes)

    def follow_plan(self, replaying: bool) -> None:
        """While a plan is replayed the plan moves bytes early; the policy only guards."""
        self.early_eviction = not replaying

    def high_watermark(self) -> int:
        """Device bytes above which the next allocation could break the budget."""
        if not self.early_eviction:
            # The plan budgets workspaces; the guard keeps the growth between hook points the
            # per-step model cannot place.
            reserve = self.reserve_bytes if self.step_reserve is None else self.step_reserve
            return self.budget_bytes - max(reserve, self.guard_bytes)
        # Not knowing which step needs a workspace, keep the largest seen free as well.
        return self.budget_bytes - self.reserve_bytes - self.transient_bytes

    def evict_down_to(
        self, live_bytes: int, target_bytes: int, pinned: VTensor | None = None
    ) -> int:
        """Schedule evictions so that ``live_bytes`` falls to ``target_bytes``; returns bytes."""
        deficit = live_bytes - self.store.outgoing_bytes() - target_bytes
        scheduled = 0
        # Farthest next use first: in a forward/backward iteration the oldest saved is used last.
        for record in sorted(self.store.records.values(), key=lambda r: r.vid):
            if deficit - scheduled <= 0:
                break
            if record is pinned:
                continue
            available = self.store.evictable_bytes(record)
            if available == 0:
                continue
            # NOTE [guard takes whole remainders]: a victim already cut goes whole.
            cut = available < record.movable_bytes
            whole = self.store.chunk_bytes is None or (not self.early_eviction and cut)
            want = available if whole else deficit - scheduled
            scheduled += self.store.evict(record, min(want, available))
        return scheduled

    def enforce(self, live_bytes: int, pinned: VTensor | None = None) -> None:
        """Start evictions above the early watermark; wait for writes above the high one."""
        high = self.high_watermark()
        early = high - self.reserve_bytes if self.early_eviction else high
        if live_bytes > early:
            self.evict_down_to(live_bytes, max(early, 0), pinned)
        if live_bytes > high and self.store.in_flight():
            # Only completed writes free memory; waiting on a restore would free nothing.
            self.store.reap(block=True, block_restores=False)

    def prefetch(self, live_bytes: int, current: VTensor) -> int:
        """Start restoring the vTensors backward will use next, as far as headroom allows."""
        headroom = self.high_watermark() - self.reserve_bytes - live_bytes
        started = 0
        # Nearest next use first: backward consumes saved tensors in reverse order of saving.
        candidates = [r for r in self.store.records.values() if r.offloaded_chunks()]
        candidates = sorted((r for r in candidates if r.vid < current.vid), key=lambda r: -r.vid)
        for record in candidates[: self.prefetch_depth]:
            need = sum(c.nbytes for c in record.offloaded_chunks())
            if record.pending is not None or need > headroom - started:
                break
            self.store.restore(record)
            started += need
        return started
