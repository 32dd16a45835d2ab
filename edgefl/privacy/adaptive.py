"""Adaptive clipping: a fixed-clipping DP wrapper whose norm follows a quantile of update norms.

NOTE [adaptive clipping]: Flower 1.42 has DifferentialPrivacy{Server,Client}SideAdaptiveClipping,
but they do not fit: (1) the norm moves the wrong way (it shrinks when more than the target
fraction of updates is clipped, so it runs away from the quantile; measured: every update
clipped, norm 1.0 -> 0.61 in five rounds), (2) the noise of a round is scaled by the norm
already updated for the next round rather than the norm the updates were clipped to, (3) there
is no accountant and no check that exactly num_sampled_clients replied, and (4) the count noise
is split as if the clipped count had sensitivity 1/2. So this wraps Flower's fixed-clipping
wrapper (clipping, strict reply count, equal weights, noise and accounting of the mean) and
after each release updates its norm as in Andrew et al. 2021, ``C *= exp(lr * (f - target))``
with f the noisy fraction of clipped updates, accounting the noisy count as a second Gaussian
release (NOTE [adaptive noise split] in edgefl.privacy.accounting).
"""

import logging
import math
from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import GaussianPrivacyEvent, Grid
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)
from flwr.supercore.differential_privacy import get_norm

from edgefl.privacy.accounting import CheckpointableRdpAccountant
from edgefl.privacy.mods import NORM_BIT_KEY

logger = logging.getLogger(__name__)

FixedClipping = (
    DifferentialPrivacyClientSideFixedClipping | DifferentialPrivacyServerSideFixedClipping
)


class AdaptiveClipping(Strategy):
    """Central DP whose clipping norm adapts between rounds (NOTE [adaptive clipping]).

    ``fixed`` is a Flower fixed-clipping wrapper with an accountant, built with the update's
    noise multiplier and the initial norm; ``clipped_count_stddev`` is the stdev of the noise
    on the number of clipped updates.
    """

    def __init__(
        self,
        fixed: FixedClipping,
        target_clipped_quantile: float,
        clip_norm_lr: float,
        clipped_count_stddev: float,
    ) -> None:
        super().__init__()
        if not isinstance(fixed.accountant, CheckpointableRdpAccountant):
            raise ValueError(
                "adaptive clipping needs a fixed-clipping wrapper with an accountant from "
                "edgefl.privacy.accounting.new_accountant"
            )
        self.fixed = fixed
        self.target_clipped_quantile = target_clipped_quantile
        self.clip_norm_lr = clip_norm_lr
        self.clipped_count_stddev = clipped_count_stddev

    @property
    def accountant(self) -> CheckpointableRdpAccountant:
        """The accountant of both releases of every round."""
        accountant = self.fixed.accountant
        assert isinstance(accountant, CheckpointableRdpAccountant)  # checked in __init__
        return accountant

    @property
    def clipping_norm(self) -> float:
        """The norm the next round's updates are clipped to."""
        return float(self.fixed.clipping_norm)

    def __repr__(self) -> str:
        return f"AdaptiveClipping({self.fixed!r})"

    def summary(self) -> None:
        """Log the adaptive settings, then the wrapped strategy's summary."""
        logger.info(
            "adaptive clipping: norm %.4f, target clipped quantile %.2f, lr %.2f, count stdev %.2f",
            self.clipping_norm,
            self.target_clipped_quantile,
            self.clip_norm_lr,
            self.clipped_count_stddev,
        )
        self.fixed.summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Let the fixed-clipping wrapper configure the round with the current norm."""
        return self.fixed.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Release the noisy mean at the current norm, then adapt the norm to the replies."""
        replies = list(replies)
        # Counted first: server-side clipping rewrites the replies in place.
        clipped = None if any(r.has_error() for r in replies) else self._count_clipped(replies)
        arrays, metrics = self.fixed.aggregate_train(server_round, replies)
        if arrays is not None and clipped is not None:
            self._adapt(clipped)
        return arrays, metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Evaluation is not private and not clipped: delegated as it is."""
        return self.fixed.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Delegated as it is."""
        return self.fixed.aggregate_evaluate(server_round, replies)

    def _count_clipped(self, replies: list[Message]) -> int:
        """How many replies' updates exceed the current norm (their norm bits, if client-side)."""
        if isinstance(self.fixed, DifferentialPrivacyClientSideFixedClipping):
            return sum(_norm_bit(reply) for reply in replies)
        current = self.fixed.current_arrays.to_numpy_ndarrays()
        count = 0
        for reply in replies:
            for record in reply.content.array_records.values():
                new = record.to_numpy_ndarrays()
                update = [np.subtract(a, b) for a, b in zip(new, current, strict=True)]
                # Flower's own norm: the count agrees with what its wrapper clips.
                count += int(get_norm(update) > self.fixed.clipping_norm)
        return count

    def _adapt(self, clipped: int) -> None:
        """Geometric update of the norm from the noisy clipped fraction; account the count."""
        n = self.fixed.num_sampled_clients
        fraction = float(np.random.normal(clipped, self.clipped_count_stddev)) / n
        old = self.fixed.clipping_norm
        self.fixed.clipping_norm = old * math.exp(
            self.clip_norm_lr * (fraction - self.target_clipped_quantile)
        )
        population = self.accountant.config.population_size
        self.accountant.compose(
            GaussianPrivacyEvent(self.clipped_count_stddev, population, population)
        )
        logger.debug(
            "clipping norm %.4f -> %.4f (noisy clipped fraction %.3f)",
            old,
            self.fixed.clipping_norm,
            fraction,
        )


def _norm_bit(reply: Message) -> int:
    """The clipped bit adaptiveclipping_mod adds to a train reply's metrics."""
    for record in reply.content.metric_records.values():
        if NORM_BIT_KEY in record:
            return int(bool(record[NORM_BIT_KEY]))
    raise ValueError(
        f"train reply from node {reply.metadata.src_node_id} has no {NORM_BIT_KEY!r} metric: "
        "its train handler lacks adaptiveclipping_mod; add client_train_mods(privacy) to it"
    )
