"""Model names -> constructors, checked against the kind and shape of the dataset."""

from collections.abc import Callable
from typing import Any

from torch import nn

from edgefl.data.arrays import DataKind, DatasetInfo
from edgefl.errors import ConfigError, ModelDataMismatchError
from edgefl.models.char_gpt import CharGPT
from edgefl.models.cnn import SmallCNN
from edgefl.models.mlp import MLP
from edgefl.models.mobilenet import MobileNetV2Small
from edgefl.models.resnet import SmallResNet
from edgefl.models.sensor_cnn import SensorCNN


def _image(info: DatasetInfo, kw: dict[str, Any]) -> dict[str, Any]:
    return {"in_channels": info.example_shape[0], "num_classes": info.num_classes, **kw}


_BUILDERS: dict[str, tuple[DataKind, Callable[[DatasetInfo, dict[str, Any]], nn.Module]]] = {
    "mlp": (
        DataKind.IMAGE,
        lambda i, kw: MLP(i.example_shape, num_classes=i.num_classes, **kw),
    ),
    "cnn": (DataKind.IMAGE, lambda i, kw: SmallCNN(**_image(i, kw), image_size=i.example_shape[1])),
    "mobilenet_v2": (DataKind.IMAGE, lambda i, kw: MobileNetV2Small(**_image(i, kw))),
    "resnet": (DataKind.IMAGE, lambda i, kw: SmallResNet(**_image(i, kw))),
    "sensor_cnn": (DataKind.SENSOR, lambda i, kw: SensorCNN(**_image(i, kw))),
    "char_gpt": (
        DataKind.TOKENS,
        lambda i, kw: CharGPT(vocab_size=i.num_classes, seq_len=i.example_shape[0], **kw),
    ),
}
MODEL_NAMES = tuple(_BUILDERS)


def build_model(name: str, info: DatasetInfo, kwargs: dict[str, Any] | None = None) -> nn.Module:
    """Build model ``name`` for dataset ``info``; ``kwargs`` are the model's own options."""
    if name not in _BUILDERS:
        raise ConfigError(f"model={name!r} is unknown; choose one of {', '.join(MODEL_NAMES)}")
    kind, build = _BUILDERS[name]
    if kind is not info.kind:
        fits = [n for n, (k, _) in _BUILDERS.items() if k is info.kind]
        raise ModelDataMismatchError(
            f"model {name!r} takes {kind.value} data but dataset {info.name!r} is "
            f"{info.kind.value} data of shape {info.example_shape}; use model={' or '.join(fits)}"
        )
    try:
        return build(info, dict(kwargs or {}))
    except TypeError as exc:
        raise ConfigError(f"model {name!r} rejected its options {kwargs}: {exc}") from exc
