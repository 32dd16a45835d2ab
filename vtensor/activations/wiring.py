"""What one managed iteration installs on the model: module hooks, recomputation, unit profiling."""

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from vtensor.activations.encode import masks_encoded
from vtensor.activations.model_state import ModelScan
from vtensor.activations.plan.iteration_plan import IterationPlan
from vtensor.activations.recompute.checkpointed import recompute_modules
from vtensor.activations.recompute.profile.units import UnitRecorder
from vtensor.activations.runtime.hooks import install_module_hooks, make_saved_tensor_hooks
from vtensor.activations.runtime.iteration import Iteration


@contextlib.contextmanager
def instrumented(
    model: nn.Module,
    scan: ModelScan,
    iteration: Iteration,
    chosen: IterationPlan,
) -> Iterator[None]:
    """``model`` hooked to ``iteration`` for one step; everything comes off at the end.

    Recomputes what ``chosen`` says (NOTE [recompute]), else may record which modules could be;
    encodes clamps if it says so (NOTE [mask encoding]).
    """
    recomputation = chosen.recompute
    units = None
    encoded = False
    with contextlib.ExitStack() as stack:
        if not iteration.hookless:  # NOTE [hookless replay]
            hooks = install_module_hooks(scan.names, iteration, sample_nodes=not iteration.lean)
            stack.callback(hooks.remove)
        if recomputation.names:
            stack.enter_context(
                recompute_modules(model, recomputation.names, iteration, recomputation.regrowth)
            )
        elif chosen.find_units:
            books = iteration.books
            units = UnitRecorder(model, iteration, books.tensors, books.highs)
            for hook in units.install():
                stack.callback(hook.remove)
        if chosen.encode and scan.maskable:
            # After the recomputation's wrappers: a recomputed clamp keeps its own forward.
            encoded = stack.enter_context(masks_encoded(scan.maskable, scan.names)) > 0
        iteration.wired(recomputation.names, units, encoded)
        stack.enter_context(saved_tensors_hooks(*make_saved_tensor_hooks(iteration)))
        yield
