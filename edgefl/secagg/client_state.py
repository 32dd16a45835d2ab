"""A node's SecAgg+ state between messages, kept in ``context.state`` as one ConfigRecord.

NOTE [secagg node state]: ``context.state`` is per node and per run and outlives a message: in
simulation the engine keeps it and ships it with every message; in deployment the SuperNode
keeps it in memory while each message runs in a fresh ClientApp process. The record holds the
round's private keys and private-mask seed, so it is deleted once the node has answered unmask
(and replaced by the next setup).
"""

import dataclasses
from dataclasses import dataclass

from flwr.app import ConfigRecord, Context

from edgefl.secagg.errors import SecAggProtocolError
from edgefl.secagg.protocol import MaskingParams, Stage

STATE_RECORD = "secagg-node-state"


@dataclass(frozen=True)
class NodeState:
    """What a node knows after the last stage it completed in ``server_round``."""

    server_round: int
    stage: str  # the last stage completed (a Stage value)
    threshold: int
    params: MaskingParams
    weight_key: str
    sk1: bytes  # private key of the pairwise masks (PEM)
    pk1: bytes
    sk2: bytes  # private key of the share transfer (PEM)
    pk2: bytes
    seed: bytes = b""  # private-mask seed, drawn at share-keys
    neighbours: tuple[int, ...] = ()  # share-keys: the node's neighbourhood, itself included
    pk1s: tuple[bytes, ...] = ()
    pk2s: tuple[bytes, ...] = ()
    owners: tuple[int, ...] = ()  # whose shares this node holds (itself included)
    seed_shares: tuple[bytes, ...] = ()
    key_shares: tuple[bytes, ...] = ()

    def advance(self, stage: Stage, **changes: object) -> "NodeState":
        """This state after completing ``stage``."""
        return dataclasses.replace(self, stage=str(stage), **changes)  # type: ignore[arg-type]

    def public_keys(self, node_id: int) -> tuple[bytes, bytes]:
        """(pk1, pk2) of neighbour ``node_id``."""
        i = self.neighbours.index(node_id)
        return self.pk1s[i], self.pk2s[i]


def load_state(context: Context, server_round: int, after: Stage) -> NodeState:
    """The node's state, which must have completed ``after`` in ``server_round``."""
    record = context.state.config_records.get(STATE_RECORD)
    if record is None:
        raise SecAggProtocolError(
            f"round {server_round}: no secure-aggregation state on this node; a stage after "
            f"{after} arrived without a setup (or after this node answered unmask)"
        )
    state = _from_record(record)
    if (state.server_round, state.stage) != (server_round, after):
        raise SecAggProtocolError(
            f"round {server_round}: expected stage {after} of round {server_round} to be done, "
            f"but this node is at stage {state.stage} of round {state.server_round}"
        )
    return state


def store_state(context: Context, state: NodeState) -> None:
    """Keep ``state`` for the node's next message."""
    context.state.config_records[STATE_RECORD] = _to_record(state)


def clear_state(context: Context) -> None:
    """Forget the round's keys and seed."""
    context.state.config_records.pop(STATE_RECORD, None)


def _to_record(state: NodeState) -> ConfigRecord:
    values = dataclasses.asdict(state)
    params = values.pop("params")
    record = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
    return ConfigRecord({**record, **{f"params.{k}": v for k, v in params.items()}})


def _from_record(record: ConfigRecord) -> NodeState:
    values = dict(record)
    params = {
        k.removeprefix("params."): values.pop(k) for k in list(values) if k.startswith("params.")
    }
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return NodeState(params=MaskingParams(**params), **fields)  # type: ignore[arg-type]
