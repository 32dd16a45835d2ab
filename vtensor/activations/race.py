"""Choosing between candidate plans by timing their replays, in turn (NOTE [plan race]).

NOTE [plan race]
The hybrid plans (one per candidate recomputation, NOTE [hybrid plan] in
``planner/recompute.py``) and the swap-only plan of the same iteration are compared by their
measured replays, not by the model's prediction. The prediction (measured compute of the
profiled steps plus the predicted stall) ranked them wrongly on MobileNetV2: on a CPU the swap
engine's work (sealing, system calls, page faults on return) takes cores from compute even
where the planner hides the transfer, and recomputation under torch's selective checkpointing
runs every op of the unit through a Python dispatch mode, which neither the trace's durations
nor the model see. So the next iterations replay the candidates in turn, ``ROUNDS`` times
each, and the one with the smallest best wall time is kept (the best of a few, because on a
shared machine a slow iteration says more about the machine than about the plan). A candidate
is timed as it will run: once a full replay of it needed nothing from the guard, its next
replays are lean (NOTE [lean replay]), as the kept plan's are from then on: timed in full
replays only, the candidates paid for a heap reading at every hook point, whose number (and
cost, which grows with the process's heap) differs from plan to plan, and the race kept plans
whose lean replays were slower (benchmarks/README.md). For the same reason a candidate whose
full replay needed the guard is made again under the guard's margin (NOTE [guard margin] in
``activations/margin.py``), as a kept plan would be, and races from then on in that form, its
times so far dropped: raced as first planned, a swap-only plan whose first replay needed the
guard was timed only in full replays and lost to hybrid plans whose replays, as kept, were
slower than its own (MobileNetV2, benchmarks/README.md). Every replay is a real training iteration
under the budget: the race costs nothing but the slower candidates' extra time, a few
iterations once per model, input signature and budget.
"""

from dataclasses import dataclass, field

from vtensor.planner.plan import Plan

ROUNDS = 2


@dataclass
class PlanRace:
    """Candidate plans replayed in turn; the one with the least best wall time wins.

    Each candidate is timed ``ROUNDS`` times in the form it races in; one made again under the
    guard's margin starts over.
    """

    plans: list[Plan]
    times: list[list[float]] = field(default_factory=list)
    turn: int = 0  # the index of the candidate the next iteration replays
    clean: list[bool] = field(default_factory=list)  # a full replay of it needed no guard

    def __post_init__(self) -> None:
        self.times = [[] for _ in self.plans]
        self.clean = [False for _ in self.plans]

    def current(self) -> Plan:
        """The plan the next iteration replays."""
        return self.plans[self.turn]

    def lean(self) -> bool:
        """Whether the next iteration replays its plan lean."""
        return self.clean[self.turn]

    def record(
        self, wall_s: float, guard_bytes: int = 0, lean: bool = False, remade: Plan | None = None
    ) -> Plan | None:
        """The current plan's replay took ``wall_s``; returns the winner once all have run.

        ``guard_bytes``: what the guard evicted beyond the plan in that replay, if it was full.
        ``remade``: the plan made again under the guard's margin, which races in the current
        one's place from now on, its times starting over.
        """
        if remade is not None:
            self.plans[self.turn] = remade
            self.times[self.turn] = []
            self.clean[self.turn] = False
        else:
            if not lean:
                self.clean[self.turn] = guard_bytes == 0
            self.times[self.turn].append(wall_s)
        if all(len(t) >= ROUNDS for t in self.times):
            return self.plans[self._best()]
        self.turn = self._next_turn()
        return None

    def winner_clean(self) -> bool:
        """Whether a full replay of the winner needed nothing from the guard."""
        return self.clean[self._best()]

    def summary(self, winner: Plan) -> str:
        """Each candidate's best time and the modules the one kept recomputes, for the log."""
        times = zip(self.plans, self.best_times(), strict=True)
        best = ", ".join(f"{_kind(p)}: {t:.3f}" for p, t in times)
        return (
            f"replayed (modules recomputed, clamps encoded: best s per step): {best}; "
            f"keeping {_kind(winner)}"
        )

    def best_times(self) -> list[float]:
        """The best wall time of each candidate so far (inf if it has not run)."""
        return [min(t) if t else float("inf") for t in self.times]

    def _next_turn(self) -> int:
        """The next candidate after the current one, in turn, still short of its times."""
        n = len(self.plans)
        for step in range(1, n + 1):
            index = (self.turn + step) % n
            if len(self.times[index]) < ROUNDS:
                return index
        return self.turn

    def _best(self) -> int:
        best = self.best_times()
        return min(range(len(best)), key=best.__getitem__)


def _kind(plan: Plan) -> str:
    """How many modules ``plan`` recomputes, and whether its clamps save bits, for the log."""
    return f"{len(plan.recompute)}{' encoded' if plan.encoded else ''}"
