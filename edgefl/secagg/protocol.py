"""What SecAgg+ messages carry and what fixes a round: stages, keys, masking and thresholds.

NOTE [secagg messages]: setup, share-keys and unmask are ``query.secagg`` messages answered by
``secagg_query``; the collect stage is the round's ``train`` message (the inner strategy's
content plus the ``secagg`` ConfigRecord), answered by the train handler under ``secagg_mod``.
Every protocol message and reply holds a ConfigRecord ``secagg`` with ``stage`` and
``server-round``; docs/secagg.md lists what each stage adds.
"""

from dataclasses import dataclass
from enum import StrEnum

import numpy as np
from flwr.app import ConfigRecord

from edgefl.errors import ConfigError
from edgefl.records import SERVER_ROUND

SECAGG_ACTION = "secagg"  # @app.query("secagg") on the client
QUERY_TYPE = f"query.{SECAGG_ACTION}"
RECORD = "secagg"  # ConfigRecord of every protocol message and reply
MASKED_RECORD = "secagg-masked"  # ArrayRecord of a collect reply
VECTOR = "vector"  # its one Array: [weight, quantised update...] masked, mod the modulus

# Config keys (see docs/secagg.md for the stage each belongs to).
STAGE, ROUND = "stage", SERVER_ROUND
THRESHOLD, WEIGHT_KEY = "threshold", "weight-key"
CLIPPING, QUANTIZATION = "clipping-range", "quantization-range"
MODULUS, MAX_WEIGHT = "modulus-range", "max-weight"
PK1, PK2 = "pk1", "pk2"
NEIGHBOURS, PK1S, PK2S = "neighbours", "pk1s", "pk2s"
DSTS, SRCS, CIPHERTEXTS = "dsts", "srcs", "ciphertexts"
ACTIVE, DROPPED = "active", "dropped"
OWNERS, SHARES = "owners", "shares"


class Stage(StrEnum):
    """The protocol's four exchanges, in order."""

    SETUP = "setup"
    SHARE_KEYS = "share-keys"
    COLLECT = "collect"
    UNMASK = "unmask"


@dataclass(frozen=True)
class MaskingParams:
    """How an update becomes an integer vector mod ``modulus_range``.

    A client sends ``w`` (its example count) and ``SR((clip(r * delta) + c) * T / (2c))`` per
    coordinate, with ``r = w / max_weight``, ``c = clipping_range``, ``T = quantization_range``
    and ``SR`` stochastic rounding (see docs/secagg.md for the error bound).
    """

    clipping_range: float
    quantization_range: int
    modulus_range: int
    max_weight: int

    def check(self, max_clients: int) -> None:
        """Raise ConfigError unless sums of ``max_clients`` vectors cannot wrap around."""
        c, t, m, w = (
            self.clipping_range,
            self.quantization_range,
            self.modulus_range,
            self.max_weight,
        )
        if not c > 0:
            raise ConfigError(f"clipping_range={c} must be > 0 (the largest |update| kept)")
        if not 2 <= t < 2**31:
            raise ConfigError(f"quantization_range={t} must be in [2, 2**31) (int32 levels)")
        if m > 2**63 or m < 2 or m & (m - 1):  # 2**63: the largest a ConfigRecord int carries
            raise ConfigError(f"modulus_range={m} must be a power of two up to 2**63")
        if w < 1:
            raise ConfigError(f"max_weight={w} must be >= 1 (the largest client example count)")
        if max_clients * max(t, w) >= m:
            raise ConfigError(
                f"modulus_range={m} must exceed clients x max(quantization_range, max_weight) "
                f"= {max_clients} x {max(t, w)}; raise modulus_range or lower the others"
            )

    @property
    def step(self) -> float:
        """One quantisation level, in update units."""
        return 2 * self.clipping_range / self.quantization_range

    @property
    def wire_dtype(self) -> type[np.uint32] | type[np.uint64]:
        """The dtype a masked vector travels in."""
        return np.uint32 if self.modulus_range <= 2**32 else np.uint64

    def error_bound(self, num_clients: int, total_weight: int) -> float:
        """Largest |secure mean - exact weighted mean| per coordinate when nothing is clipped."""
        return num_clients * self.step * self.max_weight / total_weight

    def to_config(self) -> dict[str, int | float]:
        """The setup message's entries."""
        return {
            CLIPPING: float(self.clipping_range),
            QUANTIZATION: self.quantization_range,
            MODULUS: self.modulus_range,
            MAX_WEIGHT: self.max_weight,
        }

    @classmethod
    def from_config(cls, config: ConfigRecord) -> "MaskingParams":
        """Read the setup message's entries."""
        return cls(
            float(_number(config, CLIPPING)),
            int(_number(config, QUANTIZATION)),
            int(_number(config, MODULUS)),
            int(_number(config, MAX_WEIGHT)),
        )


def _number(config: ConfigRecord, key: str) -> int | float:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"secagg config {key}={value!r} must be a number")
    return value


@dataclass(frozen=True)
class ProtocolConfig:
    """The round's protocol parameters (checked by SecAggPlus)."""

    num_shares: int  # neighbourhood size, the client itself included
    threshold: int  # shares needed to rebuild a secret
    params: MaskingParams
    weight_key: str  # the reply metric that weights a client (sent in the clear)
    stage_timeout_s: float  # setup, share-keys, unmask; collect uses the round's timeout
