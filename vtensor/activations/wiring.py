"""What one managed iteration installs on the model: module hooks, recomputation, unit profiling."""

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from vtensor.activations.encodings import masks_encoded
from vtensor.activations.hooks import install_module_hooks, make_saved_tensor_hooks
from vtensor.activations.iteration import Iteration
from vtensor.activations.iteration_plan import IterationPlan
from vtensor.activations.model_state import ModelScan
from vtensor.activations.quiet import Turn, WatchedBoundaries
from vtensor.activations.recompute import recompute_modules
from vtensor.activations.sparse import BothBoundaries, SparseBoundaries, acting_steps
from vtensor.activations.units import UnitRecorder
from vtensor.activations.windows import SaveLog, WindowedSaves


@contextlib.contextmanager
def instrumented(
    model: nn.Module,
    scan: ModelScan,
    iteration: Iteration,
    chosen: IterationPlan,
) -> Iterator[None]:
    """``model`` hooked to ``iteration`` for one step; everything comes off at the end.

    The modules ``chosen`` recomputes, or the plan it replays, are recomputed (NOTE [recompute]
    in ``activations/recompute.py``); otherwise, if ``chosen`` finds units, the profile records
    which modules could be. If ``chosen`` encodes, clamps save bits (NOTE [mask encoding] in
    ``activations/encodings.py``). Saved tensors go through the manager's hooks, except in a
    quiet replay, which reads at its watched steps' modules only (NOTE [quiet replay]).
    """
    plan = chosen.executor.plan if chosen.executor is not None else chosen
    # A quiet replay makes none (NOTE [quiet replay]).
    hooks_pair = None if iteration.quiet else make_saved_tensor_hooks(iteration)
    windowed = False  # NOTE [windowed saves] in activations/windows.py
    with contextlib.ExitStack() as stack:
        turn = iteration.turn
        if turn is Turn.QUIET:  # NOTE [quiet replay] in activations/quiet.py
            assert chosen.executor is not None
            watched = WatchedBoundaries(model, scan, chosen.executor.plan, iteration)
            stack.callback(watched.remove)
        elif turn is Turn.SPARSE:  # NOTE [sparse replay] in activations/sparse.py
            sparse = _sparse(model, scan, iteration, chosen, verify=False)
            stack.callback(sparse.remove)
            iteration.boundaries = iteration.sparse = sparse
            windows = iteration.windows()
            if windows is not None and hooks_pair is not None:
                assert chosen.executor is not None
                chosen.executor.follow(windows.order)
                saves = WindowedSaves(model, scan, windows, hooks_pair, iteration)
                stack.callback(saves.remove)
                windowed = True
        elif not iteration.hookless:  # NOTE [hookless replay] in activations/lean.py
            hooks = install_module_hooks(scan.names, iteration, sample_nodes=not iteration.lean)
            stack.callback(hooks.remove)
            iteration.boundaries = hooks
            if turn is Turn.CHECK_SPARSE and iteration.lean:  # its counting checked beside
                sparse = _sparse(model, scan, iteration, chosen, verify=True)
                stack.callback(sparse.remove)
                stack.callback(iteration.prove_sparse, sparse)  # once backward is done
                iteration.boundaries = BothBoundaries(hooks, sparse)
                assert chosen.executor is not None
                log = iteration.save_log = SaveLog(scan.names, chosen.executor, iteration)
                log.pack = hooks_pair[0] if hooks_pair is not None else None
                stack.callback(log.remove)
        if plan.recompute:
            iteration.recomputed, iteration.selective = plan.recompute, plan.selective
            stack.enter_context(
                recompute_modules(
                    model,
                    plan.recompute,
                    iteration,
                    plan.selective,
                    chosen.regrowth,
                    one_node=plan.one_node,
                )
            )
        elif chosen.find_units:
            books = iteration.books
            iteration.units = UnitRecorder(model, iteration, books.tensors, books.highs)
            for hook in iteration.units.install():
                stack.callback(hook.remove)
        if chosen.encode and scan.maskable:
            # After the recomputation's wrappers: a recomputed clamp keeps its own forward.
            iteration.encoded = stack.enter_context(masks_encoded(scan.maskable, scan.names)) > 0
        if hooks_pair is not None and not windowed:
            stack.enter_context(saved_tensors_hooks(*hooks_pair))
        yield


def _sparse(
    model: nn.Module, scan: ModelScan, iteration: Iteration, chosen: IterationPlan, *, verify: bool
) -> SparseBoundaries:
    """The hooks of the steps ``chosen``'s plan acts at (NOTE [sparse replay])."""
    assert chosen.executor is not None
    plan = chosen.executor.plan
    return SparseBoundaries(model, scan, plan, iteration, acting_steps(plan), verify=verify)
