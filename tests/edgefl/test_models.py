import pytest
import torch

from edgefl.data import DataKind, DatasetInfo
from edgefl.errors import ConfigError, ModelDataMismatchError
from edgefl.models import MODEL_NAMES, build_model
from edgefl.train import loss_fn

IMAGE = DatasetInfo("img", DataKind.IMAGE, (1, 28, 28), 10)
SENSOR = DatasetInfo("sensor", DataKind.SENSOR, (6, 128), 6)
TOKENS = DatasetInfo("text", DataKind.TOKENS, (32,), 96)
INPUTS = {
    "mlp": (IMAGE, torch.randn(3, 1, 28, 28)),
    "cnn": (IMAGE, torch.randn(3, 1, 28, 28)),
    "mobilenet_v2": (IMAGE, torch.randn(3, 1, 28, 28)),
    "resnet": (IMAGE, torch.randn(3, 1, 28, 28)),
    "sensor_cnn": (SENSOR, torch.randn(3, 6, 128)),
    "char_gpt": (TOKENS, torch.randint(0, 96, (3, 32))),
}


def test_zoo_is_covered() -> None:
    assert set(INPUTS) == set(MODEL_NAMES)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_trains_one_step(name: str) -> None:
    info, x = INPUTS[name]
    model = build_model(name, info)
    logits = model(x)
    y = torch.randint(0, info.num_classes, logits.shape[:-1])
    loss_fn(logits, y).backward()
    assert all(p.grad is not None for p in model.parameters())
    assert not any(b.dtype == torch.int64 for b in model.buffers())  # no BatchNorm counters


def test_model_refuses_data_of_another_kind() -> None:
    with pytest.raises(ModelDataMismatchError, match="model=sensor_cnn"):
        build_model("cnn", SENSOR)


def test_model_rejects_unknown_options() -> None:
    with pytest.raises(ConfigError, match="rejected its options"):
        build_model("cnn", IMAGE, {"depth": 3})


def test_mlp_is_the_2nn_grown_to_four_layers_of_1024() -> None:
    """The main job's model: 784-1024-1024-1024-1024-10, evenly sized layers, no norm layers."""
    model = build_model("mlp", IMAGE, {"hidden": 1024, "layers": 4})
    shapes = [tuple(p.shape) for p in model.parameters() if p.dim() == 2]
    assert shapes == [(1024, 784), (1024, 1024), (1024, 1024), (1024, 1024), (10, 1024)]
    assert sum(p.numel() for p in model.parameters()) == 3_962_890
