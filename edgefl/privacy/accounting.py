"""Privacy accounting: the RDP accountant, and the noise multiplier each mode spends per round.

NOTE [accounting model]: every mode is accounted as client-level DP (neighbouring runs differ in
one client's whole local dataset) with Flower's RdpAccountant, sampling method
``no-amplification``. Flower's fixed-clipping accountant accepts only that method, and it is an
upper bound for any client sampling, exact when every client trains every round (fraction_train
1.0, as in conf/strategy/). Central modes use the relation ``add-or-remove-one`` with a fixed
denominator: the noisy mean divides by num_sampled_clients, and a round releases only when
exactly that many clients replied (Flower enforces it), so one client moves the mean by at most
clipping_norm / num_sampled_clients. Local mode protects a client against everyone it sends
to: its clipped update can change by 2 * clipping_norm when its data is replaced, so the
accounted multiplier is LocalDpMod's noise stdev over 2 * clipping_norm.

NOTE [adaptive noise split]: adaptive clipping releases two Gaussian queries per round, the
noisy mean of updates (multiplier z_update) and the noisy count of clipped updates (stdev
clipped_count_stddev on a count of sensitivity 1). Without amplification their RDP adds up to
that of one Gaussian query of multiplier z with z^-2 = z_update^-2 + clipped_count_stddev^-2, so
z_update is chosen such that the round costs exactly the configured noise_multiplier.
(Andrew et al. 2021 centre the clipped bits to get sensitivity 1/2; Flower's count is not
centred, hence the full clipped_count_stddev^-2 here.)
"""

import math
from typing import Any

from flwr.serverapp import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    RdpAccountant,
    SamplingMethod,
)

from edgefl.privacy.settings import PrivacyMode, PrivacySettings


class CheckpointableRdpAccountant(RdpAccountant):
    """Flower's RdpAccountant that pickles through its own state_dict.

    Flower's holds references to the dp-accounting modules, which pickle cannot store; a
    checkpoint pickles the strategy and, with it, the accountant inside a DP wrapper.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore_accountant, (self.config, self.state_dict()))


def _restore_accountant(
    config: PrivacyConfig, state: dict[str, object]
) -> CheckpointableRdpAccountant:
    accountant = CheckpointableRdpAccountant(config)
    accountant.load_state_dict(state)
    return accountant


def new_accountant(privacy: PrivacySettings, population_size: int) -> CheckpointableRdpAccountant:
    """An empty accountant for ``privacy`` (see NOTE [accounting model]).

    ``population_size`` only has to be at least the number of clients per round: without
    amplification it does not enter epsilon. ``max_epsilon`` makes Flower's fixed-clipping
    wrapper refuse a round past the budget too, a backstop behind PrivacyGuard.
    """
    return CheckpointableRdpAccountant(
        PrivacyConfig(
            target_delta=privacy.delta,
            population_size=population_size,
            neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod.NO_AMPLIFICATION,
            max_epsilon=privacy.target_epsilon,
        )
    )


def round_event(privacy: PrivacySettings, population_size: int) -> GaussianPrivacyEvent:
    """The privacy one round costs, as one Gaussian release of the whole population."""
    return GaussianPrivacyEvent(
        noise_multiplier=round_noise_multiplier(privacy),
        sample_size=population_size,
        population_size=population_size,
    )


def round_noise_multiplier(privacy: PrivacySettings) -> float:
    """Noise stdev over sensitivity of one round's releases (NOTE [accounting model])."""
    if privacy.central:
        return privacy.noise_multiplier
    if privacy.mode is PrivacyMode.LOCAL:
        return local_noise_stdev(privacy) / (2 * privacy.clipping_norm)
    raise ValueError(f"privacy mode {privacy.mode.value!r} releases nothing to account")


def local_noise_stdev(privacy: PrivacySettings) -> float:
    """Stdev LocalDpMod adds to each parameter: the classic Gaussian-mechanism calibration.

    That calibration promises (local_epsilon, delta) per release only for local_epsilon < 1;
    the epsilon PrivacyGuard reports comes from the accountant and holds for any value.
    """
    return (
        privacy.local_sensitivity * math.sqrt(2 * math.log(1.25 / privacy.delta))
    ) / privacy.local_epsilon


def update_noise_multiplier(noise_multiplier: float, clipped_count_stddev: float) -> float:
    """The update's multiplier in adaptive clipping (NOTE [adaptive noise split])."""
    share = noise_multiplier**-2 - clipped_count_stddev**-2
    if share <= 0:
        raise ValueError(
            f"clipped_count_stddev={clipped_count_stddev} must exceed "
            f"noise_multiplier={noise_multiplier}"
        )
    return float(share**-0.5)


def epsilon_after(privacy: PrivacySettings, num_rounds: int, population_size: int = 1) -> float:
    """Epsilon at ``privacy.delta`` after ``num_rounds`` rounds (0.0 for none)."""
    accountant = new_accountant(privacy, population_size)
    if num_rounds > 0:
        accountant.compose(round_event(privacy, population_size), count=num_rounds)
    return float(accountant.get_epsilon(privacy.delta)) if num_rounds > 0 else 0.0
