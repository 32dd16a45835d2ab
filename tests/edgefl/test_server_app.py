"""The ServerApp's log of error replies: each node's error once, with its reason."""

import logging

import pytest
from flwr.app import ConfigRecord, Error, Message, MessageType, RecordDict

from edgefl.log_setup import configure_logging
from edgefl.recording_grid import Exchange
from edgefl.server_app import ErrorLog


def _failed(server_round: int, node: int) -> Exchange:
    sent = Message(
        RecordDict({"config": ConfigRecord({"server-round": server_round})}),
        dst_node_id=node,
        message_type=MessageType.TRAIN,
    )
    reason = f"client 1 cannot train within its budget: needs {1000 + server_round} bytes"
    return Exchange(
        MessageType.TRAIN, server_round, [sent], [Message(Error(4001, reason), reply_to=sent)]
    )


def test_a_nodes_repeated_budget_error_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    log = ErrorLog()
    own = logging.getLogger("edgefl")
    configure_logging()  # edgefl's loggers: their own handler, not propagating
    own.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="edgefl.server_app"):
            for server_round in (1, 2, 3):
                log(_failed(server_round, node=5))
            log(_failed(3, node=6))  # another node: its own line
    finally:
        own.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if "replied with error" in r.getMessage()]
    assert len(lines) == 2
    assert "round 1 train: node 5" in lines[0] and "needs 1001 bytes" in lines[0]
    assert "node 6" in lines[1]
