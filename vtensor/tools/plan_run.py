"""What ``python -m vtensor plan`` measures: plain, unmanaged and managed runs of one batch."""

import contextlib
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
from torch import nn

from vtensor.activations.manager import MemoryManager
from vtensor.activations.report import Granularity, IterationReport
from vtensor.errors import InfeasibleBudgetError
from vtensor.io.chunk import DEFAULT_CHUNK_BYTES
from vtensor.offload.param_offload import ParamOffload
from vtensor.planner.belady import plan_lgm
from vtensor.planner.plan import Plan
from vtensor.planner.trace import Trace
from vtensor.sizes import format_bytes
from vtensor.tools.workload import Batch, Builder, make_batch, training_loss


class Progress:
    """Lines on stderr with the seconds since the command started."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, what: str) -> None:
        """Print ``what`` with the elapsed seconds."""
        print(f"[{time.perf_counter() - self.start:7.2f} s] {what}", file=sys.stderr, flush=True)


def _iteration(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: Batch,
    classes: int,
    mm: MemoryManager | None,
    offload: ParamOffload | None = None,
) -> float:
    opt.zero_grad(set_to_none=True)
    x, y = batch
    begin = time.perf_counter()
    if mm is None:
        training_loss(model(x), y, classes).backward()  # type: ignore[no-untyped-call]
    elif offload is not None:  # one plan: the offloading holds the optimizer's state
        with mm.step(model, inputs=batch, params=offload):
            training_loss(model(x), y, classes).backward()  # type: ignore[no-untyped-call]
    else:
        with mm.step(model, opt, inputs=batch):
            training_loss(model(x), y, classes).backward()  # type: ignore[no-untyped-call]
    elapsed = time.perf_counter() - begin
    if offload is not None:
        offload.step()
    else:
        opt.step()
    return elapsed


def train(
    build: Builder, batch: Batch, classes: int, steps: int, mm: MemoryManager | None
) -> tuple[nn.Module, list[float]]:
    """Train a fresh model ``steps`` iterations (managed by ``mm`` if given); step seconds."""
    model = build().to(batch[0].device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, [_iteration(model, opt, batch, classes, mm) for _ in range(steps)]


@dataclass(frozen=True)
class Outcome:
    """What ``plan`` measured and planned.

    Attributes:
        unmanaged: the report of the step at a 1 TiB budget (nothing moves).
        unmanaged_trace: its trace.
        unmanaged_step_s: median seconds of a plain (no manager) forward and backward.
        budget_bytes: the budget of the managed run.
        chunk_bytes: its chunk size (None at tensor granularity).
        managed: the reports of the managed iterations.
        trace: the trace the manager profiled at the budget (None if a cached plan ran).
        plan: the planner's plan at the budget for the trace used (None if it has none).
        weights_identical: managed and plain training ended with bit-identical weights.
        failure: why the managed run stopped early (an infeasible budget), None if it did not.
    """

    unmanaged: IterationReport
    unmanaged_trace: Trace
    unmanaged_step_s: float
    budget_bytes: int
    chunk_bytes: int | None
    managed: tuple[IterationReport, ...]
    trace: Trace | None
    plan: Plan | None
    weights_identical: bool
    failure: str | None


def planner_minimum(trace: Trace, chunk_bytes: int | None) -> tuple[int, str]:
    """The smallest budget the planner finds feasible on ``trace`` and the step that sets it."""
    try:
        plan_lgm(trace, 0, chunk_bytes=chunk_bytes)
    except InfeasibleBudgetError as err:
        return err.min_budget_bytes, err.step
    return 0, ""


def _plan_at(trace: Trace, budget_bytes: int, chunk_bytes: int | None) -> Plan | None:
    try:
        return plan_lgm(trace, budget_bytes, chunk_bytes=chunk_bytes)
    except InfeasibleBudgetError:
        return None


@dataclass(frozen=True)
class PlanRequest:
    """What to measure: the batch, the budget (bytes, else a fraction of the peak) and runs."""

    batch_shape: tuple[int, ...]
    target_shape: tuple[int, ...] | None = None
    input_dtype: str = "float"
    vocab: int | None = None
    device: str = "cpu"
    steps: int = 3
    budget_bytes: int | None = None
    fraction: float = 0.5
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    granularity: Granularity = Granularity.CHUNK
    offload_params: bool = False
    plan_cache_dir: str | None = None
    storage_dir: str | None = None

    def batch(self) -> tuple[Batch, int]:
        """The random batch and the number of target classes."""
        return make_batch(
            self.batch_shape, self.target_shape, self.input_dtype, self.vocab, self.device
        )


def measure(request: PlanRequest, build: Builder, progress: Progress) -> Outcome:
    """Run the plain, unmanaged and managed iterations; raises ``InfeasibleBudgetError``."""
    batch, classes = request.batch()
    # Plain steps first: a process's first iteration allocates what kernels keep for later,
    # which would inflate the unmanaged peak (docs/vtensor.md, Limits).
    progress(f"{request.steps} plain steps (no manager): reference time and weights")
    reference, plain_s = train(build, batch, classes, request.steps, None)
    with tempfile.TemporaryDirectory(prefix="vtensor-plan-") as scratch:
        storage = request.storage_dir or scratch
        progress("one step at a 1TiB budget: the unmanaged peak and trace")
        with MemoryManager("1TiB", storage_dir=storage) as probe:
            train(build, batch, classes, 1, probe)
        assert probe.trace is not None  # a first iteration is always profiled
        peak = probe.report().peak_device_bytes
        budget = request.budget_bytes or int(peak * request.fraction)
        progress(f"unmanaged peak {format_bytes(peak)}, budget {format_bytes(budget)}")
        mm = MemoryManager(
            budget,
            chunk_bytes=request.chunk_bytes,
            storage_dir=storage,
            granularity=request.granularity,
            plan_cache_dir=request.plan_cache_dir,
        )
        with mm:
            managed, failure, replayed = _train_managed(
                build, batch, classes, request.steps, mm, progress, request.offload_params
            )
    if failure is not None and not mm.reports:
        floor, step = planner_minimum(probe.trace, mm.chunk_size)
        progress(f"planner's minimum on the unmanaged trace: {format_bytes(floor)} at {step!r}")
        raise failure
    same = all(map(torch.equal, reference.state_dict().values(), managed.state_dict().values()))
    trace = mm.trace or probe.trace
    plan = replayed if replayed is not None else _plan_at(trace, budget, mm.chunk_size)
    return Outcome(
        probe.report(),
        probe.trace,
        statistics.median(plain_s),
        budget,
        mm.chunk_size,
        mm.reports,
        mm.trace,
        plan,
        same and failure is None,
        None if failure is None else str(failure),
    )


def _train_managed(
    build: Builder,
    batch: Batch,
    classes: int,
    steps: int,
    mm: MemoryManager,
    progress: Progress,
    offload_params: bool = False,
) -> tuple[nn.Module, InfeasibleBudgetError | None, Plan | None]:
    """Train under ``mm`` until it breaks the budget; the model, why, and the plan replayed."""
    model = build().to(batch[0].device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with contextlib.ExitStack() as stack:
        offload = None
        try:
            if offload_params:
                offload = stack.enter_context(
                    ParamOffload(
                        model,
                        opt,
                        mm.budget_bytes,
                        chunk_bytes=mm.chunk_bytes,
                        storage_dir=mm.storage_dir,
                    )
                )
            for i in range(steps):
                progress(f"managed iteration {i + 1}/{steps} at {format_bytes(mm.budget_bytes)}")
                _iteration(model, opt, batch, classes, mm, offload)
                _progress_line(mm, progress)
        except InfeasibleBudgetError as err:
            progress(f"  stopped: {err}")
            return model, err, None
        replayed = mm.plan_for(model, batch, offload)
    return model, None, replayed


def _progress_line(mm: MemoryManager, progress: Progress) -> None:
    rep = mm.report()
    progress(
        f"  {rep.plan_source}: peak {format_bytes(rep.peak_device_bytes)}, "
        f"moved {format_bytes(rep.bytes_moved)}, stall {rep.stall_s:.3f} s"
    )
