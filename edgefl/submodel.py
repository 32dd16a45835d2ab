"""HeteroFL's client side: pick the widest sub-model whose unmanaged peak fits, train it, reply.

The strategy (``strategies.heterofl.HeteroFL``) sends the width ratios it allows; this client
measures the unmanaged training peak of the model scaled to each (vtensor's accounting, as for
the full model's peak), trains the widest that fits its budget without vtensor, and replies with
that sub-model's arrays (each a leading slice of the global array) and the ratio. No ratio
fitting is a budget error: the client takes no part in the round.
"""

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from torch import nn

from edgefl.data import ArrayDataset, DatasetInfo
from edgefl.errors import ConfigError
from edgefl.models import build_model
from edgefl.node import NodeProfile
from edgefl.peak import measure_unmanaged_peak, resolve_budget
from edgefl.records import ARRAYS, ERROR_CODE_BUDGET, METRICS, NODE, node_record, train_metrics
from edgefl.settings import ClientSettings
from edgefl.train import LocalRound, train_local
from strategies.heterofl import WIDTH_RATIO, WIDTH_RATIOS, check_ratios, scaled_width
from strategies.heterofl import slice_to_shapes as slice_to_shapes

logger = logging.getLogger(__name__)

# The options of each model that set a hidden layer's width (the first layer's input channels
# and the classes are the dataset's, so they stay full).
WIDTH_OPTIONS: dict[str, tuple[str, ...]] = {
    "cnn": ("width", "hidden"),
    "mlp": ("hidden",),
    "sensor_cnn": ("width",),
}
_DEFAULTS: dict[str, dict[str, int]] = {
    "cnn": {"width": 16, "hidden": 64},
    "mlp": {"hidden": 1024},
    "sensor_cnn": {"width": 32},
}


def scaled_options(model: str, options: Mapping[str, Any], ratio: float) -> dict[str, Any]:
    """The model's options with every hidden width scaled by ``ratio`` (HeteroFL's ceil(r * C)).

    Raises:
        ConfigError: the model has no width options to scale.
    """
    if model not in WIDTH_OPTIONS:
        raise ConfigError(
            f"model={model!r} has no width-scaled sub-models; HeteroFL supports "
            f"{sorted(WIDTH_OPTIONS)} (or use width_ratios=[1.0])"
        )
    out = dict(options)
    for name in WIDTH_OPTIONS[model]:
        out[name] = scaled_width(int(options.get(name, _DEFAULTS[model][name])), ratio)
    return out


def choose_ratio(budget_bytes: int, peaks_by_ratio: Mapping[float, int]) -> float | None:
    """The widest ratio whose unmanaged peak fits ``budget_bytes``; None when none does."""
    fitting = [r for r, peak in peaks_by_ratio.items() if peak <= budget_bytes]
    return max(fitting) if fitting else None


_PEAKS: dict[tuple[Any, ...], int] = {}


def submodel_peaks(
    settings: ClientSettings,
    info: DatasetInfo,
    data: ArrayDataset,
    batch_size: int,
    ratios: Sequence[float],
) -> dict[float, int]:
    """Unmanaged training peak bytes of the model scaled to each ratio (cached per process)."""
    peaks = {}
    for ratio in ratios:
        options = scaled_options(settings.model.name, settings.model.options, ratio)
        key = (settings.model.name, repr(sorted(options.items())), info.name, batch_size)
        if key not in _PEAKS:
            model = build_model(settings.model.name, info, options)
            _PEAKS[key] = measure_unmanaged_peak(model, data, batch_size).unmanaged_peak_bytes
        peaks[ratio] = _PEAKS[key]
    return peaks


def wants_submodel(config: ConfigRecord) -> bool:
    """Whether the instruction lets the client choose a width ratio (HeteroFL's config key)."""
    return WIDTH_RATIOS in config


def train_submodel(
    msg: Message,
    settings: ClientSettings,
    node: NodeProfile,
    info: DatasetInfo,
    data: ArrayDataset,
    local: LocalRound,
) -> Message:
    """Train the widest sub-model that fits the node's budget unmanaged; the reply to ``msg``."""
    config = next(iter(msg.content.config_records.values()))
    ratios = check_ratios([float(r) for r in config[WIDTH_RATIOS]])  # type: ignore[union-attr]
    full = build_model(settings.model.name, info, settings.model.options)
    budget_bytes = resolve_budget(
        node.budget, full, data, local.batch_size, _peak_key(settings, local)
    )
    peaks = submodel_peaks(settings, info, data, local.batch_size, ratios)
    ratio = choose_ratio(budget_bytes, peaks)
    if ratio is None:
        reason = (
            f"client {node.partition_id} (device class {node.device_class!r}): budget "
            f"{budget_bytes} B is below the unmanaged peak of every allowed width "
            f"({', '.join(f'{r:g}: {p} B' for r, p in peaks.items())}); allow a smaller width "
            "ratio in strategy.width_ratios or raise the budget"
        )
        logger.info("%s", reason)
        return Message(Error(code=ERROR_CODE_BUDGET, reason=reason), reply_to=msg)
    options = scaled_options(settings.model.name, settings.model.options, ratio)
    model = _load_slice(build_model(settings.model.name, info, options), msg)
    outcome = train_local(model, data, local)  # it fits: no memory manager
    outcome = dataclasses.replace(outcome, peak_device_bytes=peaks[ratio])  # measured peak
    metrics = dict(train_metrics(outcome, node, budget_bytes))
    metrics[WIDTH_RATIO] = ratio
    logger.debug(
        "client %d trained width ratio %g: loss %.4f", node.partition_id, ratio, outcome.loss
    )
    content = RecordDict(
        {
            ARRAYS: ArrayRecord(model.state_dict()),
            METRICS: MetricRecord(metrics),
            NODE: node_record(node),
        }
    )
    return Message(content, reply_to=msg)


def _load_slice(model: nn.Module, msg: Message) -> nn.Module:
    """Load the leading slices of the sent arrays (the full model, or already this sub-model)."""
    (record,) = msg.content.array_records.values()
    sent = {key: array.numpy() for key, array in record.items()}
    shapes = {key: tuple(t.shape) for key, t in model.state_dict().items()}
    sliced = slice_to_shapes(sent, shapes)
    model.load_state_dict({key: torch.from_numpy(a.copy()) for key, a in sliced.items()})
    return model


def _peak_key(settings: ClientSettings, local: LocalRound) -> tuple[Any, ...]:
    """The full model's peak cache key, as the client app's (model, options, data, batch)."""
    options = tuple(sorted((k, repr(v)) for k, v in settings.model.options.items()))
    return settings.model.name, options, settings.data.name, settings.data.seq_len, local.batch_size
