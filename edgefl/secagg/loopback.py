"""An in-process Grid that hands each message to a ClientApp, for protocol tests and benchmarks.

Each message and reply is serialised into Flower's object tree and rebuilt from it, as Flower's
transport does, so nodes share no objects; the serialised sizes are counted per node.
``drop(node_id, stage)`` decides which node goes silent at which stage (``setup``,
``share-keys``, ``collect``, ``unmask``, or ``train``/``evaluate``/``query`` for other
messages): its message is lost, as when a device goes offline or misses the timeout.
"""

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

from edgefl.node import NUM_PARTITIONS, PARTITION_ID
from edgefl.secagg.protocol import RECORD, STAGE

DropFn = Callable[[int, str], bool]


class LoopbackGrid(Grid):
    """Delivers messages to ``app`` in this process, one Context (and state) per node."""

    def __init__(self, app: ClientApp, node_ids: Iterable[int], drop: DropFn | None = None):
        self.app, self.drop = app, drop
        ids = list(node_ids)
        self.contexts = {
            nid: Context(
                run_id=1,
                node_id=nid,
                node_config={PARTITION_ID: i, NUM_PARTITIONS: len(ids)},
                state=RecordDict(),
                run_config={},
            )
            for i, nid in enumerate(ids)
        }
        self.bytes_down: Counter[int] = Counter()  # server -> node, per node
        self.bytes_up: Counter[int] = Counter()  # node -> server, per node

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Deliver every message; return the replies of the nodes that did not drop."""
        replies = []
        for message in messages:
            node_id = message.metadata.dst_node_id
            if self.drop is not None and self.drop(node_id, stage_of(message)):
                continue
            delivered, size = _transport(message)
            self.bytes_down[node_id] += size
            try:
                reply = self.app(delivered, self.contexts[node_id])
            except Exception as exc:  # as Flower does: an exception becomes an error reply
                error = Error(code=0, reason=f"{type(exc).__name__}: {exc}")
                reply = Message(error, reply_to=delivered)
            returned, size = _transport(reply)
            self.bytes_up[node_id] += size
            replies.append(returned)
        return replies

    def get_node_ids(self) -> Iterable[int]:
        """Every node of the loopback fleet."""
        return list(self.contexts)

    # -- not used by a strategy's round: refused ----------------------------------------------
    def set_run(self, run: Any) -> None:
        """Refused."""
        raise NotImplementedError("LoopbackGrid has no runs")

    @property
    def run(self) -> Any:
        """Refused."""
        raise NotImplementedError("LoopbackGrid has no runs")

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        """Refused (deprecated in Flower)."""
        raise NotImplementedError("build Message objects directly")

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Refused: use send_and_receive."""
        raise NotImplementedError("LoopbackGrid only supports send_and_receive")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Refused: use send_and_receive."""
        raise NotImplementedError("LoopbackGrid only supports send_and_receive")


def stage_of(message: Message) -> str:
    """The protocol stage a message belongs to, or its category for other messages."""
    record = message.content.config_records.get(RECORD) if message.has_content() else None
    if record is not None and isinstance(record.get(STAGE), str):
        return str(record[STAGE])
    return message.metadata.message_type.split(".")[0]


def _transport(message: Message) -> tuple[Message, int]:
    """The message rebuilt from its serialised objects, and their total size in bytes."""
    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(message).items()}
    size = sum(len(c) for c in contents.values())
    rebuilt = inflate_object_from_contents(message.object_id, contents)
    assert isinstance(rebuilt, Message)
    return rebuilt, size
