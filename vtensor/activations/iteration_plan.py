"""What one iteration runs with, and the candidate recomputations a signature still has to try."""

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from vtensor.activations.executor import PlanExecutor
from vtensor.activations.report import PlanSource
from vtensor.planner.dominance import priced_above, recomputes_all_of, unit_costs
from vtensor.planner.keys import PlanKey
from vtensor.planner.plan import Plan
from vtensor.planner.recompute import unit_regrowth
from vtensor.planner.recomputed import cached_selective, through_one_node
from vtensor.planner.trace import Trace

logger = logging.getLogger(__name__)


@dataclass
class IterationPlan:
    """What one iteration runs with."""

    signature: str
    source: PlanSource
    executor: PlanExecutor | None
    record_trace: bool
    key: PlanKey | None
    planning_s: float = 0.0
    cache_load_s: float = 0.0
    recompute: tuple[str, ...] = ()  # modules recomputed in this iteration (NOTE [recompute])
    selective: tuple[str, ...] = ()  # of those, the ones recomputed selectively
    one_node: tuple[str, ...] = ()  # of those, behind one node (NOTE [one-node recomputation])
    find_units: bool = False  # profile which modules could be recomputed
    abandoned: bool = False  # a trial of recomputation that broke the budget
    racing: bool = False  # one of the candidate plans being timed (NOTE [plan race])
    lean: bool = False  # replayed lean (NOTE [lean replay]): an earlier full replay needed no guard
    # A trial's recomputed modules: the bytes each brings back at once (NOTE [recomputed growth]).
    regrowth: dict[str, int] = field(default_factory=dict)
    encode: bool = False  # clamps save bits (NOTE [mask encoding])
    may_encode: bool = False  # profiled without encoding first (NOTE [encoding decided])
    following: bool = False  # another manager decides this plan (NOTE [provisional plan])


@dataclass
class Trials:
    """A signature's recomputations still to profile, and the plans to race (NOTE [plan race]).

    Attributes:
        pending: the candidates not yet profiled, the next first: (modules, those selective).
        plans: the hybrid plans of those profiled.
        swap_only: the profiled iteration's plan, without recomputation.
        growth: per module the profile found safe to recompute, a bound of what recomputing it
            holds at once: (whole, selectively) bytes, the same bound both ways
            (``unit_regrowth``, NOTE [regrowth bound]).
        encoded: the profile's clamps saved bits: so do the trials' (NOTE [mask encoding]).
        one_node: the modules recomputed whole behind one autograd node (``through_one_node``,
            NOTE [one-node recomputation] in ``activations/rebuild.py``).
        kept: candidates never dropped as recomputing more than another (NOTE [dominated
            candidates] in ``planner/dominance.py``): what ``torch.utils.checkpoint`` on
            every block does.
        cached: the modules that, recomputed selectively, go behind one node with their
            product leaves' outputs kept (``cached_selective``, NOTE [cached products] in
            ``activations/product_cache.py``).
        unit_s: per module the profile found safe to recompute, what recomputing it costs:
            (whole, selectively) seconds (``unit_costs``, NOTE [priced higher] in
            ``planner/dominance.py``); empty where unknown, and none is priced higher then.
    """

    pending: list[tuple[tuple[str, ...], tuple[str, ...]]]
    plans: list[Plan]
    swap_only: Plan | None
    growth: dict[str, tuple[int, int]] = field(default_factory=dict)
    encoded: bool = False
    one_node: tuple[str, ...] = ()
    kept: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = ()
    cached: tuple[str, ...] = ()
    unit_s: dict[str, tuple[float, float]] = field(default_factory=dict)

    def one_node_of(self, names: tuple[str, ...], selective: tuple[str, ...]) -> tuple[str, ...]:
        """Of the modules ``names`` recomputes, those recomputed through one node.

        Whole, or selectively with their product leaves' outputs kept (NOTE [cached products]).
        """
        return tuple(
            n for n in names if (n in self.cached if n in selective else n in self.one_node)
        )

    def profiled(self, plan: Plan | None, predicted_s: float) -> Plan | None:
        """The next candidate was profiled into ``plan``: its hybrid plan, kept to race."""
        names, selective = self.pending.pop(0)
        logger.info(
            "recomputing %d modules, %d selectively, predicted %.3f s per step: %s",
            len(names),
            len(selective),
            predicted_s,
            ", ".join(f"{n} (selective)" if n in selective else n for n in names),
        )
        if plan is None:
            return None
        hybrid = dataclasses.replace(
            plan,
            recompute=names,
            selective=selective,
            one_node=self.one_node_of(names, selective),
        )
        self.plans.append(hybrid)
        if not hybrid.moves:  # NOTE [dominated candidates], NOTE [priced higher]
            left = [
                c
                for c in self.pending
                if c in self.kept
                or not (
                    recomputes_all_of(c, names, selective)
                    or priced_above(self.unit_s, c, (names, selective))
                )
            ]
            if len(left) < len(self.pending):
                logger.info(
                    "%d candidates recompute more or are priced higher: not tried",
                    len(self.pending) - len(left),
                )
            self.pending = left
        return hybrid

    def next_trial(self, signature: str, key: PlanKey | None) -> IterationPlan:
        """The iteration that profiles the next candidate, with its modules recomputed."""
        names, selective = self.pending[0]
        regrowth = {n: self.growth.get(n, (0, 0))[n in selective] for n in names}
        return IterationPlan(
            signature,
            PlanSource.PROFILED,
            None,
            True,
            key,
            recompute=names,
            selective=selective,
            one_node=self.one_node_of(names, selective),
            regrowth=regrowth,
            encode=self.encoded,
        )

    def candidates(self) -> list[Plan]:
        """The plans to race: the hybrid ones, then the swap-only one."""
        return [*self.plans, *([self.swap_only] if self.swap_only is not None else [])]


def trials_of(
    trace: Trace,
    candidates: Sequence[tuple[tuple[str, ...], tuple[str, ...]]],
    others: list[Plan],
    swap_only: Plan | None,
) -> Trials:
    """The trials of ``candidates``, found on the profiled iteration ``trace``.

    The last candidate, every block recomputed, is never dropped after a trial (NOTE
    [dominated candidates] in ``planner/dominance.py``).
    """
    return Trials(
        list(candidates),
        others,
        swap_only,
        unit_regrowth(trace),
        trace.encoded,
        one_node=tuple(u.name for u in trace.units if through_one_node(u)),
        kept=tuple(candidates[-1:]),
        cached=tuple(u.name for u in trace.units if cached_selective(u)),
        unit_s=unit_costs(trace),
    )
