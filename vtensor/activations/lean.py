"""Whether a replayed plan is followed lean: per-tensor work only where the plan acts.

NOTE [lean replay]
A replayed plan that this process measured in full while profiling is followed with per-tensor
work only where the plan acts: hook points inside a module (saves, unpacks, backward nodes)
route to the store and the plan, and the tracked bytes are read, and the guard acts, at the
module boundaries the plan watches only (``Plan.watched_steps``): its predicted peak's and those
it predicts near the budget. The profiled iteration judged every hook point and backward node;
the replay repeats it (the executor checks every saved tensor's size and every step's name, and
a divergence turns the checks back on for the rest of the iteration). A boundary reading over
the budget also turns them back on, and the plan is profiled again next time: a lean iteration
cannot state a minimum budget of its own (it has not judged every point), so it reports the
profiled iteration's. A plan replays lean only once a full replay of it needed nothing from the
guard (no eviction beyond the plan's): where the guard helps, it helps between boundaries too
(``PlanBook``). At each boundary a lean replay waits for the evictions of the step before: no
guard reads the bytes between boundaries, so this is what keeps compute from running ahead of
the writes.
"""

from vtensor.activations.executor import PlanExecutor


def replays_lean(
    asked: bool,
    executor: PlanExecutor | None,
    budget_bytes: int,
    *,
    joint: bool,
    count_workspaces: bool,
    record_trace: bool,
) -> bool:
    """Whether an iteration replays ``executor``'s plan lean (``asked``: its plan book allows).

    Only a plan that leaves the guard its headroom under ``budget_bytes`` (NOTE [plan within
    the guard] in ``activations/planning.py``): where the plan fills the whole budget, the guard
    acts between boundaries as well. Never under a joint plan with parameter offloading, with
    op workspaces counted, or while profiling: those read the tracked bytes at every point.
    """
    if not asked or executor is None or joint or count_workspaces or record_trace:
        return False
    return executor.plan.budget_bytes + executor.plan.reserve_bytes <= budget_bytes
