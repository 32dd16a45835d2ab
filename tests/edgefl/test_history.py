"""Run history, summary text and result files from hand-made replies (real Flower messages)."""

import csv
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import torch
from flwr.app import ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from matplotlib.figure import Figure

import vtensor
from edgefl import plots
from edgefl.budget import Budget
from edgefl.data.mnist import INFO as MNIST_INFO
from edgefl.data.shakespeare import dataset_info as shakespeare_info
from edgefl.history import ClientRound, RunHistory, class_names, class_of
from edgefl.peak import PeakMeasurement
from edgefl.plots import plot_accuracy_loss, plot_client_memory
from edgefl.recording_grid import Exchange, _reply_order
from edgefl.records import DEVICE_CLASS, NODE, plan_source_code
from edgefl.results import write_results
from edgefl.settings import DeviceClass, RunSettings
from edgefl.summary import class_table, round_line, summary_table
from edgefl.train import EvalOutcome


def _exchange(server_round: int) -> Exchange:
    sent = [
        Message(
            RecordDict({"config": ConfigRecord({"server-round": server_round})}),
            dst_node_id=n,
            message_type=MessageType.TRAIN,
        )
        for n in (11, 12)
    ]
    ok = Message(
        RecordDict(
            {
                "metrics": MetricRecord(
                    {
                        "num-examples": 10,
                        "train-loss": 0.5,
                        "peak-device-bytes": 900,
                        "budget-bytes": 1000,
                        "bytes-swapped-out": 100,
                        "bytes-swapped-in": 100,
                        "stall-s": 0.5,
                        "partition-id": 0,
                        "device-class": 0,
                        "plan-source": plan_source_code(vtensor.PlanSource.CACHED),
                    }
                )
            }
        ),
        reply_to=sent[0],
    )
    failed = Message(
        Error(code=4001, reason="client 1 cannot train within its budget"), reply_to=sent[1]
    )
    return Exchange(MessageType.TRAIN, server_round, sent, [ok, failed])


def test_history_summarises_a_round_with_a_failure(
    tmp_path: Path, smoke_settings: RunSettings
) -> None:
    history = RunHistory()
    history.close_round(0, EvalOutcome(100, 2.3, 0.1))
    history.on_exchange(_exchange(1))
    record = history.close_round(1, EvalOutcome(100, 0.4, 0.9))
    assert (record.clients_trained, record.clients_failed) == (1, 1)
    assert record.max_peak_fraction == 0.9 and record.bytes_swapped == 200
    assert "failed 1" in round_line(record, 1)
    table = summary_table(history)
    assert "cannot train within its budget" in table and "0.9000" in table
    paths = write_results(tmp_path, history, {"w": torch.zeros(2)}, smoke_settings, {"x": 1})
    assert all(p.is_file() for p in paths)
    with (tmp_path / "clients.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert "cannot train" in rows[1]["error"]
    assert rows[0]["plan-source"] == "cached"  # by name, not its code
    plot_accuracy_loss(history, tmp_path / "a.png")
    plot_client_memory(history, [DeviceClass("edge", Budget(1000), 1.0)], 1200, tmp_path / "m.png")
    assert (tmp_path / "a.png").stat().st_size > 0 and (tmp_path / "m.png").stat().st_size > 0


def test_replies_are_ordered_by_partition_with_errors_last() -> None:
    sent = Message(RecordDict(), dst_node_id=5, message_type=MessageType.TRAIN)
    replies = [
        Message(Error(code=1, reason="x"), reply_to=sent),
        Message(RecordDict({"metrics": MetricRecord({"partition-id": 2})}), reply_to=sent),
        Message(RecordDict({"metrics": MetricRecord({"partition-id": 0})}), reply_to=sent),
    ]
    ordered = sorted(replies, key=_reply_order)
    assert [r.has_error() for r in ordered] == [False, False, True]
    assert [r.content["metrics"]["partition-id"] for r in ordered[:2]] == [0, 2]


def test_a_text_dataset_names_its_accuracy_next_character_accuracy_everywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = shakespeare_info(80).accuracy
    assert name == "next-character accuracy" and MNIST_INFO.accuracy == "accuracy"
    history = RunHistory()
    history.close_round(0, EvalOutcome(100, 2.3, 0.1))
    history.on_exchange(_exchange(1))
    record = history.close_round(1, EvalOutcome(100, 0.4, 0.9))
    assert "central next-character accuracy 0.9000 loss 0.4000" in round_line(record, 1, name)
    assert "central next-character accuracy" in summary_table(history, name).splitlines()[0]
    figures: list[Figure] = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    plot_accuracy_loss(history, tmp_path / "a.png", name)
    assert figures[0].axes[0].get_ylabel() == "next-character accuracy"


def _deployed_exchange(server_round: int, classes: dict[int, str]) -> Exchange:
    """Train replies of deployed nodes (class index -1), each naming its class as a node does."""
    sent = {
        node: Message(
            RecordDict({"config": ConfigRecord({"server-round": server_round})}),
            dst_node_id=node,
            message_type=MessageType.TRAIN,
        )
        for node in classes
    }
    replies = []
    for pid, (node, name) in enumerate(classes.items()):
        metrics = {
            "num-examples": 10,
            "train-loss": 0.5,
            "peak-device-bytes": 900 + pid,
            "budget-bytes": 1000,
            "bytes-swapped-out": 100,
            "bytes-swapped-in": 100,
            "stall-s": 0.0,
            "train-s": 0.1,
            "examples-processed": 10,
            "partition-id": pid,
            "device-class": -1,
            "plan-source": plan_source_code(vtensor.PlanSource.CACHED),
        }
        content = {"metrics": MetricRecord(metrics), NODE: ConfigRecord({DEVICE_CLASS: name})}
        replies.append(Message(RecordDict(content), reply_to=sent[node]))
    return Exchange(MessageType.TRAIN, server_round, list(sent.values()), replies)


def test_a_deployed_nodes_class_is_named_alike_in_table_csv_and_plot(
    tmp_path: Path, smoke_settings: RunSettings
) -> None:
    history = RunHistory()
    for server_round in (1, 2):
        history.on_exchange(_deployed_exchange(server_round, {21: "pi4", 22: "pi4", 23: "jetson"}))
        history.close_round(server_round, None)
    fleet = smoke_settings.client.fleet.classes  # the settings' fleet: no client of it ran
    table = class_table(history, fleet, PeakMeasurement(2000, 500, 100, 32), None)
    rows = {line.split()[0]: line.split()[1] for line in table.splitlines()[3:] if line[:1] != "x"}
    assert rows == {"pi4": "2", "jetson": "1"}  # its rounds counted; no fleet class listed
    write_results(tmp_path, history, {"w": torch.zeros(2)}, smoke_settings, {})
    with (tmp_path / "clients.csv").open() as f:
        assert {row["device-class"] for row in csv.DictReader(f)} == {"pi4", "jetson"}
    fig, ax = plt.subplots()
    plots.draw_client_memory(ax, history, fleet, 2000)
    labels = {str(line.get_label()) for line in ax.lines}
    assert {"budget pi4", "budget jetson"} <= labels
    plt.close(fig)


def test_class_names_list_the_fleet_then_deployed_classes() -> None:
    fleet = ["micro", "small"]
    simulated = ClientRound(1, "train", 1, {"device-class": 1.0}, device_class="small")
    deployed = ClientRound(1, "train", 2, {"device-class": -1.0}, device_class="pi4")
    assert class_names([simulated], fleet) == ["micro", "small"]
    assert class_names([simulated, deployed], fleet) == ["micro", "small", "pi4"]
    assert class_names([deployed], fleet) == ["pi4"]
    legacy = ClientRound(1, "train", 3, {"device-class": 0.0})  # a reply that named no class
    assert class_of(legacy, fleet) == "micro"
