"""Plain torch loops for local training and evaluation: where they enter vtensor, by which rules.

The memory rules: parameters are offloaded with the activations when they crowd the budget
(``offload_setting``), never under FedProx (NOTE [offloading under FedProx]); evaluation
streams the parameters layer by layer when they alone would crowd it (``streams_layers``).
"""

import contextlib
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import vtensor
from edgefl.data.arrays import ArrayDataset
from edgefl.errors import ClientBudgetError, ConfigError
from edgefl.settings import OffloadParams, TrainSettings, VTensorSettings


@dataclass(frozen=True)
class TrainOutcome:
    """Summary of one round of local training (vtensor figures summed or maxed over steps)."""

    num_examples: int  # distinct examples trained on (FedAvg's weight)
    examples_processed: int  # examples through the model, counting each epoch's pass
    loss: float  # mean training loss over the round's batches
    steps: int
    train_s: float
    train_cpu_s: float  # CPU time of this process (every thread) over the same span
    peak_device_bytes: int  # max over steps; 0 with vtensor off
    bytes_out: int
    bytes_in: int
    stall_s: float
    transfer_s: float
    plan_source: vtensor.PlanSource | None  # first step's, or FALLBACK if any step's; None: off


@dataclass(frozen=True)
class LocalRound:
    """What one round of local training does: SGD's settings, the batches, FedProx's term."""

    lr: float
    momentum: float
    epochs: int
    batch_size: int
    seed: int  # shuffles the batches
    proximal_mu: float = 0.0  # FedProx's mu; 0 = plain SGD
    # > 0: the round ends after that many examples (a server's cap on a slow device's work;
    # the last batch is cut to fit); 0: ``epochs`` full passes.
    max_examples: int = 0


def settings_round(train: TrainSettings, seed: int, max_examples: int = 0) -> LocalRound:
    """The local round ``train`` describes (a client's where the server's config is silent)."""
    return LocalRound(
        lr=train.lr,
        momentum=train.momentum,
        epochs=train.local_epochs,
        batch_size=train.batch_size,
        seed=seed,
        max_examples=max_examples,
    )


@dataclass(frozen=True)
class EvalOutcome:
    """Loss and accuracy (per token for text) on a dataset."""

    num_examples: int
    loss: float
    accuracy: float


# NOTE [deterministic ops]: ``torch.use_deterministic_algorithms`` also sets the flag of
# torch.compile's inductor, and importing the inductor for it takes about 2 s: paid by every
# process, and a deployed node starts one per message (Flower's process per message). edgefl
# never compiles, so only the flag of the eager ops is set, as that function sets it.
def seed_everything(seed: int, threads: int) -> None:
    """Make a client's round deterministic: one seed, a fixed thread count, deterministic ops."""
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    torch._C._set_deterministic_algorithms(True, warn_only=True)  # NOTE [deterministic ops]


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over classes, or over every position for (batch, time, vocab) logits."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# NOTE [offloading under FedProx]: FedProx's proximal term reads every parameter outside its
# layer's forward, which parameter offloading (each parameter resident only while its layer
# runs) cannot serve. So ``offload_params=on`` with a proximal term is a config error
# (``check_offload_params``, called by edgefl.config and by ``train_local``), and ``auto``
# leaves the parameters resident under FedProx (``offloads_params``).
def offloadable(proximal_mu: float) -> bool:
    """Whether a round's loss lets vtensor offload the parameters: not with a proximal term."""
    return proximal_mu == 0


def check_offload_params(offload: bool, proximal_mu: float) -> None:
    """Refuse to offload the parameters under FedProx's proximal term.

    Raises:
        ConfigError: ``offload`` with ``proximal_mu`` > 0 (NOTE [offloading under FedProx]).
    """
    if offload and not offloadable(proximal_mu):
        raise ConfigError(
            f"vtensor.offload_params=on with a proximal term (proximal_mu={proximal_mu} > 0): "
            "FedProx reads every parameter outside its layer's forward, which parameter "
            "offloading cannot serve; use vtensor.offload_params=auto or off"
        )


def offload_setting(settings: VTensorSettings, proximal_mu: float) -> bool | str:
    """The manager's ``offload_params`` for a round (``vtensor.offload_params``).

    ``auto``: vtensor's rule, when the parameters, gradients and optimizer state would take
    more than half the budget (NOTE [offload auto] in vtensor/offload/joint.py); never under
    FedProx (NOTE [offloading under FedProx]) or with whole-tensor swapping.
    """
    mode = settings.offload_params
    if not settings.enabled or mode == OffloadParams.OFF:
        return False
    if mode == OffloadParams.ON:
        return True  # train_within_budget refuses it under FedProx
    chunked = settings.granularity == vtensor.Granularity.CHUNK
    return "auto" if offloadable(proximal_mu) and chunked else False


def streams_layers(settings: VTensorSettings, model: nn.Module, budget_bytes: int) -> bool:
    """Whether evaluation streams the parameters layer by layer: they exceed half the budget."""
    return settings.enabled and parameter_bytes(model) > budget_bytes // 2


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's state (parameters and buffers)."""
    return sum(t.nbytes for t in model.state_dict().values())


def open_manager(
    settings: VTensorSettings,
    budget_bytes: int,
    plan_cache_dir: Path,
    offload_params: bool | str = False,
) -> vtensor.MemoryManager | None:
    """A MemoryManager for this client's budget, or None when vtensor is off.

    ``plan_cache_dir`` (created here) is vtensor's plan cache; virtual clients of one device
    class share it, so one profiles the model and the others start from its plan.
    """
    if not settings.enabled:
        return None
    plan_cache_dir.mkdir(parents=True, exist_ok=True)
    return vtensor.MemoryManager(
        budget_bytes,
        chunk_bytes=settings.chunk_bytes,
        storage_dir=settings.storage_dir,
        granularity=settings.granularity,
        plan_cache_dir=plan_cache_dir,
        recompute=settings.recompute,
        encode_masks=settings.encode_masks,
        offload_params=offload_params,
    )


def train_within_budget(
    model: nn.Module,
    data: ArrayDataset,
    local: LocalRound,
    *,
    settings: VTensorSettings,
    budget_bytes: int,
    plan_cache_dir: Path,
) -> TrainOutcome:
    """``train_local`` under a MemoryManager of ``budget_bytes`` (vtensor on), closed after.

    The parameters are offloaded as ``offload_setting`` says; ``plan_cache_dir`` is the plan
    cache (see ``open_manager``).

    Raises:
        ClientBudgetError: vtensor could not meet the budget.
        ConfigError: ``offload_params=on`` under FedProx (NOTE [offloading under FedProx]).
    """
    offload = offload_setting(settings, local.proximal_mu)
    check_offload_params(offload is True, local.proximal_mu)
    manager = open_manager(settings, budget_bytes, plan_cache_dir, offload)
    try:
        return train_local(model, data, local, manager=manager)
    finally:
        if manager is not None:
            manager.close()


def train_local(
    model: nn.Module,
    data: ArrayDataset,
    local: LocalRound,
    *,
    manager: vtensor.MemoryManager | None = None,
) -> TrainOutcome:
    """Train ``model`` in place with SGD; every iteration runs under ``manager`` when given.

    The manager holds the whole training state under its one budget, the parameters,
    gradients and momentum too where it offloads them; the weights are the same bit for bit.
    The bytes it moves count in the outcome's.

    Raises:
        ClientBudgetError: vtensor could not meet the budget.
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=local.lr, momentum=local.momentum)
    mu = local.proximal_mu
    anchor = [p.detach().clone() for p in model.parameters()] if mu > 0 else []
    rng = np.random.default_rng(local.seed)
    losses: list[float] = []
    peak = out = back = 0
    stall = transfer = 0.0
    source: vtensor.PlanSource | None = None
    processed = 0
    model.train()
    started, cpu_started = time.perf_counter(), time.process_time()
    for x, y in _batches(data, local.batch_size, local.epochs, rng, local.max_examples):
        processed += len(y)
        optimizer.zero_grad(set_to_none=True)
        with _managed(manager, model, optimizer, (x, y)):
            loss = loss_fn(model(x), y)
            if anchor:
                loss = loss + mu / 2 * sum(
                    (p - a).pow(2).sum() for p, a in zip(model.parameters(), anchor, strict=True)
                )
            loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()  # offloaded parameters were updated in backward: nothing is left
        losses.append(float(loss.detach()))
        if manager is not None:
            rep = manager.report()
            peak = max(peak, rep.peak_device_bytes)
            out, back = out + rep.bytes_out, back + rep.bytes_in
            stall, transfer = stall + rep.stall_s, transfer + rep.transfer_s
            if source is None or rep.plan_source == vtensor.PlanSource.FALLBACK:
                source = rep.plan_source  # the round's: its first step's, or fallback
    for moved in manager.offload_reports() if manager is not None else ():
        out, back = out + moved.bytes_out, back + moved.bytes_in  # the parameter side's
        stall += moved.stall_s
    return TrainOutcome(
        min(len(data), processed),
        processed,
        float(np.mean(losses)) if losses else 0.0,
        len(losses),
        time.perf_counter() - started,
        time.process_time() - cpu_started,
        peak,
        out,
        back,
        stall,
        transfer,
        source,
    )


@contextlib.contextmanager
def _managed(
    manager: vtensor.MemoryManager | None,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: tuple[torch.Tensor, ...],
) -> Iterator[None]:
    if manager is None:
        yield
        return
    try:
        with manager.step(model, optimizer, inputs):
            yield
    except vtensor.InfeasibleBudgetError as exc:
        raise ClientBudgetError(str(exc), exc.budget_bytes, exc.min_budget_bytes) from exc


def evaluate_within_budget(
    model: nn.Module,
    data: ArrayDataset,
    batch_size: int,
    *,
    settings: VTensorSettings,
    budget_bytes: int,
    scratch_dir: Path,
) -> EvalOutcome:
    """``evaluate``, streaming the parameters when ``streams_layers`` says they crowd the budget.

    The streamed weight file lives in a temporary folder under ``scratch_dir`` (created),
    removed afterwards.
    """
    if not streams_layers(settings, model, budget_bytes):
        return evaluate(model, data, batch_size)
    scratch_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch_dir) as tmp:
        weights = vtensor.write_weights(model.state_dict(), Path(tmp) / "model.vtw")
        return evaluate(model, data, batch_size, weights=weights)


def evaluate(
    model: nn.Module, data: ArrayDataset, batch_size: int, *, weights: Path | None = None
) -> EvalOutcome:
    """Mean loss and accuracy of ``model`` on ``data`` (inference saves no activations).

    With ``weights`` (a vtensor weight file of the model's state), the parameters are streamed
    from it layer by layer (``vtensor.DemandLayering``): only about two layers are resident.
    """
    model.eval()
    if weights is None:
        return _evaluate(model, data, batch_size)
    with vtensor.DemandLayering(model, weights, lookahead=1) as layered:
        return _evaluate(layered, data, batch_size)


@torch.no_grad()
def _evaluate(
    forward: Callable[[torch.Tensor], torch.Tensor], data: ArrayDataset, batch_size: int
) -> EvalOutcome:
    total_loss, correct, count = 0.0, 0, 0
    for start in range(0, len(data), batch_size):
        x = torch.from_numpy(data.x[start : start + batch_size])
        y = torch.from_numpy(data.y[start : start + batch_size])
        logits = forward(x)
        total_loss += float(loss_fn(logits, y)) * y.numel()
        correct += int((logits.argmax(-1) == y).sum())
        count += y.numel()
    return EvalOutcome(len(data), total_loss / max(count, 1), correct / max(count, 1))


def _batches(
    data: ArrayDataset,
    batch_size: int,
    epochs: int,
    rng: np.random.Generator,
    max_examples: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Shuffled mini-batches (the last, smaller one included) for ``epochs`` epochs.

    With ``max_examples`` > 0, batches stop once that many examples were yielded.
    """
    left = max_examples if max_examples > 0 else epochs * len(data)
    for _ in range(epochs):
        order = rng.permutation(len(data))
        for start in range(0, len(order), batch_size):
            if left <= 0:
                return
            idx = order[start : start + min(batch_size, left)]
            left -= len(idx)
            yield torch.from_numpy(data.x[idx]), torch.from_numpy(data.y[idx])
