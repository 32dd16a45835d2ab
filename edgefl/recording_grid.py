"""A Grid that delegates to Flower's and reports every exchange (instructions and replies)."""

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from flwr.app import Message, MessageType, RecordDict
from flwr.serverapp import Grid

from edgefl.records import PARTITION_ID, SERVER_ROUND


@dataclass(frozen=True)
class Exchange:
    """One ``send_and_receive``: the instructions sent and the replies that came back."""

    message_type: str
    server_round: int  # from the instructions' config "server-round"; 0 if absent
    sent: Sequence[Message]
    replies: Sequence[Message]


ExchangeObserver = Callable[[Exchange], None]
ProgressFn = Callable[[int, int, int], None]  # (server round, replies in, messages sent)
# Between pulls of the replies from a SuperLink (the in-memory grid of a simulation says its
# own). Flower's HTTP grid waits 3 s, on average 1.5 s after each exchange's last reply; a
# pull is one small request to the SuperLink beside the ServerApp.
_PULL_INTERVAL_S = 0.5


class RecordingGrid(Grid):
    """Wraps a Grid; after each ``send_and_receive`` calls every observer with the Exchange.

    Replies are returned sorted by the ``partition-id`` metric (errors last): they arrive in
    whatever order clients finish, and a strategy's floating-point sums then differ between
    runs in the last bits. Sorted, a run with fixed seeds is reproducible bit for bit.
    """

    def __init__(
        self,
        grid: Grid,
        observers: Sequence[ExchangeObserver],
        progress: ProgressFn | None = None,
    ) -> None:
        self._grid = grid
        self._observers = list(observers)
        self._progress = progress

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push, pull until every reply is in (or ``timeout``), then report the exchange.

        The loop is Flower's ``Grid.send_and_receive``'s, so that each reply of a train phase
        can be counted as it arrives (``progress(round, done, total)``).
        """
        sent = list(messages)
        replies = sorted(self._exchange(sent, timeout), key=_reply_order)
        if sent:
            exchange = Exchange(sent[0].metadata.message_type, _round_of(sent[0]), sent, replies)
            for observer in self._observers:
                observer(exchange)
        return replies

    def _exchange(self, sent: list[Message], timeout: float | None) -> list[Message]:
        waiting = set(self._grid.push_messages(sent))
        total, replies = len(waiting), []
        counted = bool(sent) and sent[0].metadata.message_type == MessageType.TRAIN
        server_round = _round_of(sent[0]) if sent else 0
        interval = float(getattr(self._grid, "pull_interval", _PULL_INTERVAL_S))
        end = time.monotonic() + (timeout if timeout is not None else 0.0)
        while waiting and (timeout is None or time.monotonic() < end):
            arrived = list(self._grid.pull_messages(waiting))
            replies += arrived
            waiting -= {m.metadata.reply_to_message_id for m in arrived}
            if arrived and counted and self._progress is not None:
                self._progress(server_round, total - len(waiting), total)
            if waiting:
                time.sleep(interval)
        return replies

    # -- plain delegation ---------------------------------------------------------------------
    def set_run(self, run: Any) -> None:
        """Delegate."""
        self._grid.set_run(run)

    @property
    def run(self) -> Any:
        """Delegate."""
        return self._grid.run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """Delegate (deprecated in Flower; kept for the ABC)."""
        return self._grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        """Delegate."""
        return self._grid.get_node_ids()

    def get_nodes(self) -> Iterable[Any]:
        """Delegate."""
        return self._grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Delegate."""
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Delegate."""
        return self._grid.pull_messages(message_ids)


def _round_of(message: Message) -> int:
    for record in message.content.config_records.values():
        value = record.get(SERVER_ROUND)
        if isinstance(value, int | float):
            return int(value)
    return 0


def _reply_order(reply: Message) -> tuple[int, float, int]:
    """Sort key: content replies by partition id, then error replies; node id breaks ties."""
    if reply.has_error():
        return 1, 0.0, reply.metadata.src_node_id
    for record in reply.content.metric_records.values():
        value = record.get(PARTITION_ID)
        if isinstance(value, int | float):
            return 0, float(value), reply.metadata.src_node_id
    return 0, float("inf"), reply.metadata.src_node_id
