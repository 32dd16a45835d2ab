"""What one iteration runs with: a plan to replay, or a profile to take, and how."""

from dataclasses import dataclass, field

from vtensor.activations.replay.executor import PlanExecutor
from vtensor.activations.report import PlanSource
from vtensor.planner.keys import PlanKey
from vtensor.planner.recompute import unit_regrowth
from vtensor.planner.trace import Trace


@dataclass(frozen=True)
class Recomputation:
    """The modules an iteration recomputes (NOTE [recompute]).

    ``regrowth``: per module, the bytes its recomputation brings back at once (NOTE
    [recomputed growth]), for which a profile makes room unplanned.
    """

    names: tuple[str, ...] = ()
    regrowth: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, trace: Trace, names: tuple[str, ...]) -> "Recomputation":
        """The recomputation of ``names``, as profiled in ``trace``."""
        growth = unit_regrowth(trace)
        return cls(names, {n: growth.get(n, 0) for n in names})


NO_RECOMPUTATION = Recomputation()


@dataclass(frozen=True)
class IterationPlan:
    """What one iteration runs with.

    Attributes:
        signature: the plan key's digest ("" without planning).
        executor: the plan it replays (None: it runs the reactive policy).
        recomputation: what it recomputes while profiled (a replay's come from its plan).
        find_units: the profile records which modules could be recomputed.
    """

    signature: str
    source: PlanSource
    executor: PlanExecutor | None = None
    record_trace: bool = False
    key: PlanKey | None = None
    recomputation: Recomputation = NO_RECOMPUTATION
    find_units: bool = False
    encode: bool = False
    lean: bool = False
    cache_load_s: float = 0.0

    @property
    def recompute(self) -> Recomputation:
        """What this iteration recomputes: its plan's, or its profile's."""
        if self.executor is None:
            return self.recomputation
        plan = self.executor.plan
        return Recomputation(plan.recompute)
