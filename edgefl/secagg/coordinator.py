"""One SecAgg+ round over a Grid: the four exchanges, who dropped out when, and unmasking.

Sets follow Bell et al. (2020): U1 answered setup, U2 sent encrypted shares, U3 sent a masked
vector, U4 answered unmask. Every client in U2 needs ``threshold`` share holders left in U3
(and then U4): a survivor's private-mask seed or a dropout's mask key must be rebuilt.
"""

import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from numpy.typing import NDArray

from edgefl.secagg.errors import SecAggAbortedError, SecAggProtocolError
from edgefl.secagg.masking import Vector, decode_sum
from edgefl.secagg.protocol import (
    ACTIVE,
    CIPHERTEXTS,
    DROPPED,
    DSTS,
    MASKED_RECORD,
    NEIGHBOURS,
    OWNERS,
    PK1,
    PK1S,
    PK2,
    PK2S,
    QUERY_TYPE,
    RECORD,
    ROUND,
    SHARES,
    SRCS,
    STAGE,
    THRESHOLD,
    VECTOR,
    WEIGHT_KEY,
    ProtocolConfig,
    Stage,
)
from edgefl.secagg.unmasking import unmask_total
from edgefl.secagg.wire import blob, blobs, integers

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class RoundOutcome:
    """The weighted mean update of the survivors and how the round went."""

    mean_delta: NDArray[np.float64]
    total_weight: int
    replies: list[Message]  # the survivors' collect replies (their clear metrics)
    clients: dict[str, int] = field(default_factory=dict)  # sampled, then per stage
    stage_s: dict[str, float] = field(default_factory=dict)


def neighbour_graph(nodes: Iterable[int], num_shares: int) -> dict[int, list[int]]:
    """Each node's neighbourhood, itself included: a random ring, num_shares // 2 per side.

    Every node is everyone's neighbour when ``num_shares`` covers all nodes (plain SecAgg).
    """
    order = sorted(nodes)
    if num_shares >= len(order):
        return {u: order for u in order}
    random.SystemRandom().shuffle(order)
    half, n = num_shares // 2, len(order)
    return {
        u: sorted(order[(i + o) % n] for o in range(-half, half + 1)) for i, u in enumerate(order)
    }


def run_round(
    grid: Grid,
    server_round: int,
    train_content: dict[int, RecordDict],
    length: int,
    config: ProtocolConfig,
    train_timeout_s: float,
) -> RoundOutcome:
    """Run the four stages for the sampled nodes (the keys of ``train_content``).

    ``length`` is the number of model values. Raises SecAggAbortedError when too few clients
    remain to unmask.
    """
    r = _Round(grid, server_round, config, sampled=len(train_content))
    keys = r.setup(list(train_content))
    graph = neighbour_graph(keys, config.num_shares)
    r.require(Stage.SETUP, {u: len(graph[u]) for u in keys}, "neighbours")
    forwarded = r.share_keys(keys, graph)
    total, replies = r.collect(train_content, forwarded, graph, length, train_timeout_s)
    u2, u3 = set(forwarded), {m.metadata.src_node_id for m in replies}
    r.require(Stage.COLLECT, {u: len(set(graph[u]) & u3) for u in u2}, "share holders left")
    shares = r.unmask(graph, u2, u3)
    started = time.perf_counter()
    pk1s = {u: pair[0] for u, pair in keys.items()}
    total = unmask_total(total, shares, pk1s, graph, u3, config, server_round)
    mean_delta, total_weight = decode_sum(total, len(u3), config.params)
    r.stage_s["reconstruct"] = time.perf_counter() - started
    logger.info("secagg round %d: clients %s, seconds %s", server_round, r.clients, r.stage_s)
    return RoundOutcome(mean_delta, total_weight, replies, r.clients, r.stage_s)


class _Round:
    """Bookkeeping and exchanges of one round (one instance per round)."""

    def __init__(self, grid: Grid, server_round: int, config: ProtocolConfig, sampled: int):
        self.grid, self.server_round, self.config = grid, server_round, config
        self.clients: dict[str, int] = {"sampled": sampled}
        self.stage_s: dict[str, float] = {}

    def setup(self, nodes: list[int]) -> dict[int, tuple[bytes, bytes]]:
        """Send the parameters; return the (pk1, pk2) of every node that answered (U1)."""
        values = {THRESHOLD: self.config.threshold, WEIGHT_KEY: self.config.weight_key}
        record = self._record(Stage.SETUP, {**values, **self.config.params.to_config()})
        replies = self._exchange(Stage.SETUP, {u: RecordDict({RECORD: record}) for u in nodes})
        keys = self._parse(replies, lambda c: (blob(c, PK1), blob(c, PK2)))
        seen = [k for pair in keys.values() for k in pair]
        return {u: pair for u, pair in keys.items() if all(seen.count(k) == 1 for k in pair)}

    def share_keys(
        self, keys: dict[int, tuple[bytes, bytes]], graph: dict[int, list[int]]
    ) -> dict[int, list[tuple[int, bytes]]]:
        """Send each node its neighbours' keys; return, per node of U2, (src, sealed shares)."""
        contents = {}
        for u in keys:
            ids = graph[u]
            values = {
                NEIGHBOURS: ids,
                PK1S: [keys[v][0] for v in ids],
                PK2S: [keys[v][1] for v in ids],
            }
            contents[u] = RecordDict({RECORD: self._record(Stage.SHARE_KEYS, values)})
        replies = self._exchange(Stage.SHARE_KEYS, contents)
        sealed = self._parse(
            replies, lambda c: dict(zip(integers(c, DSTS), blobs(c, CIPHERTEXTS), strict=True))
        )
        for u in [u for u, s in sealed.items() if sorted(s) != [v for v in graph[u] if v != u]]:
            logger.warning("round %d: node %d sealed shares for other nodes", self.server_round, u)
            del sealed[u]
        forwarded = {v: [(u, s[v]) for u, s in sealed.items() if v in s] for v in sealed}
        self.require(
            Stage.SHARE_KEYS, {v: len(f) + 1 for v, f in forwarded.items()}, "share holders"
        )
        return forwarded

    def collect(
        self,
        train_content: dict[int, RecordDict],
        forwarded: dict[int, list[tuple[int, bytes]]],
        graph: dict[int, list[int]],
        length: int,
        timeout_s: float,
    ) -> tuple[Vector, list[Message]]:
        """Send each node of U2 its train content and shares; sum the masked vectors of U3."""
        contents = {}
        for u, pairs in forwarded.items():
            values = {SRCS: [s for s, _ in pairs], CIPHERTEXTS: [c for _, c in pairs]}
            contents[u] = RecordDict(
                {**train_content[u], RECORD: self._record(Stage.COLLECT, values)}
            )
        replies = self._exchange(Stage.COLLECT, contents, MessageType.TRAIN, timeout_s)
        total = np.zeros(length + 1, dtype=np.uint64)
        kept = []
        for u, reply in replies.items():
            record = reply.content.array_records.get(MASKED_RECORD)
            vector = None if record is None or VECTOR not in record else record[VECTOR].numpy()
            if (
                vector is None
                or vector.shape != total.shape
                or vector.dtype != self.config.params.wire_dtype
            ):
                logger.warning(
                    "round %d: node %d sent no valid masked vector", self.server_round, u
                )
                continue
            total += vector.astype(np.uint64)  # wraps mod 2**64, a multiple of the modulus
            kept.append(reply)
        self.clients[Stage.COLLECT] = len(kept)
        return total, kept

    def unmask(
        self, graph: dict[int, list[int]], u2: set[int], u3: set[int]
    ) -> dict[int, list[bytes]]:
        """Ask each survivor for its neighbours' seed shares (U3) or key shares (U2 - U3)."""
        contents = {}
        for u in u3:
            active = [v for v in graph[u] if v in u3]
            dropped = [v for v in graph[u] if v in u2 - u3]
            contents[u] = RecordDict(
                {RECORD: self._record(Stage.UNMASK, {ACTIVE: active, DROPPED: dropped})}
            )
        replies = self._exchange(Stage.UNMASK, contents)
        shares: dict[int, list[bytes]] = {u: [] for u in u2}
        for u, got in self._parse(
            replies, lambda c: dict(zip(integers(c, OWNERS), blobs(c, SHARES), strict=True))
        ).items():
            for owner in set(got) & set(graph[u]) & u2:
                shares[owner].append(got[owner])
        self.require(Stage.UNMASK, {u: len(s) for u, s in shares.items()}, "shares returned")
        return shares

    def require(self, stage: Stage, holders: dict[int, int], what: str) -> None:
        """Abort unless every node has at least ``threshold`` ``what``."""
        t = self.config.threshold
        short = sorted((n, u) for u, n in holders.items() if n < t)
        if short or not holders:
            worst = f"node {short[0][1]} has {short[0][0]} {what}" if short else "no client left"
            raise SecAggAbortedError(
                f"round {self.server_round}: secure aggregation aborted at {stage}: {worst}, "
                f"threshold {t} ({len(holders)} of {self.clients['sampled']} sampled clients "
                "left); the global model is unchanged. Lower reconstruction_threshold or raise "
                "num_shares to tolerate more dropouts",
                self.server_round,
                str(stage),
            )

    def _record(self, stage: Stage, values: dict[str, object]) -> ConfigRecord:
        return ConfigRecord({STAGE: str(stage), ROUND: self.server_round, **values})  # type: ignore[dict-item]

    def _exchange(
        self,
        stage: Stage,
        contents: dict[int, RecordDict],
        message_type: str = QUERY_TYPE,
        timeout_s: float | None = None,
    ) -> dict[int, Message]:
        """Send one message per node; return the replies without error, by node."""
        messages = [
            Message(c, dst_node_id=u, message_type=message_type, group_id=str(self.server_round))
            for u, c in contents.items()
        ]
        started = time.perf_counter()
        replies = self.grid.send_and_receive(
            messages, timeout=timeout_s or self.config.stage_timeout_s
        )
        self.stage_s[str(stage)] = time.perf_counter() - started
        ok = {}
        for reply in replies:
            u = reply.metadata.src_node_id
            if reply.has_error():
                logger.warning(
                    "round %d %s: node %d dropped out: %s",
                    self.server_round,
                    stage,
                    u,
                    reply.error.reason,
                )
            elif u in contents:
                ok[u] = reply
        self.clients[str(stage)] = len(ok)
        return ok

    def _parse(
        self, replies: dict[int, Message], read: Callable[[ConfigRecord], T]
    ) -> dict[int, T]:
        """``read`` of each reply's secagg record; a reply it cannot read counts as a dropout."""
        out = {}
        for u, reply in replies.items():
            try:
                out[u] = read(reply.content.config_records[RECORD])
            except (KeyError, ValueError, SecAggProtocolError) as exc:
                logger.warning(
                    "round %d: node %d sent a malformed reply: %s", self.server_round, u, exc
                )
        return out
