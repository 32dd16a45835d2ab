"""Training with parameters, gradients and optimizer state offloaded is bit-identical to without.

Each case trains a model three steps from the same seed twice: plainly (``optimizer.step()``,
``clip_grad_norm_`` when clipping, micro-batch losses divided by their count) and under
``vtensor.ParamOffload`` at a budget below the parameters' own bytes. Losses and the final
``state_dict`` (weights and BatchNorm statistics) must match bit for bit, and the exact resident
peak of parameters, gradients and optimizer state must stay within the budget. The optimizers
run with torch's CPU default implementation (single-tensor, ``foreach`` off) on both sides.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import vtensor
from benchmarks.zoo import TiedEmbeddingLM, TransformerBlock
from vtensor import ParamOffload, ParamOffloadError
from vtensor.planner.trace import TensorKind

STEPS = 3
CHUNK_BYTES = 64 * 1024
VOCAB, SEQ = 64, 16


def build_mlp() -> nn.Module:
    """Eight 128-wide linear layers: no layer holds more than a sixth of the parameters."""
    layers: list[nn.Module] = [nn.Linear(32, 128)]
    for _ in range(6):
        layers += [nn.ReLU(), nn.Linear(128, 128)]
    return nn.Sequential(*layers, nn.ReLU(), nn.Linear(128, 10))


def build_cnn() -> nn.Module:
    """Nine 3x3 convolutions of 32 channels with BatchNorm (small tensors, running statistics)."""
    layers: list[nn.Module] = [nn.Conv2d(3, 32, 3, padding=1)]
    for _ in range(8):
        layers += [nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1, bias=False)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


class TiedTransformer(nn.Module):
    """Token embedding tied to the output head (one Parameter in two modules), a position
    Parameter owned by the root (whose forward encloses every other layer), four blocks."""

    def __init__(self) -> None:
        super().__init__()
        dim = 64
        self.tok = nn.Embedding(VOCAB * 4, dim)
        self.pos = nn.Parameter(torch.randn(SEQ, dim) * 0.02)
        self.blocks = nn.Sequential(*(TransformerBlock(dim, 4) for _ in range(4)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB * 4, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.blocks(self.tok(tokens) + self.pos[: tokens.shape[1]])
        logits: Tensor = self.head(self.ln(h))
        return logits


@dataclass(frozen=True)
class Model:
    build: Callable[[], nn.Module]
    batch: Callable[[int], tuple[Tensor, Tensor]]
    loss: Callable[[Tensor, Tensor], Tensor]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + seed)


def _vectors(seed: int) -> tuple[Tensor, Tensor]:
    gen = _generator(seed)
    return torch.randn(8, 32, generator=gen), torch.randint(0, 10, (8,), generator=gen)


def _images(seed: int) -> tuple[Tensor, Tensor]:
    gen = _generator(seed)
    return torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 10, (4,), generator=gen)


def _tokens(seed: int, vocab: int = VOCAB * 4) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(0, vocab, (4, SEQ + 1), generator=_generator(seed))
    return tokens[:, :-1], tokens[:, 1:]


def _lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    loss: Tensor = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return loss


MODELS = {
    "mlp": Model(build_mlp, _vectors, F.cross_entropy),
    "cnn": Model(build_cnn, _images, F.cross_entropy),
    "tied_transformer": Model(TiedTransformer, _tokens, _lm_loss),
}
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1),
}
# (micro-batches per step, max_grad_norm): the clip norm is below the gradients' norms, so
# clipping really scales them.
MODES = {
    "plain": (1, None),
    "accumulate": (3, None),
    "clip": (1, 0.05),
    "accumulate_clip": (2, 0.05),
}


@dataclass
class Run:
    losses: list[Tensor]
    state: dict[str, Tensor]
    report: vtensor.ParamOffloadReport | None = None


def _train(
    model_name: str,
    make_opt: Callable[[Any], torch.optim.Optimizer],
    accumulation: int,
    clip: float | None,
    offload: dict[str, Any] | None = None,
) -> Run:
    spec = MODELS[model_name]
    torch.manual_seed(0)
    model = spec.build()
    optimizer = make_opt(model.parameters())
    po = None
    if offload is not None:
        po = ParamOffload(
            model,
            optimizer,
            accumulation_steps=accumulation,
            max_grad_norm=clip,
            chunk_bytes=CHUNK_BYTES,
            **offload,
        )
    losses = []
    for step in range(STEPS):
        for micro in range(accumulation):
            inputs, targets = spec.batch(step * accumulation + micro)
            torch.manual_seed(step * 100 + micro)  # dropout draws the same masks in both runs
            loss = spec.loss(model(inputs), targets) / accumulation
            loss.backward()  # type: ignore[no-untyped-call]
            losses.append(loss.detach())
        if po is not None:
            po.step()
        else:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
    report = None
    if po is not None:
        report = po.report()
        po.close()
    return Run(losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, report)


def _assert_identical(want: Run, got: Run, what: str) -> None:
    for i, (a, b) in enumerate(zip(want.losses, got.losses, strict=True)):
        assert torch.equal(a, b), f"{what}: loss {i} differs: {a.item()!r} vs {b.item()!r}"
    for name, value in want.state.items():
        diff = (value.double() - got.state[name].double()).abs().max().item()
        assert torch.equal(value, got.state[name]), f"{what}: {name} differs (max {diff:.3g})"


def _param_bytes(model_name: str) -> int:
    torch.manual_seed(0)
    model = MODELS[model_name].build()
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_param_offload_training_is_bit_identical_below_the_parameter_bytes(
    model_name: str, opt_name: str, mode: str, tmp_storage_dir: Path
) -> None:
    accumulation, clip = MODES[mode]
    make_opt = OPTIMIZERS[opt_name]
    params = _param_bytes(model_name)
    probe = _train(model_name, make_opt, accumulation, clip, {"budget": "1TiB"})
    assert probe.report is not None
    budget = max(probe.report.min_budget_bytes, int(0.8 * params))
    what = f"{model_name}/{opt_name}/{mode} at {budget} bytes (parameters {params})"
    assert budget < params, f"{what}: the model is too small to test below its parameters"

    got = _train(
        model_name, make_opt, accumulation, clip, {"budget": budget, "storage_dir": tmp_storage_dir}
    )
    _assert_identical(_train(model_name, make_opt, accumulation, clip), got, what)
    report = got.report
    assert report is not None and report.steps == STEPS
    assert report.footprint_bytes >= 3 * params - 1, f"{what}: {report}"
    assert 0 < report.peak_resident_bytes <= budget, f"{what}: {report}"
    assert report.bytes_out > 0 and report.bytes_in > 0, f"{what}: nothing moved: {report}"
    assert list(tmp_storage_dir.iterdir()) == [], f"{what}: the swap file has a name"


def test_param_offload_meter_matches_the_tensors_in_memory(tmp_storage_dir: Path) -> None:
    torch.manual_seed(0)
    model = build_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with ParamOffload(model, optimizer, budget="600KiB", storage_dir=tmp_storage_dir) as po:
        for step in range(2):
            inputs, targets = _vectors(step)
            F.cross_entropy(model(inputs), targets).backward()  # type: ignore[no-untyped-call]
            po.step()
            po.pool.reap(block=True)
            tensors = [*model.parameters()]
            tensors += [t for s in optimizer.state.values() for t in s.values()]
            storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
            # Independent count: what the storages hold now (offloaded ones hold 0 bytes).
            assert po.report().resident_bytes == sum(storages.values())
            assert sum(storages.values()) < po.report().footprint_bytes / 4
        assert str(po.report()).startswith("2 steps: parameters, gradients and optimizer state")
    assert all(p.untyped_storage().nbytes() == p.numel() * 4 for p in model.parameters())


def test_param_offload_budget_below_one_layer_names_the_smallest(tmp_storage_dir: Path) -> None:
    torch.manual_seed(0)
    model = build_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(vtensor.InfeasibleBudgetError) as caught:
        ParamOffload(model, optimizer, budget="64KiB", storage_dir=tmp_storage_dir)
    smallest = caught.value.min_budget_bytes
    # One 128x128 layer: weight, its gradient and Adam's two moments, plus the small tensors.
    assert smallest >= 4 * 128 * 128 * 4
    assert str(smallest) in str(caught.value) and "layer" in str(caught.value)
    assert list(tmp_storage_dir.iterdir()) == []
    run = _train("mlp", OPTIMIZERS["adamw"], 1, None, {"budget": smallest})
    assert run.report is not None and run.report.peak_resident_bytes <= smallest


def test_param_offload_functional_use_outside_its_module_is_refused_then_kept_resident(
    tmp_storage_dir: Path,
) -> None:
    torch.manual_seed(0)
    model = TiedEmbeddingLM(vocab=VOCAB)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tokens, targets = _tokens(0, VOCAB)
    with ParamOffload(model, optimizer, budget="1MiB", storage_dir=tmp_storage_dir):
        with pytest.raises(ParamOffloadError, match=r"embed\.weight.*resident=\['embed'\]"):
            model(tokens)
    # With the embedding kept resident, training matches unmanaged training.
    runs = []
    for offload in (False, True):
        torch.manual_seed(0)
        model = TiedEmbeddingLM(vocab=VOCAB)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        po = ParamOffload(
            model, optimizer, budget="1MiB", resident=("embed",), storage_dir=tmp_storage_dir
        )
        if not offload:
            po.close()
        for step in range(STEPS):
            tokens, targets = _tokens(step, VOCAB)
            _lm_loss(model(tokens), targets).backward()  # type: ignore[no-untyped-call]
            if offload:
                po.step()
            else:
                optimizer.step()
                optimizer.zero_grad()
        po.close()
        runs.append(model.state_dict())
    for name, value in runs[0].items():
        assert torch.equal(value, runs[1][name]), name


def test_param_offload_leaves_nothing_on_disk_after_an_exception(tmp_storage_dir: Path) -> None:
    torch.manual_seed(0)
    model = build_mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        with ParamOffload(model, optimizer, budget="300KiB", storage_dir=tmp_storage_dir):
            model(torch.randn(2, 7))  # wrong width: the first layer's matmul raises
    assert list(tmp_storage_dir.iterdir()) == []
    for name, value in model.state_dict().items():  # all back in memory, unchanged
        assert torch.equal(value, before[name]), name


def test_param_offload_step_needs_the_configured_backward_passes(tmp_storage_dir: Path) -> None:
    torch.manual_seed(0)
    model = build_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with ParamOffload(
        model, optimizer, budget="1MiB", accumulation_steps=2, storage_dir=tmp_storage_dir
    ) as po:
        inputs, targets = _vectors(0)
        F.cross_entropy(model(inputs), targets).backward()  # type: ignore[no-untyped-call]
        with pytest.raises(
            ParamOffloadError, match="after 1 backward passes; accumulation_steps=2:"
        ):
            po.step()


def test_param_offload_refuses_an_optimizer_missing_a_trainable_parameter() -> None:
    model = build_mlp()
    optimizer = torch.optim.SGD(list(model.parameters())[2:], lr=0.1)
    with pytest.raises(ParamOffloadError, match=r"'0\.weight' requires grad but is not in the"):
        ParamOffload(model, optimizer, budget="1MiB")


def test_composes_with_the_activation_manager_bit_identically(tmp_storage_dir: Path) -> None:
    """Parameters, gradients and AdamW state under ParamOffload, activations under a
    MemoryManager at 70 % of their unmanaged peak: both budgets hold, weights match."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Conv2d(3, 32, 3, padding=1)]
        for _ in range(6):
            layers += [nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1)]
        return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

    torch.manual_seed(1)
    batches = [(torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))) for _ in range(STEPS)]
    reference = build()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for x, y in batches:
        optimizer.zero_grad()
        F.cross_entropy(reference(x), y).backward()  # type: ignore[no-untyped-call]
        optimizer.step()

    model = build()
    with vtensor.MemoryManager(1 << 40, storage_dir=tmp_storage_dir) as probe:
        with probe.step(model, None, (batches[0][0],)):
            F.cross_entropy(model(batches[0][0]), batches[0][1]).backward()  # type: ignore[no-untyped-call]
        activation_peak = probe.report().peak_device_bytes
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    footprint = 4 * sum(p.nbytes for p in model.parameters())  # weights, grads, 2 Adam moments
    with (
        ParamOffload(
            model, optimizer, footprint // 4, chunk_bytes=CHUNK_BYTES, storage_dir=tmp_storage_dir
        ) as po,
        vtensor.MemoryManager(
            int(0.7 * activation_peak), chunk_bytes=CHUNK_BYTES, storage_dir=tmp_storage_dir
        ) as mm,
    ):
        for x, y in batches:
            with mm.step(model, None, (x,)):
                F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
            po.step()
            report = mm.report()
            # The guard acts on bytes over the budget by more than a chunk (its overshoot).
            assert report.peak_device_bytes <= report.budget_bytes + CHUNK_BYTES
            assert report.bytes_out > 0
        assert po.report().peak_resident_bytes <= footprint // 4
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_a_convolutional_model_clips_and_trains_bit_identically_under_a_manager(
    tmp_path: Path,
) -> None:
    """A convolution's weight, saved without its use count showing it, comes in for backward."""

    def conv_model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(16 * 16 * 16, 10),
        )

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g))]
    batches *= 3
    reference = conv_model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches:
        nn.functional.cross_entropy(reference(x), y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    model = conv_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    budget = 4 << 20
    with (
        vtensor.ParamOffload(model, opt, budget, max_grad_norm=1.0, storage_dir=tmp_path) as po,
        vtensor.MemoryManager(budget, chunk_bytes=64 << 10, storage_dir=tmp_path) as mm,
    ):
        for x, y in batches:
            with mm.step(model, inputs=(x, y), params=po):
                nn.functional.cross_entropy(model(x), y).backward()
            po.step()
    pairs = zip(reference.state_dict().values(), model.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_torchs_attention_uses_its_out_projection_within_its_own_unit(tmp_path: Path) -> None:
    """NOTE [torch's own modules]: ``nn.MultiheadAttention`` hands ``out_proj.weight`` over."""

    def encoder() -> nn.Module:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        return nn.Sequential(layer, nn.Flatten(), nn.Linear(8 * 32, 10))

    x, y = torch.randn(4, 8, 32), torch.randint(0, 10, (4,))
    reference = encoder()
    opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for _ in range(2):
        F.cross_entropy(reference(x), y).backward()
        opt.step()
        opt.zero_grad()
    model = encoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with ParamOffload(model, opt, "1MiB", storage_dir=tmp_path) as po:
        for _ in range(2):
            F.cross_entropy(model(x), y).backward()
            po.step()
    pairs = zip(reference.state_dict().values(), model.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_a_joint_pool_announces_what_a_use_allocates_and_counts_what_it_would_hold(
    tmp_storage_dir: Path,
) -> None:
    # NOTE [offload probe] in vtensor/activations/offloads.py; a use's gradient and new state come
    # without a hook point, so the activation side sharing the budget must hear of them first.
    torch.manual_seed(0)
    model = build_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with ParamOffload(model, optimizer, budget="600KiB", storage_dir=tmp_storage_dir) as po:
        pool = po.pool
        pool.reap(block=True)
        announced: list[int] = []
        pool.connect(None, announced.append)
        held = sum(e.nbytes for e in pool.tensors if not pool.is_fixed(e))
        assert pool.unoffloaded_bytes() == held
        entry = next(e for e in pool.tensors if not e.in_memory)
        pool.acquire([entry], "a use", extra_bytes=1000)
        assert announced == [entry.nbytes + 1000]
        pool.release(entry)
        grad = pool.adopt(torch.zeros(128, 128), "g", TensorKind.GRAD, fixed=False)
        state = pool.adopt(torch.zeros(128, 128), "s", TensorKind.STATE, fixed=False)
        pool.forget(grad)  # used and forgotten: autograd would keep it until zero_grad
        pool.forget(state)
        # State made during the step is state to come, counted apart.
        assert pool.unoffloaded_bytes() == held + grad.nbytes
        pool.disconnect(keep_listener=False)
