"""Proof that raw data stays on a device: no sample, label run or per-example value in a message.

Every message of a real simulation (instructions and replies, train and evaluate) is serialized
to the bytes Flower puts on the wire, and those bytes are searched for every training and local
test example of every client (a distinctive 64-byte run of its pixels) and for the clients' label
sequences. Metrics must be scalars under known keys: a list-valued metric could carry
per-example values.
"""

import dataclasses

import numpy as np
import pytest
from flwr.common.serde import message_to_proto

from edgefl.client_data import client_split
from edgefl.recording_grid import Exchange
from edgefl.records import EVAL_METRIC_KEYS, TRAIN_METRIC_KEYS
from edgefl.settings import RunSettings
from edgefl.sim import prepare, simulate

pytestmark = pytest.mark.slow
WINDOW_BYTES = 64


def _sample_windows(x: np.ndarray) -> list[bytes]:
    """Per example, 64 bytes from its first nonzero value: a run no model array holds by chance."""
    windows = []
    for row in x.reshape(len(x), -1):
        raw = row.tobytes()
        first = int(np.flatnonzero(row)[0]) * row.itemsize
        windows.append(raw[first : first + WINDOW_BYTES])
    return windows


def _label_runs(y: np.ndarray) -> list[bytes]:
    """The first 16 labels as int64, int32 and uint8 bytes, and float32 values."""
    head = y[:16]
    return [head.astype(t).tobytes() for t in (np.int64, np.int32, np.uint8, np.float32)]


def test_no_sample_label_or_per_example_value_leaves_a_client(
    smoke_settings: RunSettings, tmp_path_factory: pytest.TempPathFactory
) -> None:
    server = dataclasses.replace(
        smoke_settings.server, num_rounds=2, output_dir=str(tmp_path_factory.mktemp("leak"))
    )
    settings = prepare(dataclasses.replace(smoke_settings, server=server))
    exchanges: list[Exchange] = []
    simulate(settings, [exchanges.append])

    wire = [
        message_to_proto(m).SerializeToString() for e in exchanges for m in (*e.sent, *e.replies)
    ]
    assert len(wire) == 2 * 2 * 2 * 2  # 2 rounds x (train, evaluate) x 2 clients x (out, back)
    data = settings.client.data
    secrets: list[bytes] = []
    for pid in range(settings.server.num_supernodes):
        _, train, test = client_split(data, data.root, pid, settings.server.num_supernodes, 42)
        for part in (train, test):
            secrets += _sample_windows(part.x) + _label_runs(part.y)
    assert len(secrets) > 100
    leaked = [i for i, s in enumerate(secrets) if any(s in blob for blob in wire)]
    assert leaked == []

    known = set(TRAIN_METRIC_KEYS) | set(EVAL_METRIC_KEYS)
    for e in exchanges:
        for reply in e.replies:
            for record in reply.content.metric_records.values():
                assert set(record) <= known
                assert all(isinstance(v, int | float) for v in record.values())


def test_the_search_finds_a_sample_that_is_sent() -> None:
    """The check above can fail: one example's pixels are caught, half a window is not."""
    from flwr.app import Array, ArrayRecord, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    rng = np.random.default_rng(0)
    x = rng.random((3, 1, 28, 28), dtype=np.float32)
    msg = Message(
        RecordDict(
            {"arrays": ArrayRecord({"w": Array(np.concatenate([x[1].ravel(), x[2, 0, 0, :8]]))})}
        ),
        dst_node_id=1,
        message_type="train",
    )
    blob = message_to_proto(msg).SerializeToString()
    assert [w in blob for w in _sample_windows(x)] == [False, True, False]
