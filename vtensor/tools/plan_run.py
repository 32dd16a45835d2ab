"""What ``python -m vtensor plan`` measures: plain, unmanaged and managed runs of one batch."""

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from vtensor.activations.manager import MemoryManager
from vtensor.activations.report import Granularity, IterationReport
from vtensor.errors import InfeasibleBudgetError
from vtensor.planner.plan import Plan
from vtensor.planner.trace import Trace
from vtensor.sizes import format_bytes
from vtensor.tools.workload import Batch, Builder, training_loss


class Progress:
    """Lines on stderr with the seconds since the command started."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, what: str) -> None:
        """Print ``what`` with the elapsed seconds."""
        print(f"[{time.perf_counter() - self.start:7.2f} s] {what}", file=sys.stderr, flush=True)


def train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: Batch,
    classes: int,
    mm: MemoryManager | None,
) -> float:
    """One training step (forward, backward, update); its seconds, timed alike with or without."""
    opt.zero_grad(set_to_none=True)
    x, y = batch
    begin = time.perf_counter()
    if mm is None:
        training_loss(model(x), y, classes).backward()  # type: ignore[no-untyped-call]
    else:
        with mm.step(model, opt, inputs=batch):
            training_loss(model(x), y, classes).backward()  # type: ignore[no-untyped-call]
    opt.step()  # offloaded parameters were updated in backward: it changes nothing of theirs
    return time.perf_counter() - begin


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    """Whether ``a`` and ``b`` hold bit-identical weights."""
    return all(map(torch.equal, a.state_dict().values(), b.state_dict().values()))


def _fresh(build: Builder, batch: Batch) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = build().to(batch[0].device)
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def warm_median(step_s: list[float]) -> float:
    """The median step after the first, which warms the kernels (the first where it is all)."""
    return statistics.median(step_s[1:] or step_s)


@dataclass(frozen=True)
class Outcome:
    """What ``plan`` measured and planned.

    Attributes:
        unmanaged_peak_bytes: the 1 TiB step's peak, with the optimizer state its update creates.
        unmanaged, unmanaged_trace: the report and trace of the step at a 1 TiB budget.
        plain_step_s: median seconds of a plain step, taking turns with the managed ones.
        min_budget_bytes: the manager's stated minimum (NOTE [minimum budget]).
        param_bytes_moved: bytes each managed step's parameter side moved, both ways.
        trace, plan: what the manager profiled and replays (None: a cached plan, or no plan).
        weights_identical: managed and plain training ended with bit-identical weights.
        failure: why the managed run stopped early (an infeasible budget), None if it did not.
    """

    unmanaged_peak_bytes: int
    unmanaged: IterationReport
    unmanaged_trace: Trace
    plain_step_s: float
    budget_bytes: int
    min_budget_bytes: int
    managed: tuple[IterationReport, ...]
    managed_step_s: tuple[float, ...]
    param_bytes_moved: tuple[int, ...]
    trace: Trace | None
    plan: Plan | None
    params_offloaded: bool
    weights_identical: bool
    failure: str | None


@dataclass(frozen=True)
class PlanRequest:
    """What to measure: the batch, the budget (bytes, else a fraction of the peak) and runs.

    ``recompute``, ``encode_masks`` and ``offload_params`` go to ``MemoryManager`` as they are.
    """

    batch: Batch
    classes: int
    steps: int
    budget_bytes: int | None
    fraction: float
    chunk_bytes: int
    granularity: Granularity
    recompute: bool
    encode_masks: bool | str
    offload_params: bool | str
    plan_cache_dir: str | None
    storage_dir: str | None


def measure(request: PlanRequest, build: Builder, progress: Progress) -> Outcome:
    """Run the plain, unmanaged and managed iterations; raises ``InfeasibleBudgetError``."""
    batch, classes = request.batch, request.classes
    # A plain step first: a process's first iteration allocates what kernels keep for later,
    # which would inflate the unmanaged peak (docs/vtensor.md, Limits). The others take turns
    # with the managed ones, so that both are timed under the same load.
    progress("plain step 0 (no manager): it warms the kernels")
    reference, reference_opt = _fresh(build, batch)
    plain_s = [train_step(reference, reference_opt, batch, classes, None)]

    def plain_step() -> None:
        plain_s.append(train_step(reference, reference_opt, batch, classes, None))
        progress(f"plain step {len(plain_s) - 1} (no manager): {plain_s[-1]:.3f} s")

    with tempfile.TemporaryDirectory(prefix="vtensor-plan-") as scratch:
        storage = request.storage_dir or scratch
        progress("one step at a 1TiB budget: the unmanaged peak and trace")
        probe, trace, peak = _unmanaged(build, request, storage)
        budget = request.budget_bytes or int(peak * request.fraction)
        progress(f"unmanaged peak {format_bytes(peak)}, budget {format_bytes(budget)}")
        mm = MemoryManager(
            budget,
            chunk_bytes=request.chunk_bytes,
            storage_dir=storage,
            granularity=request.granularity,
            plan_cache_dir=request.plan_cache_dir,
            recompute=request.recompute,
            encode_masks=request.encode_masks,
            offload_params=request.offload_params,
        )
        with mm:
            model, opt = _fresh(build, batch)
            managed_s, param_moved, failure = _train_managed(
                model, opt, request, mm, progress, plain_step
            )
            plan = mm.plan_for(model, batch)
            offloaded = mm.params_offloaded
    if failure is not None and not mm.reports:
        raise failure
    same = same_weights(reference, model)
    return Outcome(
        peak,
        probe,
        trace,
        warm_median(plain_s),
        budget,
        failure.min_budget_bytes if failure is not None else mm.report().min_budget_bytes,
        mm.reports,
        tuple(managed_s),
        tuple(param_moved),
        mm.trace,
        plan,
        offloaded,
        same and failure is None,
        None if failure is None else str(failure),
    )


def _unmanaged(
    build: Builder, request: PlanRequest, storage_dir: str
) -> tuple[IterationReport, Trace, int]:
    """A step at 1 TiB: its report, its trace, and the manager's unmanaged peak."""
    with MemoryManager("1TiB", storage_dir=storage_dir) as probe:
        train_step(*_fresh(build, request.batch), request.batch, request.classes, probe)
    assert probe.trace is not None  # a first iteration is always profiled
    # The manager's own unmanaged peak: with the optimizer state the first update creates.
    peak = probe.unmanaged_peak_bytes or probe.report().peak_device_bytes
    return probe.report(), probe.trace, peak


def _train_managed(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    request: PlanRequest,
    mm: MemoryManager,
    progress: Progress,
    between: Callable[[], None],
) -> tuple[list[float], list[int], InfeasibleBudgetError | None]:
    """Train under ``mm`` until it breaks the budget.

    Returns each step's seconds, its parameter bytes moved, and why it stopped (or None).
    """
    steps = request.steps
    seconds: list[float] = []
    param_moved: list[int] = []
    try:
        for i in range(steps):
            progress(
                f"managed iteration {i} ({i + 1} of {steps}) at {format_bytes(mm.budget_bytes)}"
            )
            before = _param_bytes_moved(mm)
            seconds.append(train_step(model, opt, request.batch, request.classes, mm))
            param_moved.append(_param_bytes_moved(mm) - before)
            rep = mm.report()
            progress(
                f"  {rep.plan_source}{', lean' if rep.lean else ''}: "
                f"peak {format_bytes(rep.peak_device_bytes)}, "
                f"moved {format_bytes(rep.bytes_moved + param_moved[-1])}, "
                f"stall {rep.stall_s:.3f} s, step {seconds[-1]:.3f} s"
            )
            if i + 1 < steps:
                between()
    except InfeasibleBudgetError as err:
        progress(
            f"  stopped: the budget cannot be met ({format_bytes(err.min_budget_bytes)} needed)"
        )
        return seconds, param_moved, err
    return seconds, param_moved, None


def _param_bytes_moved(mm: MemoryManager) -> int:
    """Bytes the manager's parameter offloadings have moved so far, both ways."""
    return sum(r.bytes_out + r.bytes_in for r in mm.offload_reports())
