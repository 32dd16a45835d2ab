"""The ClientApp called directly with real Flower messages (no simulation engine)."""

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

import vtensor
from edgefl import client_data
from edgefl.budget import Budget
from edgefl.client_app import build_client_app
from edgefl.data import load_dataset
from edgefl.log_setup import configure_logging
from edgefl.models import build_model
from edgefl.peak import measure_unmanaged_peak
from edgefl.records import (
    ERROR_CODE_BUDGET,
    EVAL_METRIC_KEYS,
    TRAIN_METRIC_KEYS,
    UNMANAGED_CODE,
    plan_source_code,
    plan_source_name,
    plan_source_of,
)
from edgefl.settings import DeviceClass, RunSettings, VTensorSettings
from edgefl.train import evaluate


def _context(node_config: dict[str, int | str]) -> Context:
    return Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={})


def _message(settings: RunSettings, message_type: str, server_round: int = 1) -> Message:
    info = load_dataset(settings.client.data.name).info
    torch.manual_seed(0)
    model = build_model(settings.client.model.name, info, settings.client.model.options)
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "config": ConfigRecord({"server-round": server_round, "lr": 0.05}),
        }
    )
    return Message(content, dst_node_id=7, message_type=message_type)


SIM_NODE = {"partition-id": 0, "num-partitions": 2}


def test_train_reply_has_arrays_and_every_metric(smoke_settings: RunSettings) -> None:
    app = build_client_app(smoke_settings.client)
    reply = app(_message(smoke_settings, MessageType.TRAIN), _context(SIM_NODE))
    assert not reply.has_error()
    assert list(reply.content.array_records) == ["arrays"]
    metrics = reply.content["metrics"]
    assert tuple(metrics) == TRAIN_METRIC_KEYS
    assert metrics["num-examples"] == 64
    assert metrics["budget-bytes"] == 1 << 30
    assert plan_source_of(metrics["plan-source"]) in (
        vtensor.PlanSource.PROFILED,
        vtensor.PlanSource.CACHED,
    )
    assert 0 < metrics["peak-device-bytes"] <= metrics["budget-bytes"]


def test_evaluate_reply_has_only_metrics(smoke_settings: RunSettings) -> None:
    app = build_client_app(smoke_settings.client)
    reply = app(_message(smoke_settings, MessageType.EVALUATE), _context(SIM_NODE))
    assert not reply.content.array_records
    metrics = reply.content["metrics"]
    assert tuple(metrics) == EVAL_METRIC_KEYS
    assert 0.0 <= metrics["eval-acc"] <= 1.0 and metrics["num-examples"] > 0


def test_unmeetable_budget_replies_with_a_clear_error(smoke_settings: RunSettings) -> None:
    app = build_client_app(smoke_settings.client)
    node = {**SIM_NODE, "memory-budget": "64KiB", "device-class": "sensor-tag"}
    reply = app(_message(smoke_settings, MessageType.TRAIN), _context(node))
    assert reply.has_error()
    assert reply.error.code == ERROR_CODE_BUDGET
    assert "sensor-tag" in reply.error.reason and "Raise the budget" in reply.error.reason


def test_vtensor_on_and_off_give_identical_weights(
    smoke_settings: RunSettings, with_budget: Callable[..., RunSettings]
) -> None:
    """Under a budget that forces swapping, trained arrays equal plain training's bit for bit."""
    options = {"width": 8, "hidden": 32, "convs_per_stage": 3}
    data = load_dataset("mnist")
    model = build_model("cnn", data.info, options)
    peak = measure_unmanaged_peak(model, data.train, smoke_settings.client.train.batch_size)
    budget = (peak.min_budget_bytes + peak.unmanaged_peak_bytes) // 2  # must swap, can fit
    tight = with_budget(smoke_settings, budget, **options)
    off = dataclasses.replace(tight.client, vtensor=VTensorSettings(enabled=False))
    msg = _message(tight, MessageType.TRAIN, server_round=2)
    on_reply = build_client_app(tight.client)(msg, _context(SIM_NODE))
    off_reply = build_client_app(off)(msg, _context(SIM_NODE))
    assert on_reply.content["metrics"]["bytes-swapped-out"] > 0
    assert off_reply.content["metrics"]["plan-source"] == UNMANAGED_CODE
    on, off_arrays = on_reply.content["arrays"], off_reply.content["arrays"]
    for key in on:
        assert np.array_equal(on[key].numpy(), off_arrays[key].numpy()), key


def test_different_rounds_use_different_batch_orders(smoke_settings: RunSettings) -> None:
    app = build_client_app(smoke_settings.client)
    first = app(_message(smoke_settings, MessageType.TRAIN, 1), _context(SIM_NODE))
    again = app(_message(smoke_settings, MessageType.TRAIN, 1), _context(SIM_NODE))
    other = app(_message(smoke_settings, MessageType.TRAIN, 2), _context(SIM_NODE))
    loss = [m.content["metrics"]["train-loss"] for m in (first, again, other)]
    assert loss[0] == loss[1] != loss[2]


@pytest.mark.parametrize("source", [None, *vtensor.PlanSource])
def test_plan_source_codes_decode_to_their_source_and_name(
    source: vtensor.PlanSource | None,
) -> None:
    code = plan_source_code(source)
    assert isinstance(code, int)
    assert plan_source_of(float(code)) is source  # a MetricRecord may hand back a float
    assert plan_source_name(code) == ("unmanaged" if source is None else source.value)


def test_plan_source_codes_are_distinct_with_zero_for_unmanaged() -> None:
    codes = [plan_source_code(s) for s in [None, *vtensor.PlanSource]]
    assert codes[0] == UNMANAGED_CODE == 0
    assert len(set(codes)) == len(codes)
    with pytest.raises(ValueError, match="plan-source"):
        plan_source_of(max(codes) + 1)


def test_relative_budget_is_below_the_measured_unmanaged_peak(
    smoke_settings: RunSettings, with_budget: Callable[..., RunSettings]
) -> None:
    settings = with_budget(smoke_settings, 0, width=8, hidden=32, convs_per_stage=3)
    fleet = dataclasses.replace(
        settings.client.fleet, classes=(DeviceClass("tight", Budget(peak_fraction=0.75), 1.0),)
    )
    client = dataclasses.replace(settings.client, fleet=fleet)
    settings = dataclasses.replace(settings, client=client)
    reply = build_client_app(client)(_message(settings, MessageType.TRAIN), _context(SIM_NODE))
    metrics = reply.content["metrics"]
    assert metrics["bytes-swapped-out"] > 0
    assert metrics["peak-device-bytes"] <= metrics["budget-bytes"]


def test_clients_of_one_class_share_a_plan_cache(
    smoke_settings: RunSettings, with_budget: Callable[..., RunSettings], tmp_path: Path
) -> None:
    """The first client of a class profiles the model; the next starts from its cached plan."""
    sources = _class_rounds(smoke_settings, with_budget, tmp_path, 2, recompute=False)
    assert [plan_source_of(s) for s in sources] == [
        vtensor.PlanSource.PROFILED,
        vtensor.PlanSource.CACHED,
    ]
    assert any((tmp_path / "tight").iterdir())


def test_with_recomputation_the_first_round_decides_the_plan_the_class_replays(
    smoke_settings: RunSettings, with_budget: Callable[..., RunSettings], tmp_path: Path
) -> None:
    """With recomputation (the main job's setting) a plan is decided in at most three steps
    (NOTE [one decision] in vtensor/activations/plan/decision.py), within the first round, and
    stored in the class's plan cache from its first replay: every later round starts from it."""
    assert smoke_settings.client.vtensor.recompute
    sources = [plan_source_of(s) for s in _class_rounds(smoke_settings, with_budget, tmp_path, 4)]
    assert sources[0] is vtensor.PlanSource.PROFILED
    assert all(s is vtensor.PlanSource.CACHED for s in sources[1:]), sources


def _class_rounds(
    smoke_settings: RunSettings,
    with_budget: Callable[..., RunSettings],
    tmp_path: Path,
    rounds: int,
    **vtensor_settings: object,
) -> list[float]:
    """The plan sources of ``rounds`` training rounds of clients of one class, in turn."""
    settings = with_budget(smoke_settings, 0, width=8, hidden=32, convs_per_stage=3)
    classes = (DeviceClass("tight", Budget(peak_fraction=0.9), 1.0),)
    fleet = dataclasses.replace(
        settings.client.fleet, classes=classes, plan_cache_root=str(tmp_path)
    )
    vt = dataclasses.replace(settings.client.vtensor, **vtensor_settings)
    client = dataclasses.replace(settings.client, fleet=fleet, vtensor=vt)
    app = build_client_app(client)
    msg = _message(dataclasses.replace(settings, client=client), MessageType.TRAIN)
    return [
        app(msg, _context({"partition-id": r % 2, "num-partitions": 2})).content["metrics"][
            "plan-source"
        ]
        for r in range(rounds)
    ]


def test_a_model_that_crowds_the_budget_is_evaluated_layer_by_layer_with_equal_results(
    smoke_settings: RunSettings, tmp_path: Path
) -> None:
    """Parameters over half the budget: evaluation streams them (DemandLayering) from a weight
    file that is gone afterwards, and gives exactly the resident model's figures."""
    app = build_client_app(smoke_settings.client)
    msg = _message(smoke_settings, MessageType.EVALUATE)
    params = sum(a.numpy().nbytes for a in msg.content["arrays"].values())
    resident = app(msg, _context(SIM_NODE)).content["metrics"]
    cache = tmp_path / "plans"
    node = {**SIM_NODE, "memory-budget": str(params + params // 2), "plan-cache-dir": str(cache)}
    streamed = app(_message(smoke_settings, MessageType.EVALUATE), _context(node))
    figures = {k: v for k, v in streamed.content["metrics"].items() if k != "device-class"}
    assert figures == {k: v for k, v in resident.items() if k != "device-class"}
    assert not any(p.suffix == ".vtw" for p in cache.rglob("*"))


def test_demand_layered_evaluation_equals_resident(tmp_path: Path) -> None:
    info = load_dataset("mnist").info
    torch.manual_seed(0)
    model = build_model("cnn", info, {"width": 8, "hidden": 32})
    data = load_dataset("mnist").test
    subset = dataclasses.replace(data, x=data.x[:64], y=data.y[:64])
    expected = evaluate(model, subset, 32)
    weights = vtensor.write_weights(model.state_dict(), tmp_path / "model.vtw")
    assert evaluate(model, subset, 32, weights=weights) == expected


def test_client_offloads_parameters_when_they_crowd_the_budget(
    smoke_settings: RunSettings, with_budget: Callable[..., RunSettings]
) -> None:
    """A model whose weights, gradients and momentum alone exceed the budget trains, with its
    parameters planned together with the activations (vtensor's one plan), bit for bit as
    plain training; with parameter offloading off the same budget is refused."""
    options = {"width": 96, "hidden": 16, "convs_per_stage": 2}  # 2.8 MiB in 1.3 MiB layers
    data = load_dataset("mnist")
    model = build_model("cnn", data.info, options)
    train = dataclasses.replace(smoke_settings.client.train, batch_size=2)
    small = dataclasses.replace(
        smoke_settings, client=dataclasses.replace(smoke_settings.client, train=train)
    )
    training_state = 3 * sum(p.nbytes for p in model.parameters())  # SGD with momentum
    # Exact bytes, so the same in every process; activations (about 6 MiB) share it too.
    budget = int(0.95 * training_state)
    tight = with_budget(small, budget, **options)
    msg = _message(tight, MessageType.TRAIN, server_round=2)
    reply = build_client_app(tight.client)(msg, _context(SIM_NODE))
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    metrics = reply.content["metrics"]
    # The manager's tolerance: one chunk over the budget at a sample (heap noise included).
    assert metrics["peak-device-bytes"] <= budget + tight.client.vtensor.chunk_bytes
    assert metrics["bytes-swapped-out"] > 0 and metrics["bytes-swapped-in"] > 0
    off = dataclasses.replace(tight.client, vtensor=VTensorSettings(enabled=False))
    plain = build_client_app(off)(msg, _context(SIM_NODE)).content["arrays"]
    for key, array in reply.content["arrays"].items():
        assert np.array_equal(array.numpy(), plain[key].numpy()), key
    never = dataclasses.replace(
        tight.client,
        vtensor=dataclasses.replace(tight.client.vtensor, offload_params="off"),
    )
    refused = build_client_app(never)(msg, _context(SIM_NODE))
    assert refused.has_error() and refused.error.code == ERROR_CODE_BUDGET


def _deployed_node(tmp_path: Path, budget: str) -> dict[str, int | str]:
    """A deployed node's config, as ``edgefl client --device-class pi4`` sets it."""
    return {
        **SIM_NODE,
        "memory-budget": budget,
        "device-class": "pi4",
        "plan-cache-dir": str(tmp_path / "plans"),
    }


def test_a_deployed_node_names_its_class_and_keeps_its_split(
    smoke_settings: RunSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = build_client_app(smoke_settings.client)
    context = _context(_deployed_node(tmp_path, "1GiB"))
    reply = app(_message(smoke_settings, MessageType.TRAIN), context)
    assert reply.content["node"]["device-class"] == "pi4"  # the name, to results and tables
    assert reply.content["metrics"]["device-class"] == -1
    assert len(list((tmp_path / "plans" / "splits").glob("split-*.npz"))) == 1

    def no_decoding(*_args: object) -> None:
        raise AssertionError("the node's later processes read its split from its cache")

    client_data.client_split.cache_clear()  # as in the node's next process
    monkeypatch.setattr(client_data, "load_dataset", no_decoding)
    evaluated = app(_message(smoke_settings, MessageType.EVALUATE), context)
    assert evaluated.content["node"]["device-class"] == "pi4"
    assert evaluated.content["metrics"]["num-examples"] > 0


def test_a_deployed_node_says_its_budget_error_once_a_run(
    smoke_settings: RunSettings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    app = build_client_app(smoke_settings.client)
    context = _context(_deployed_node(tmp_path, "64KiB"))  # one node: its state across rounds
    own = logging.getLogger("edgefl")
    configure_logging()  # edgefl's loggers: their own handler, not propagating
    own.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="edgefl.client_app"):
            replies = [
                app(_message(smoke_settings, MessageType.TRAIN, server_round=r), context)
                for r in (1, 2)
            ]
    finally:
        own.removeHandler(caplog.handler)
    assert all(r.has_error() and r.error.code == ERROR_CODE_BUDGET for r in replies)
    warnings = [r for r in caplog.records if "cannot train within its budget" in r.getMessage()]
    assert len(warnings) == 1
