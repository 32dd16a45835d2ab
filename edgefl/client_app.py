"""Flower ClientApp: thin handlers that unpack a message, train or evaluate, and pack the reply."""

import logging
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

import vtensor
from edgefl.client_data import Split, client_split, node_split
from edgefl.config import settings_from_run_config
from edgefl.data import DatasetInfo
from edgefl.errors import ClientBudgetError
from edgefl.log_setup import configure_logging
from edgefl.models import build_model
from edgefl.node import NodeProfile, resolve_node
from edgefl.peak import resolve_budget
from edgefl.privacy import evaluate_privacy_mod, train_privacy_mod
from edgefl.records import (
    ARRAYS,
    BATCH_SIZE,
    ERROR_CODE_BUDGET,
    LOCAL_EPOCHS,
    LR,
    MAX_EXAMPLES,
    METRICS,
    NODE,
    PROXIMAL_MU,
    SEED,
    SERVER_ROUND,
    eval_metrics,
    node_record,
    train_metrics,
)
from edgefl.secagg import SECAGG_ACTION, secagg_mod, secagg_query
from edgefl.settings import ClientSettings
from edgefl.submodel import train_submodel, wants_submodel
from edgefl.train import (
    LocalRound,
    TrainOutcome,
    evaluate_within_budget,
    seed_everything,
    train_within_budget,
)

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
        configure_logging()  # this process's: a Ray actor or a deployed node's ClientApp
        s = resolve(context)
        node = resolve_node(context.node_config, s)
        config = _config(msg)
        info, train_set, _ = _split(s, node)
        server_round = int(_number(config, SERVER_ROUND, 0))
        local = _local_round(config, s, server_round, node.partition_id)
        seed_everything(local.seed, s.train.torch_threads)
        if wants_submodel(config):  # HeteroFL: a width-scaled sub-model that fits unmanaged
            return train_submodel(msg, s, node, info, train_set, local)
        model = _model(s, info, msg)
        budget_bytes = resolve_budget(
            node.budget, model, train_set, local.batch_size, _peak_key(s, local.batch_size)
        )
        try:
            outcome = train_within_budget(
                model,
                train_set,
                local,
                settings=s.vtensor,
                budget_bytes=budget_bytes,
                plan_cache_dir=node.plan_cache_dir,
            )
        except ClientBudgetError as exc:
            return _budget_error(msg, context, node, exc)
        _log_round(node, server_round, budget_bytes, outcome)
        content = RecordDict(
            {
                ARRAYS: ArrayRecord(model.state_dict()),
                METRICS: train_metrics(outcome, node, budget_bytes),
                NODE: node_record(node),
            }
        )
        return Message(content, reply_to=msg)

    @app.evaluate(mods=[evaluate_privacy_mod(lambda context: resolve(context).privacy)])
    def evaluate_local(msg: Message, context: Context) -> Message:
        configure_logging()
        s = resolve(context)
        node = resolve_node(context.node_config, s)
        info, _, test_set = _split(s, node)
        seed_everything(s.seed, s.train.torch_threads)
        model = _model(s, info, msg)
        budget_bytes = resolve_budget(
            node.budget, model, test_set, s.train.batch_size, _peak_key(s, s.train.batch_size)
        )
        outcome = evaluate_within_budget(
            model,
            test_set,
            s.train.eval_batch_size,
            settings=s.vtensor,
            budget_bytes=budget_bytes,
            scratch_dir=node.plan_cache_dir,
        )
        content = RecordDict({METRICS: eval_metrics(outcome, node), NODE: node_record(node)})
        return Message(content, reply_to=msg)

    return app


def _split(settings: ClientSettings, node: NodeProfile) -> Split:
    """The node's data: a deployed node keeps it across its processes (NOTE [split cache])."""
    args = (settings.data, node.data_root, node.partition_id, node.num_partitions, settings.seed)
    if _deployed(node):
        return node_split(*args, cache_dir=node.plan_cache_dir / "splits")
    return client_split(*args)


def _config(msg: Message) -> ConfigRecord:
    records = list(msg.content.config_records.values())
    return records[0] if records else ConfigRecord()


def _number(config: ConfigRecord, key: str, default: float) -> float:
    """A numeric value of the instruction's config, or ``default`` when the key is absent."""
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"train config {key}={value!r} must be a number")
    return float(value)


def _local_round(
    config: ConfigRecord, settings: ClientSettings, server_round: int, partition_id: int
) -> LocalRound:
    """The round's training as the instruction's config says, the settings' where it is silent."""
    seed = _round_seed(int(_number(config, SEED, settings.seed)), server_round, partition_id)
    return LocalRound(
        lr=_number(config, LR, settings.train.lr),
        momentum=settings.train.momentum,
        epochs=int(_number(config, LOCAL_EPOCHS, settings.train.local_epochs)),
        batch_size=int(_number(config, BATCH_SIZE, settings.train.batch_size)),
        seed=seed,
        proximal_mu=_number(config, PROXIMAL_MU, 0.0),
        max_examples=int(_number(config, MAX_EXAMPLES, 0)),
    )


def _model(settings: ClientSettings, info: DatasetInfo, msg: Message) -> nn.Module:
    """Build the model and load the arrays the server sent."""
    arrays = list(msg.content.array_records.values())
    if len(arrays) != 1:
        raise ValueError(f"expected one ArrayRecord in the message, got {len(arrays)}")
    model = build_model(settings.model.name, info, settings.model.options)
    model.load_state_dict(arrays[0].to_torch_state_dict())
    return model


def _peak_key(settings: ClientSettings, batch_size: int) -> tuple[Any, ...]:
    """What a measured unmanaged peak depends on: model, its options, data and batch size."""
    options = tuple(sorted((k, repr(v)) for k, v in settings.model.options.items()))
    return settings.model.name, options, settings.data.name, settings.data.seq_len, batch_size


def _round_seed(seed: int, server_round: int, partition_id: int) -> int:
    """A seed per (run seed, round, client): deterministic, distinct across rounds and clients."""
    return int(np.random.SeedSequence([seed, server_round, partition_id]).generate_state(1)[0])


def _deployed(node: NodeProfile) -> bool:
    """A real node (its budget from its node config), not a simulated client of a fleet."""
    return node.class_index < 0


def _log_round(
    node: NodeProfile, server_round: int, budget_bytes: int, outcome: TrainOutcome
) -> None:
    """The node's own line per round; simulated clients keep it at DEBUG (the server reports)."""
    logger.log(
        logging.INFO if _deployed(node) else logging.DEBUG,
        "client %d (%s) round %d: budget %s, peak %s, swapped %s out + %s in, stall %.1f s, "
        "plan %s, %d examples in %.1f s, loss %.4f",
        node.partition_id,
        node.device_class,
        server_round,
        vtensor.format_bytes(budget_bytes),
        vtensor.format_bytes(outcome.peak_device_bytes),
        vtensor.format_bytes(outcome.bytes_out),
        vtensor.format_bytes(outcome.bytes_in),
        outcome.stall_s,
        outcome.plan_source or "unmanaged (vtensor off)",
        outcome.examples_processed,
        outcome.train_s,
        outcome.loss,
    )


_WARNED = "edgefl.budget-warned"  # context.state: the node said its budget error this run


def _budget_error(
    msg: Message, context: Context, node: NodeProfile, exc: ClientBudgetError
) -> Message:
    """The error reply; a deployed node also says it in its own log, once a run.

    The figures barely change between rounds; summary.txt keeps every reply's reason.
    """
    reason = (
        f"client {node.partition_id} (device class {node.device_class!r}) cannot train "
        f"within its budget: {exc}"
    )
    said = _WARNED in context.state.config_records  # the state outlives the node's processes
    logger.log(logging.WARNING if _deployed(node) and not said else logging.DEBUG, "%s", reason)
    context.state.config_records[_WARNED] = ConfigRecord({SERVER_ROUND: _round_of(msg)})
    return Message(Error(code=ERROR_CODE_BUDGET, reason=reason), reply_to=msg)


def _round_of(msg: Message) -> int:
    return int(_number(_config(msg), SERVER_ROUND, 0))


app: ClientApp = build_client_app()
