"""Train-phase progress: a bar in a terminal, a line per client otherwise, as replies come."""

import io
import logging
from collections.abc import Iterable
from typing import Any

import pytest
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from edgefl.progress import TrainProgress
from edgefl.recording_grid import RecordingGrid


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_gets_one_redrawn_bar() -> None:
    stream = _Terminal()
    progress = TrainProgress(stream)
    for done in (1, 2, 3):
        progress.update(1, done, 3)
    text = stream.getvalue()
    assert text.count("\r") == 3 and text.endswith("3/3 clients\n")
    assert "round 1 training [" in text


def test_a_log_gets_a_line_per_client(caplog: pytest.LogCaptureFixture) -> None:
    own = logging.getLogger("edgefl")
    if not own.propagate:
        own.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="edgefl.progress"):
            progress = TrainProgress(io.StringIO())
            progress.update(2, 1, 2)
            progress.update(2, 2, 2)
    finally:
        own.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if r.name == "edgefl.progress"]
    assert lines == [
        "round 2: 1/2 clients finished training",
        "round 2: 2/2 clients finished training",
    ]


class _OneReplyPerPull:
    """A grid whose clients reply one at a time, one per pull (as clients finish)."""

    pull_interval = 0.0

    def __init__(self) -> None:
        self.pending: list[Message] = []

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        self.pending = list(messages)
        return [str(i) for i in range(len(self.pending))]

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        if not self.pending:
            return []
        msg = self.pending.pop(0)
        reply = Message(RecordDict({"metrics": MetricRecord({"partition-id": 0})}), reply_to=msg)
        reply.metadata.__dict__["_reply_to_message_id"] = str(2 - len(self.pending))
        return [reply]


def test_recording_grid_counts_train_replies_as_they_arrive() -> None:
    seen: list[tuple[int, int, int]] = []
    inner: Any = _OneReplyPerPull()
    grid = RecordingGrid(inner, [], lambda r, d, t: seen.append((r, d, t)))
    sent = [
        Message(
            RecordDict({"config": ConfigRecord({"server-round": 4})}),
            dst_node_id=n,
            message_type=MessageType.TRAIN,
        )
        for n in (1, 2, 3)
    ]
    replies = list(grid.send_and_receive(sent, timeout=10))
    assert len(replies) == 3
    assert seen == [(4, 1, 3), (4, 2, 3), (4, 3, 3)]
