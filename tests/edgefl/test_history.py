"""Run history, summary text and result files from hand-made replies (real Flower messages)."""

import csv
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from matplotlib.figure import Figure

import vtensor
from edgefl import plots
from edgefl.budget import Budget
from edgefl.data.mnist import INFO as MNIST_INFO
from edgefl.data.shakespeare import dataset_info as shakespeare_info
from edgefl.history import RunHistory
from edgefl.plots import plot_accuracy_loss, plot_client_memory
from edgefl.recording_grid import Exchange, _reply_order
from edgefl.records import plan_source_code
from edgefl.results import write_results
from edgefl.settings import DeviceClass, RunSettings
from edgefl.summary import round_line, summary_table
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
