"""Server-side privacy: wrap a Flower strategy in the DP wrapper its privacy mode needs."""

import copy

from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
    Strategy,
)

from edgefl.errors import ConfigError
from edgefl.privacy.accounting import new_accountant, update_noise_multiplier
from edgefl.privacy.adaptive import AdaptiveClipping
from edgefl.privacy.mods import UNIT_WEIGHT_KEY
from edgefl.privacy.settings import ClippingSide, PrivacyMode, PrivacySettings


def num_sampled_clients(strategy: Strategy, num_nodes: int) -> int:
    """How many clients ``strategy`` asks to train each round when ``num_nodes`` are connected.

    FedAvg's rule: fraction_train of the nodes, at least min_train_nodes. Central DP divides by
    this number and releases a round only when exactly this many clients replied.
    """
    if not isinstance(strategy, FedAvg):
        raise ConfigError(f"cannot tell how many clients {type(strategy).__name__} samples")
    return max(int(num_nodes * strategy.fraction_train), strategy.min_train_nodes)


def wrap_strategy(
    strategy: Strategy, privacy: PrivacySettings, num_sampled_clients: int
) -> Strategy:
    """``strategy`` inside the DP wrapper of ``privacy``; unchanged for none and local.

    Central modes need a strategy whose aggregate is FedAvg's plain mean (FedAvg, FedProx):
    the noise is calibrated to the mean of clipped updates, not to a median or to a server
    optimizer's step. The strategy is copied, not changed, and weighted by the unit weight the
    clients' mods add (NOTE [equal weights] in edgefl.privacy.mods).
    """
    if not privacy.central:
        return strategy
    if not isinstance(strategy, FedAvg) or type(strategy).aggregate_train is not (
        FedAvg.aggregate_train
    ):
        raise ConfigError(
            f"privacy={privacy.mode.value} needs a strategy that averages like FedAvg, not "
            f"{type(strategy).__name__}: its noise is calibrated to a plain mean of clipped "
            "updates; use strategy=fedavg or strategy=fedprox (or privacy=local)"
        )
    if num_sampled_clients < 1:
        raise ConfigError(f"num_sampled_clients={num_sampled_clients} must be at least 1")
    inner = copy.copy(strategy)
    inner.weighted_by_key = UNIT_WEIGHT_KEY
    accountant = new_accountant(privacy, num_sampled_clients)
    wrapper = (
        DifferentialPrivacyClientSideFixedClipping
        if privacy.clipping_side is ClippingSide.CLIENT
        else DifferentialPrivacyServerSideFixedClipping
    )
    if privacy.mode is PrivacyMode.CENTRAL_FIXED:
        return wrapper(
            inner,
            privacy.noise_multiplier,
            privacy.clipping_norm,
            num_sampled_clients,
            accountant=accountant,
        )
    fixed = wrapper(
        inner,
        update_noise_multiplier(privacy.noise_multiplier, privacy.clipped_count_stddev),
        privacy.clipping_norm,
        num_sampled_clients,
        accountant=accountant,
    )
    return AdaptiveClipping(
        fixed,
        target_clipped_quantile=privacy.target_clipped_quantile,
        clip_norm_lr=privacy.clip_norm_lr,
        clipped_count_stddev=privacy.clipped_count_stddev,
    )
