"""The ``torch.compile`` baseline of the activation benchmark: inductor under an activation budget.

``torch.compile``'s partitioner decides which forward values the backward saves and which it
recomputes; ``torch._functorch.config.activation_memory_budget`` (a fraction of the activations
the default partition saves) asks it to save less and recompute more. It is the baseline a user
who compiles would reach for. It is not bit-identical to eager training (inductor fuses and
reorders floating-point operations), and its first step compiles (timed apart, ``compile_s``).

Its peak cannot be read the way the eager variants' is: the compiled graph allocates its buffers
outside the saved-tensor hooks and the dispatcher, so neither the manager's tracking nor a
``LiveStorageTracker`` sees them. It is measured from outside, as the RSS figure of the other
rows: the bytes live at the start of the step plus the growth of the process's VmHWM over it
(honest under ``MALLOC_MMAP_THRESHOLD_=65536``, NOTE [honest RSS]).
"""

import gc
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch._functorch import config as functorch_config
from torch._inductor.compile_fx import compile_fx

from vtensor.measure.rss import RssMeter


def compile_under_budget(model: nn.Module, fraction: float) -> nn.Module:
    """``model`` compiled by inductor with ``activation_memory_budget=fraction``.

    The backend is a new callable per call: dynamo keys its cache on the backend too, so two
    models of one class compiled at two budgets get two graphs (with one shared backend, the
    second would silently run the first's partition).
    """

    def inductor_at_budget(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        # The partitioner reads the budget when it splits the joint graph, inside this call.
        with functorch_config.patch(activation_memory_budget=fraction):
            return compile_fx(gm, list(example_inputs))

    compiled: nn.Module = torch.compile(model, backend=inductor_at_budget)  # type: ignore[assignment]
    return compiled


def rss_step_peak(run_step: Callable[[], None], live_bytes: int) -> int:
    """``live_bytes`` (what is live before the step) plus the VmHWM growth over ``run_step``."""
    gc.collect()
    meter = RssMeter()
    try:
        meter.reset_peak()
        start = meter.current_rss_bytes()
        run_step()
        return live_bytes + max(0, meter.peak_rss_bytes() - start)
    finally:
        meter.close()
