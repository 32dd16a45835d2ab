"""Client side of SecAgg+: the ``query.secagg`` handler (key stages) and the train-handler mod.

Register both on the ClientApp (docs/secagg.md)::

    app.query(SECAGG_ACTION)(secagg_query)

    @app.train(mods=[secagg_mod])  # outermost: other train mods see only the plain message
    def train(msg, context): ...
"""

import logging
import os
from collections.abc import Collection

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable, Mod

from edgefl.records import METRICS, NODE, TRAIN_LOSS
from edgefl.secagg import crypto
from edgefl.secagg.client_state import NodeState, clear_state, load_state, store_state
from edgefl.secagg.errors import SecAggProtocolError
from edgefl.secagg.masking import Vector, apply_masks, encode_update
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
    RECORD,
    ROUND,
    SHARES,
    SRCS,
    STAGE,
    THRESHOLD,
    VECTOR,
    WEIGHT_KEY,
    MaskingParams,
    Stage,
)
from edgefl.secagg.wire import blobs, integer, integers, only, text

logger = logging.getLogger(__name__)
# Metrics of a masked reply that stay on the client: the training loss is computed on the
# client's private data; memory and timing metrics describe the device, not the data.
WITHHELD_METRIC_KEYS = (TRAIN_LOSS,)
Values = dict[str, int | str | bytes | list[int] | list[bytes]]


def secagg_query(msg: Message, context: Context) -> Message:
    """Answer a setup, share-keys or unmask message (``query.secagg``)."""
    config = msg.content.config_records.get(RECORD)
    if config is None:
        raise SecAggProtocolError(f"a query.secagg message without the {RECORD!r} ConfigRecord")
    stage, server_round = text(config, STAGE), integer(config, ROUND)
    node_id = msg.metadata.dst_node_id
    if stage == Stage.SETUP:
        state, values = _setup(server_round, config)
        store_state(context, state)
    elif stage == Stage.SHARE_KEYS:
        state = load_state(context, server_round, after=Stage.SETUP)
        state, values = _share_keys(state, node_id, config)
        store_state(context, state)
    elif stage == Stage.UNMASK:
        values = _unmask(load_state(context, server_round, after=Stage.COLLECT), node_id, config)
        clear_state(context)  # one unmask per round, and the keys are no longer needed
    else:
        raise SecAggProtocolError(
            f"query.secagg stage={stage!r} is not setup, share-keys or unmask"
        )
    return Message(RecordDict({RECORD: _record(stage, server_round, values)}), reply_to=msg)


def make_secagg_mod(
    *, require_secagg: bool = False, withheld_metric_keys: Collection[str] = WITHHELD_METRIC_KEYS
) -> Mod:
    """A train-handler mod that answers the collect stage with a masked update.

    A train message without the ``secagg`` record reaches the handler unchanged, unless
    ``require_secagg`` (then it is refused: this client sends its update only masked).
    ``withheld_metric_keys`` are dropped from the reply's metrics, which travel in the clear.
    """

    def secagg_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if RECORD not in msg.content.config_records:
            if require_secagg:
                raise SecAggProtocolError(
                    "this client trains only under secure aggregation but got a plain train "
                    "message; wrap the server's strategy in SecAggPlus"
                )
            return call_next(msg, context)
        config = msg.content.config_records.pop(RECORD)  # the handler sees a plain message
        server_round, node_id = integer(config, ROUND), msg.metadata.dst_node_id
        state = load_state(context, server_round, after=Stage.SHARE_KEYS)
        state = _receive_shares(state, node_id, config)
        sent = only(msg.content.array_records, "ArrayRecord in the train message")
        reply = call_next(msg, context)
        if reply.has_error():
            return reply  # a dropout; the state stays before collect, so unmask is refused
        vector, metrics = _mask_reply(state, node_id, sent, reply, withheld_metric_keys)
        store_state(context, state.advance(Stage.COLLECT))
        content = RecordDict(
            {
                RECORD: _record(Stage.COLLECT, server_round, {}),
                MASKED_RECORD: ArrayRecord({VECTOR: Array(vector)}),
                METRICS: metrics,
            }
        )
        if NODE in reply.content.config_records:  # the node's device class, in the clear
            content[NODE] = reply.content.config_records[NODE]
        return Message(content, reply_to=msg)

    return secagg_mod


secagg_mod: Mod = make_secagg_mod()
strict_secagg_mod: Mod = make_secagg_mod(require_secagg=True)


def _setup(server_round: int, config: ConfigRecord) -> tuple[NodeState, Values]:
    threshold = integer(config, THRESHOLD)
    if threshold < 2:
        raise SecAggProtocolError(f"threshold={threshold} would let one share reveal a secret")
    sk1, pk1 = crypto.new_key_pair()
    sk2, pk2 = crypto.new_key_pair()
    params, weight_key = MaskingParams.from_config(config), text(config, WEIGHT_KEY)
    params.check(max_clients=1)  # a power-of-two modulus and int32 levels, or masking breaks
    state = NodeState(
        server_round, str(Stage.SETUP), threshold, params, weight_key, sk1, pk1, sk2, pk2
    )
    return state, {PK1: pk1, PK2: pk2}


def _share_keys(state: NodeState, node_id: int, config: ConfigRecord) -> tuple[NodeState, Values]:
    ids, pk1s, pk2s = integers(config, NEIGHBOURS), blobs(config, PK1S), blobs(config, PK2S)
    k, t = len(ids), state.threshold
    if not len(pk1s) == len(pk2s) == k == len(set(ids)) or node_id not in ids:
        raise SecAggProtocolError(f"node {node_id}: malformed neighbourhood {ids}")
    # 2t > k: a server that lies about who dropped cannot collect t shares of both secrets.
    if not t <= k < 2 * t:
        raise SecAggProtocolError(f"node {node_id}: {k} neighbours for threshold {t}; need t<=k<2t")
    me = ids.index(node_id)
    if (pk1s[me], pk2s[me]) != (state.pk1, state.pk2) or len(set(pk1s) | set(pk2s)) != 2 * k:
        raise SecAggProtocolError(f"node {node_id}: public keys altered or not all distinct")
    seed = os.urandom(32)
    seed_shares = crypto.split_secret(seed, t, k)
    key_shares = crypto.split_secret(state.sk1, t, k)
    others = [i for i in range(k) if i != me]
    sealed = [
        crypto.seal_shares(node_id, ids[i], seed_shares[i], key_shares[i], state.sk2, pk2s[i])
        for i in others
    ]
    state = state.advance(
        Stage.SHARE_KEYS,
        seed=seed,
        neighbours=tuple(ids),
        pk1s=tuple(pk1s),
        pk2s=tuple(pk2s),
        owners=(node_id,),
        seed_shares=(seed_shares[me],),
        key_shares=(key_shares[me],),
    )
    return state, {DSTS: [ids[i] for i in others], CIPHERTEXTS: sealed}


def _receive_shares(state: NodeState, node_id: int, config: ConfigRecord) -> NodeState:
    srcs, sealed = integers(config, SRCS), blobs(config, CIPHERTEXTS)
    if len(srcs) != len(sealed) or len(set(srcs)) != len(srcs):
        raise SecAggProtocolError(f"node {node_id}: collect lists differ in length or repeat ids")
    if not set(srcs) <= set(state.neighbours) - {node_id}:
        raise SecAggProtocolError(f"node {node_id}: shares from non-neighbours in {srcs}")
    if len(srcs) + 1 < state.threshold:
        raise SecAggProtocolError(
            f"node {node_id}: {len(srcs) + 1} shares held, threshold {state.threshold}"
        )
    opened = [
        crypto.open_shares(c, src, node_id, state.sk2, state.public_keys(src)[1])
        for src, c in zip(srcs, sealed, strict=True)
    ]
    return state.advance(
        Stage.SHARE_KEYS,  # still before collect: shares held, no masked vector sent yet
        owners=state.owners + tuple(srcs),
        seed_shares=state.seed_shares + tuple(s for s, _ in opened),
        key_shares=state.key_shares + tuple(k for _, k in opened),
    )


def _mask_reply(
    state: NodeState, node_id: int, sent: ArrayRecord, reply: Message, withheld: Collection[str]
) -> tuple[Vector, MetricRecord]:
    trained = only(reply.content.array_records, "ArrayRecord in the train reply")
    metrics = only(reply.content.metric_records, "MetricRecord in the train reply")
    if list(trained.keys()) != list(sent.keys()):
        raise SecAggProtocolError(f"node {node_id}: reply arrays differ from the sent ones")
    delta = np.concatenate(
        [(trained[k].numpy().astype(np.float64) - sent[k].numpy()).ravel() for k in sent]
    )
    weight = _weight(state, node_id, metrics)
    vector, clipped = encode_update(delta, weight, state.params)
    if clipped:
        logger.warning(
            "node %d: %d of %d update values clipped to +-%g (raise clipping_range)",
            node_id,
            clipped,
            delta.size,
            state.params.clipping_range,
        )
    pairwise = [  # the partner with the larger id adds the mask, the other subtracts it
        (crypto.mask_seed(state.sk1, state.public_keys(v)[0]), 1 if node_id > v else -1)
        for v in state.owners
        if v != node_id
    ]
    masked = apply_masks(vector, state.seed, pairwise, state.params.modulus_range)
    clear = MetricRecord({k: v for k, v in metrics.items() if k not in withheld})
    return masked.astype(state.params.wire_dtype), clear


def _weight(state: NodeState, node_id: int, metrics: MetricRecord) -> int:
    weight, key = metrics.get(state.weight_key), state.weight_key
    if isinstance(weight, bool) or not isinstance(weight, int | float) or weight != int(weight):
        raise SecAggProtocolError(f"node {node_id}: weight {key}={weight!r} must be a whole number")
    if not 0 <= weight <= state.params.max_weight:
        raise SecAggProtocolError(
            f"node {node_id}: {key}={weight} is outside [0, max_weight="
            f"{state.params.max_weight}]; raise SecAggPlus(max_weight=...) to at least {weight}"
        )
    return int(weight)


def _unmask(state: NodeState, node_id: int, config: ConfigRecord) -> Values:
    active, dropped = integers(config, ACTIVE), integers(config, DROPPED)
    held = dict(
        zip(state.owners, zip(state.seed_shares, state.key_shares, strict=True), strict=True)
    )
    if set(active) & set(dropped) or node_id not in active or not {*active, *dropped} <= set(held):
        raise SecAggProtocolError(
            f"node {node_id}: unmask lists active={active} dropped={dropped} must be disjoint, "
            f"hold this node as active, and name only nodes whose shares it holds {sorted(held)}"
        )
    if len(active) < state.threshold:
        raise SecAggProtocolError(
            f"node {node_id}: {len(active)} active neighbours, threshold {state.threshold}"
        )
    # One secret per node: the private-mask seed of a survivor, the mask key of a dropout.
    shares = [held[v][0] for v in active] + [held[v][1] for v in dropped]
    return {OWNERS: active + dropped, SHARES: shares}


def _record(stage: str, server_round: int, values: Values) -> ConfigRecord:
    return ConfigRecord({STAGE: str(stage), ROUND: server_round, **values})
