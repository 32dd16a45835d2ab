"""Flower ClientApp: thin handlers that unpack a message, train or evaluate, and pack the reply."""

import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

import vtensor
from edgefl.client_data import client_split
from edgefl.config import settings_from_run_config
from edgefl.data import DatasetInfo
from edgefl.errors import ClientBudgetError
from edgefl.models import build_model
from edgefl.node import NodeProfile, resolve_node
from edgefl.peak import resolve_budget
from edgefl.privacy import evaluate_privacy_mod, train_privacy_mod
from edgefl.records import ERROR_CODE_BUDGET, eval_metrics, train_metrics
from edgefl.secagg import SECAGG_ACTION, secagg_mod, secagg_query
from edgefl.settings import ClientSettings
from edgefl.train import evaluate, open_manager, seed_everything, train_local

logger = logging.getLogger(__name__)


def build_client_app(settings: ClientSettings | None = None) -> ClientApp:
    """A ClientApp using ``settings``, or (for ``flwr run``) settings from the run config."""
    app = ClientApp()
    app.query(SECAGG_ACTION)(secagg_query)  # secure aggregation's key stages

    def resolve(context: Context) -> ClientSettings:
        if settings is not None:
            return settings
        return settings_from_run_config(context.run_config).client

    # secagg_mod outermost: it masks what the privacy mods produced (it passes plain train
    # messages through); the privacy mods follow the run's settings (docs/privacy.md).
    @app.train(mods=[secagg_mod, train_privacy_mod(lambda context: resolve(context).privacy)])
    def train(msg: Message, context: Context) -> Message:
        s = resolve(context)
        node = resolve_node(context.node_config, s)
        config = _config(msg)
        info, train_set, _ = client_split(
            s.data, node.data_root, node.partition_id, node.num_partitions, s.seed
        )
        server_round = int(_number(config, "server-round", 0))
        seed = _round_seed(int(_number(config, "seed", s.seed)), server_round, node.partition_id)
        seed_everything(seed, s.train.torch_threads)
        model = _model(s, info, msg)
        batch_size = int(_number(config, "batch-size", s.train.batch_size))
        budget_bytes = resolve_budget(
            node.budget, model, train_set, batch_size, _peak_key(s, batch_size)
        )
        manager = open_manager(s.vtensor, budget_bytes, node.plan_cache_dir)
        proximal_mu = _number(config, "proximal-mu", 0.0)
        offload = _offload_params(s, model, budget_bytes, proximal_mu)
        try:
            outcome = train_local(
                model,
                train_set,
                lr=_number(config, "lr", s.train.lr),
                momentum=s.train.momentum,
                epochs=int(_number(config, "local-epochs", s.train.local_epochs)),
                batch_size=batch_size,
                seed=seed,
                manager=manager,
                proximal_mu=proximal_mu,
                max_examples=int(_number(config, "max-examples", 0)),
                offload_params=offload,
            )
        except ClientBudgetError as exc:
            return _budget_error(msg, node, exc)
        finally:
            if manager is not None:
                manager.close()
        logger.debug(
            "client %d (%s) round %d: loss %.4f",
            node.partition_id,
            node.device_class,
            server_round,
            outcome.loss,
        )
        content = RecordDict(
            {
                "arrays": ArrayRecord(model.state_dict()),
                "metrics": train_metrics(outcome, node, budget_bytes),
            }
        )
        return Message(content, reply_to=msg)

    @app.evaluate(mods=[evaluate_privacy_mod(lambda context: resolve(context).privacy)])
    def evaluate_local(msg: Message, context: Context) -> Message:
        s = resolve(context)
        node = resolve_node(context.node_config, s)
        info, _, test_set = client_split(
            s.data, node.data_root, node.partition_id, node.num_partitions, s.seed
        )
        seed_everything(s.seed, s.train.torch_threads)
        model = _model(s, info, msg)
        budget_bytes = resolve_budget(
            node.budget, model, test_set, s.train.batch_size, _peak_key(s, s.train.batch_size)
        )
        if not s.vtensor.enabled or _parameter_bytes(model) <= budget_bytes // 2:
            outcome = evaluate(model, test_set, s.train.eval_batch_size)
        else:  # the parameters alone would crowd the budget: stream them layer by layer
            node.plan_cache_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=node.plan_cache_dir) as tmp:
                weights = vtensor.write_weights(model.state_dict(), Path(tmp) / "model.vtw")
                outcome = evaluate(model, test_set, s.train.eval_batch_size, weights=weights)
        return Message(RecordDict({"metrics": eval_metrics(outcome, node)}), reply_to=msg)

    return app


def _config(msg: Message) -> ConfigRecord:
    records = list(msg.content.config_records.values())
    return records[0] if records else ConfigRecord()


def _number(config: ConfigRecord, key: str, default: float) -> float:
    """A numeric value of the instruction's config, or ``default`` when the key is absent."""
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"train config {key}={value!r} must be a number")
    return float(value)


def _model(settings: ClientSettings, info: DatasetInfo, msg: Message) -> nn.Module:
    """Build the model and load the arrays the server sent."""
    arrays = list(msg.content.array_records.values())
    if len(arrays) != 1:
        raise ValueError(f"expected one ArrayRecord in the message, got {len(arrays)}")
    model = build_model(settings.model.name, info, settings.model.options)
    model.load_state_dict(arrays[0].to_torch_state_dict())
    return model


def _offload_params(
    settings: ClientSettings, model: nn.Module, budget_bytes: int, proximal_mu: float
) -> bool:
    """Whether to offload the parameters too (``vtensor.offload_params``).

    ``auto``: when the parameters, their gradients and SGD's momentum would take more than half
    the budget, as for evaluation with demand layering; never with FedProx's proximal term
    (it reads every parameter outside its layer's forward) or whole-tensor swapping.
    """
    mode = settings.vtensor.offload_params
    if not settings.vtensor.enabled or mode == "off":
        return False
    if mode == "on":
        return True
    copies = 3 if settings.train.momentum else 2
    crowded = copies * _parameter_bytes(model) > budget_bytes // 2
    return crowded and proximal_mu == 0 and settings.vtensor.granularity == "chunk"


def _parameter_bytes(model: nn.Module) -> int:
    return sum(t.nbytes for t in model.state_dict().values())


def _peak_key(settings: ClientSettings, batch_size: int) -> tuple[Any, ...]:
    """What a measured unmanaged peak depends on: model, its options, data and batch size."""
    options = tuple(sorted((k, repr(v)) for k, v in settings.model.options.items()))
    return settings.model.name, options, settings.data.name, settings.data.seq_len, batch_size


def _round_seed(seed: int, server_round: int, partition_id: int) -> int:
    """A seed per (run seed, round, client): deterministic, distinct across rounds and clients."""
    return int(np.random.SeedSequence([seed, server_round, partition_id]).generate_state(1)[0])


def _budget_error(msg: Message, node: NodeProfile, exc: ClientBudgetError) -> Message:
    reason = (
        f"client {node.partition_id} (device class {node.device_class!r}) cannot train "
        f"within its budget: {exc}"
    )
    logger.warning("%s", reason)
    return Message(Error(code=ERROR_CODE_BUDGET, reason=reason), reply_to=msg)


app: ClientApp = build_client_app()
