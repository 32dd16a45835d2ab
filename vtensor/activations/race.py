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
each, and the one with the least median time in the form it will run is kept. A candidate is
timed as it will run: once a full replay of it needed nothing from the guard, its next
replays are lean (NOTE [lean replay]), as the kept plan's are from then on, and its full
replays' times no longer count: timed in full replays only, the candidates paid for a heap
reading at every hook point, whose number (and cost, which grows with the process's heap)
differs from plan to plan, and the race kept plans whose lean replays were slower
(benchmarks/HISTORY.md, 2026-12-02). For the same reason a candidate whose full replay needed the
guard is made again under the guard's margin (NOTE [guard margin] in ``activations/margin.py``), as
a kept plan would be, and races from then on in that form, its times so far dropped: raced as first
planned, a swap-only plan whose first replay needed the guard was timed only in full replays and
lost to hybrid plans whose replays, as kept, were slower than its own (MobileNetV2,
benchmarks/HISTORY.md, 2026-12-02). Every replay is a real training iteration under the budget: the
race costs nothing but the slower candidates' extra time, a few iterations once per model, input
signature and budget.

NOTE [close race]
``ROUNDS`` replays leave a candidate that goes lean one replay in its final form, and one replay
of a plan on a shared 2-vCPU machine varies by several percent: decided on one lean replay each,
the race kept a plan 11 % slower than the swap-only one it raced (MobileNetV2 at 50 %,
benchmarks/HISTORY.md, 2026-12-02). So once every candidate has its ``ROUNDS``, those whose
median lies within ``CLOSE`` of the leader's (the leader among them) are replayed again, in
turn, up to ``CLOSE_ROUNDS`` replays each, then the leader and its closest rival up to
``MAX_ROUNDS``, and the least median then wins. The extra replays cost little: the candidates
that get them are the ones no slower than the leader by more than ``CLOSE``; a candidate clearly
slower gets no more. The median, not the best, because one fast replay is as much an accident of
the machine as one slow one. Four replays for every close candidate (three in the final form)
were too few: the main job's micro class kept a five-module cover in one run of its round in one
process, at 1.36x the unmanaged round where the two-module cover other runs kept took 1.17-1.23x
(benchmarks/README.md, ``main_round``), and in one simulation of three, where two clients train
at once and each one's replays vary with what the other runs (``main_job``). Races of
recorded-like times (``tests/vtensor/activations/test_race.py``: five candidates 0-60 % apart,
replays spread 5 %) kept a slower plan in 4.9 % of them with four replays each and 0.8 % with
the two closest going on to eight, for 0.2 more steps' worth of the slower candidates' time;
with replays spread 8 % and one in ten 25 % slow, 22 % and 15 %. Eight for every close candidate
did no better and raced up to 40 iterations where five candidates lay within 8 % (the two
closest going on: 36; four each: 20), which left a held-out model of ``benchmarks/held_out.py``
no steady step in 30.

NOTE [confirmed leader]
A leader clearly ahead of every other candidate still stood on one replay in its final form
(its full replay and one lean one). On a held-out SENet at half its peak (benchmarks/README.md,
``held_out``) one race led by its swap-only plan on one lean replay, 0.127 s against 0.146 s
and more, where the same plan's replays took 0.174-0.213 s in five other races; in another run
the race kept that plan, which then ran at 1.92x the unmanaged step where the recomputing plans
other runs kept ran at 1.32-1.47x. A plan that moves bytes is timed by the disk and the page
cache as well as by the cores. So the leader is replayed
until it has ``CONFIRM`` times in the form it will run (or ``max_rounds`` replays), and a
leader those replays slow down gives way to the next. What confirming costs is nothing where
the leader stays ahead: those iterations run the plan that is then kept.

NOTE [disqualified]
A candidate races in replays under the guard, which acts at hook points only: an op that
allocates more than the headroom between two of them breaks the budget. Such a candidate is
made again under the margin it broke the budget by (NOTE [guard margin]), once, and races on
in that form, its times anew; over the budget again, or where no plan fits that much lower, it
leaves the race, as a trial whose working set did not fit drops its candidate, and the others
race on. The last one left wins; with none left the iteration is profiled again. Before, the
step raised, although other candidates fitted: on an H200 the char GPT's hybrid at 50 % of its
peak raised 6 MiB over its budget in the third iteration of its decision, where the swap-only
plans fitted (benchmarks/README.md, ``gpu_step``).
"""

import logging
import statistics
from dataclasses import dataclass, field

from vtensor.planner.dominance import likely_fastest, priced_above, recomputes_all_of
from vtensor.planner.plan import Plan

logger = logging.getLogger(__name__)

ROUNDS = 2  # replays of every candidate
CLOSE_ROUNDS = 4  # replays of every candidate close to the leader (NOTE [close race])
MAX_ROUNDS = 8  # replays of the leader and its closest rival, at most (NOTE [close race])
CLOSE = 0.10  # within this fraction of the leader's median, a candidate is close
CONFIRM = 3  # times of the leader in its final form before it wins (NOTE [confirmed leader])


@dataclass
class PlanRace:
    """Candidate plans replayed in turn; the one with the least median time as it runs wins.

    Each candidate is replayed ``ROUNDS`` times in the form it races in, those close to the
    leader up to ``CLOSE_ROUNDS`` and the two closest up to ``max_rounds`` (NOTE [close
    race]), and the leader until it is confirmed (NOTE [confirmed leader]); one made again
    under the guard's margin starts over.
    """

    plans: list[Plan]
    times: list[list[float]] = field(default_factory=list)
    turn: int = 0  # the index of the candidate the next iteration replays
    clean: list[bool] = field(default_factory=list)  # a full replay of it needed no guard
    leans: list[list[bool]] = field(default_factory=list)  # whether each time was a lean replay
    max_rounds: int = MAX_ROUNDS
    # Per unit the profile found safe, what recomputing it costs: (whole, selectively) seconds.
    unit_s: dict[str, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.times = [[] for _ in self.plans]
        self.clean = [False for _ in self.plans]
        self.leans = [[] for _ in self.plans]

    def current(self) -> Plan:
        """The plan the next iteration replays."""
        return self.plans[self.turn]

    def lean(self) -> bool:
        """Whether the next iteration replays its plan lean."""
        return self.clean[self.turn]

    def record(
        self, wall_s: float, guard_bytes: int = 0, lean: bool = False, remade: Plan | None = None
    ) -> Plan | None:
        """The current plan's replay took ``wall_s``; returns the winner once the race is over.

        ``guard_bytes``: what the guard evicted beyond the plan in that replay, if it was full.
        ``remade``: the plan made again under the guard's margin, which races in the current
        one's place from now on, its times starting over.
        """
        if remade is not None:
            self.plans[self.turn] = remade
            self.times[self.turn] = []
            self.leans[self.turn] = []
            self.clean[self.turn] = False
        else:
            if not lean:
                self.clean[self.turn] = guard_bytes == 0
            self.times[self.turn].append(wall_s)
            self.leans[self.turn].append(lean)
            if not lean and guard_bytes == 0 and not self.plans[self.turn].moves:
                self._drop_outdone()
        waiting = self._waiting()
        if not waiting:
            return self.plans[self._best()]
        self.turn = self._next_turn(waiting)
        return None

    def broke_budget(self, remade: Plan | None) -> Plan | None:
        """The current candidate's replay broke the budget (NOTE [disqualified]).

        It races on as ``remade``, made again under the margin it broke the budget by, its times
        anew; else it leaves the race (``disqualify``, whose result this returns).
        """
        if remade is not None:
            logger.info("a candidate plan broke the budget in its race: planned again lower")
            self.record(0.0, remade=remade)
            return None
        logger.warning("a candidate plan broke the budget in its race: it is dropped")
        return self.disqualify()

    def disqualify(self) -> Plan | None:
        """Drop the current candidate: its replay broke the budget (NOTE [disqualified]).

        Returns the winner where one candidate is left, whatever its replays (nothing to race);
        None while the race goes on, or where none is left (``plans`` is then empty).
        """
        for column in (self.plans, self.times, self.clean, self.leans):
            del column[self.turn]
        if len(self.plans) <= 1:
            return self.plans[0] if self.plans else None
        self.turn %= len(self.plans)
        waiting = self._waiting()
        if not waiting:
            return self.plans[self._best()]
        if self.turn not in waiting:
            self.turn = self._next_turn(waiting)
        return None

    def _drop_outdone(self) -> None:
        """Drop the candidates the current one outdoes: it moves nothing, its full replay clean.

        It runs so from now on; those that recompute all it does and more, or whose
        recomputation the profile prices higher, can be no faster (NOTE [dominated candidates]
        and NOTE [priced higher] in ``planner/dominance.py``).
        """
        current = self.plans[self.turn]
        mine = (current.recompute, current.selective)
        drop = [
            i
            for i, p in enumerate(self.plans)
            if p is not current
            and p.encoded == current.encoded
            and (
                recomputes_all_of((p.recompute, p.selective), *mine)
                or priced_above(self.unit_s, (p.recompute, p.selective), mine)
            )
        ]
        if not drop:
            return
        logger.info("%d candidates outdone by a plan that moves nothing: dropped", len(drop))
        for column in (self.plans, self.times, self.clean, self.leans):
            for i in reversed(drop):
                del column[i]
        self.turn = self.plans.index(current)

    def leader(self) -> Plan:
        """The plan the race would keep now; until every candidate ran, ``likely_fastest``'s."""
        if all(self.times):
            return self.plans[self._best()]
        found = likely_fastest(self.plans, self.unit_s)
        assert found is not None  # a race has plans
        return found

    def winner_clean(self) -> bool:
        """Whether a full replay of the winner needed nothing from the guard."""
        return self.clean[self._best()]

    def summary(self, winner: Plan) -> str:
        """Each candidate's median time and replays, and what the winner recomputes, for the log."""
        rows = zip(self.plans, self.medians(), self.times, strict=True)
        listed = ", ".join(f"{_kind(p)}: {m:.3f} ({len(t)} replays)" for p, m, t in rows)
        return (
            f"replayed (modules recomputed, clamps encoded: median s per step as kept): "
            f"{listed}; keeping {_kind(winner)}"
        )

    def form_times(self, index: int) -> list[float]:
        """Candidate ``index``'s times in the form it will run: its lean replays once it has any."""
        pairs = zip(self.times[index], self.leans[index], strict=True)
        lean = [t for t, was_lean in pairs if was_lean]
        return lean or self.times[index]

    def medians(self) -> list[float]:
        """Each candidate's median time in the form it will run (inf if it has not run)."""
        medians = []
        for index in range(len(self.plans)):
            times = self.form_times(index)
            medians.append(statistics.median(times) if times else float("inf"))
        return medians

    def _waiting(self) -> list[int]:
        """The candidates still to replay (NOTE [close race], NOTE [confirmed leader]).

        Those short of ``ROUNDS``; else those close to the leader and short of
        ``CLOSE_ROUNDS``; else the leader and its closest rival, short of the most; else the
        leader, until it is confirmed.
        """
        short = [i for i, t in enumerate(self.times) if len(t) < ROUNDS]
        if short:
            return short
        medians = self.medians()
        best = self._best()
        close = [i for i, m in enumerate(medians) if m <= medians[best] * (1 + CLOSE)]
        if len(close) < 2:
            confirmed = len(self.form_times(best)) >= CONFIRM
            return [] if confirmed or len(self.times[best]) >= self.max_rounds else [best]
        each = min(CLOSE_ROUNDS, self.max_rounds)
        waiting = [i for i in close if len(self.times[i]) < each]
        if waiting:
            return waiting
        rival = min((i for i in close if i != best), key=medians.__getitem__)
        return [i for i in (best, rival) if len(self.times[i]) < self.max_rounds]

    def _next_turn(self, waiting: list[int]) -> int:
        """The next candidate after the current one, in turn, among those ``waiting``."""
        n = len(self.plans)
        for step in range(1, n + 1):
            index = (self.turn + step) % n
            if index in waiting:
                return index
        return self.turn

    def _best(self) -> int:
        medians = self.medians()
        return min(range(len(medians)), key=medians.__getitem__)


def _kind(plan: Plan) -> str:
    """How many modules ``plan`` recomputes, and whether its clamps save bits, for the log."""
    return f"{len(plan.recompute)}{' encoded' if plan.encoded else ''}"
