"""Secure aggregation (SecAgg+) for edgefl's strategies on Flower's Message API (docs/secagg.md).

Server: wrap a weighted-mean strategy in ``SecAggPlus``; the round loop calls its
``train_round``. Client: register ``secagg_query`` for ``query.secagg`` and put ``secagg_mod``
first in the train handler's mods.
"""

from edgefl.secagg.client import make_secagg_mod, secagg_mod, secagg_query, strict_secagg_mod
from edgefl.secagg.errors import SecAggAbortedError, SecAggError, SecAggProtocolError
from edgefl.secagg.protocol import QUERY_TYPE, SECAGG_ACTION, MaskingParams
from edgefl.secagg.server import SecAggPlus

__all__ = [
    "QUERY_TYPE",
    "SECAGG_ACTION",
    "MaskingParams",
    "SecAggAbortedError",
    "SecAggError",
    "SecAggPlus",
    "SecAggProtocolError",
    "make_secagg_mod",
    "secagg_mod",
    "secagg_query",
    "strict_secagg_mod",
]
