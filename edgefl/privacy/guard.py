"""The privacy budget between rounds: epsilon after each round, and a stop before one too many.

NOTE [guard state]: the guard keeps no ledger of its own that a checkpoint would have to save.
Central modes read the accountant inside the wrapped strategy (it travels with the strategy in
a checkpoint, and counts only rounds whose noisy mean was released). Local mode has no
server-side release to watch: a client spends its budget when it answers a train instruction,
so the guard charges every round it lets start, as if every client trained in it (the bound for
the client that did), and epsilon is a function of the round number alone.
"""

import logging

from flwr.serverapp.strategy import Strategy

from edgefl.errors import EdgeFLError
from edgefl.privacy.accounting import (
    CheckpointableRdpAccountant,
    epsilon_after,
    round_event,
)
from edgefl.privacy.settings import PrivacyMode, PrivacySettings

logger = logging.getLogger(__name__)


class PrivacyBudgetExhausted(EdgeFLError):
    """The next round would push epsilon past the configured target; the run should end."""

    def __init__(self, message: str, server_round: int, epsilon: float, next_epsilon: float):
        super().__init__(message)
        self.server_round = server_round
        self.epsilon = epsilon
        self.next_epsilon = next_epsilon


class PrivacyGuard:
    """Checks the budget before each round and reports epsilon after it (NOTE [guard state])."""

    def __init__(self, privacy: PrivacySettings, strategy: Strategy) -> None:
        self.privacy = privacy
        self._accountant: CheckpointableRdpAccountant | None = None
        self._local_rounds = 0
        if privacy.central:
            accountant = getattr(strategy, "accountant", None)
            if not isinstance(accountant, CheckpointableRdpAccountant):
                raise ValueError(
                    f"strategy {strategy!r} has no privacy accountant: wrap it with "
                    "edgefl.privacy.wrap_strategy before building the guard"
                )
            self._accountant = accountant

    def before_round(self, server_round: int) -> None:
        """Raise PrivacyBudgetExhausted if running ``server_round`` could exceed the target."""
        if self.privacy.mode is PrivacyMode.NONE:
            return
        now = self.epsilon() or 0.0
        after = self._epsilon_after_next(server_round)
        target = self.privacy.target_epsilon
        if target is not None and after > target:
            raise PrivacyBudgetExhausted(
                f"round {server_round} would raise epsilon from {now:.3f} to {after:.3f} at "
                f"delta={self.privacy.delta:g}, past privacy.target_epsilon={target:g}",
                server_round,
                now,
                after,
            )
        if self.privacy.mode is PrivacyMode.LOCAL:
            self._local_rounds = server_round
        logger.debug("round %d may run: epsilon %.3f -> at most %.3f", server_round, now, after)

    def epsilon(self) -> float | None:
        """Epsilon at ``privacy.delta`` spent so far; None when the run has no DP."""
        if self.privacy.mode is PrivacyMode.NONE:
            return None
        if self._accountant is None:
            return epsilon_after(self.privacy, self._local_rounds)
        if self._accountant.num_releases == 0:
            return 0.0
        return float(self._accountant.get_epsilon(self.privacy.delta))

    def _epsilon_after_next(self, server_round: int) -> float:
        if self._accountant is None:
            return epsilon_after(self.privacy, server_round)
        projected = CheckpointableRdpAccountant(self._accountant.config)
        projected.load_state_dict(self._accountant.state_dict())
        population = self._accountant.config.population_size
        projected.compose(round_event(self.privacy, population))
        return float(projected.get_epsilon(self.privacy.delta))
