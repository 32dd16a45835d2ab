"""The server's last step: rebuild each secret from its shares and strip every mask from the sum.

A survivor's private-mask seed is rebuilt and its mask subtracted. A dropout's mask key is
rebuilt, checked against the key it published, and the pairwise masks its surviving neighbours
added for it are removed; pairwise masks between two survivors cancel in the sum by themselves.
"""

from typing import NoReturn

import numpy as np

from edgefl.secagg import crypto
from edgefl.secagg.errors import SecAggAbortedError
from edgefl.secagg.masking import Vector, prg_mask
from edgefl.secagg.protocol import ProtocolConfig, Stage


def unmask_total(
    total: Vector,
    shares: dict[int, list[bytes]],
    pk1s: dict[int, bytes],
    graph: dict[int, list[int]],
    survivors: set[int],
    config: ProtocolConfig,
    server_round: int,
) -> Vector:
    """The sum of the survivors' vectors, from their masked sum and the shares collected.

    ``shares`` maps every node that sent shares (U2) to at least ``threshold`` of its shares;
    ``survivors`` (U3) sent a masked vector, the others dropped out after sharing.
    """
    t, modulus = config.threshold, config.params.modulus_range
    for u in sorted(shares):
        secret = _rebuild(shares[u][:t], u, server_round)
        if u in survivors:
            total = total - prg_mask(secret, total.size, modulus)
            continue
        if crypto.public_key_of(secret) != pk1s[u]:
            _abort(f"the shares of dropped node {u} do not rebuild its published key", server_round)
        for v in graph[u]:
            if v in survivors:  # v added +mask if v > u, else -mask (see secagg_mod)
                mask = prg_mask(crypto.mask_seed(secret, pk1s[v]), total.size, modulus)
                total = total - mask if v > u else total + mask
    return total & np.uint64(modulus - 1)


def _rebuild(shares: list[bytes], node_id: int, server_round: int) -> bytes:
    try:
        return crypto.join_shares(shares)
    except ValueError as exc:  # Shamir padding check: shares of different secrets
        _abort(f"the shares of node {node_id} do not combine ({exc})", server_round)


def _abort(reason: str, server_round: int) -> NoReturn:
    raise SecAggAbortedError(
        f"round {server_round}: secure aggregation aborted at unmask: {reason}; the global model "
        "is unchanged",
        server_round,
        str(Stage.UNMASK),
    )
