"""A wrapper that paces each client's round by what its memory manager reports.

Every train reply of an edgefl client carries its device's figures: seconds of training
(swap stalls included), examples processed, budget, peak and bytes swapped. A round lasts as
long as its slowest client, and on edge fleets the slowest is the most memory-starved: it
swaps the most. ``MemoryAware`` wraps any Flower strategy (as Flower's DP wrappers do) and,
from the second round on, sends each slow client a cap on the examples it trains so that it
ends near the fleet's typical round time; a client that could not meet its budget trains with
a smaller batch next time. Aggregation stays the inner strategy's, weighted by the examples each
client actually trained on (``num-examples`` in its reply). The reply and config keys it reads
and writes are those of ``strategies.replies``.

The caps depend on measured times, so a paced run is not reproducible bit for bit; the inner
strategy's aggregation of the replies it receives is unchanged.
"""

import logging
from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from strategies.pacing import (
    NodeSpeed,
    batch_after_budget_failure,
    example_cap,
    round_deadline_s,
)
from strategies.replies import (
    BATCH_SIZE,
    ERROR_CODE_BUDGET,
    EXAMPLES_PROCESSED,
    MAX_EXAMPLES,
    TRAIN_S,
)

logger = logging.getLogger(__name__)


class MemoryAware(Strategy):
    """Pace clients by their reported speed and memory; delegate everything else.

    Args:
        strategy: the strategy whose sampling and aggregation are used.
        deadline_quantile: a round's deadline is this quantile of the clients' predicted
            round times (0.5: the median client sets the pace; 1.0: no client is capped).
        min_work_fraction: a capped client still trains at least this share of its data.
        min_batch_size: the smallest batch a client whose budget failed is sent.
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        deadline_quantile: float = 0.5,
        min_work_fraction: float = 0.25,
        min_batch_size: int = 4,
    ) -> None:
        if not 0.0 < deadline_quantile <= 1.0:
            raise ValueError(f"deadline_quantile={deadline_quantile} must be in (0, 1]")
        if not 0.0 < min_work_fraction <= 1.0:
            raise ValueError(f"min_work_fraction={min_work_fraction} must be in (0, 1]")
        if min_batch_size < 1:
            raise ValueError(f"min_batch_size={min_batch_size} must be at least 1")
        self.strategy = strategy
        self.deadline_quantile = deadline_quantile
        self.min_work_fraction = min_work_fraction
        self.min_batch_size = min_batch_size
        self.speeds: dict[int, NodeSpeed] = {}  # by node id, from the latest replies
        self.caps: dict[int, int] = {}  # what each node was sent this round (0 = no cap)
        self.config_batch_size = 32  # the round config's batch size, for nodes not yet paced

    def summary(self) -> None:
        """Log the pacing settings, then the inner strategy's summary."""
        logger.info(
            "MemoryAware: deadline at quantile %.2f of predicted round times, work >= %.0f%%, "
            "batch >= %d; wrapping %s",
            self.deadline_quantile,
            100 * self.min_work_fraction,
            self.min_batch_size,
            type(self.strategy).__name__,
        )
        self.strategy.summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The inner strategy's messages, each with its node's cap and batch size."""
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        batch = config.get(BATCH_SIZE, self.config_batch_size)
        if isinstance(batch, int | float) and not isinstance(batch, bool):
            self.config_batch_size = int(batch)
        known = [self.speeds[m.metadata.dst_node_id] for m in messages if self._known(m)]
        deadline = (
            round_deadline_s([s.predicted_full_s for s in known], self.deadline_quantile)
            if known
            else 0.0
        )
        self.caps = {}
        paced = [self._paced(m, deadline) for m in messages]
        for node, cap in self.caps.items():
            if cap:  # one line per capped client: the cap is otherwise seen in clients.csv only
                speed = self.speeds[node]
                logger.info(
                    "round %d: node %d capped at %d of %d examples (its round would take "
                    "%.1f s, the deadline is %.1f s)",
                    server_round,
                    node,
                    cap,
                    speed.full_examples,
                    speed.predicted_full_s,
                    deadline,
                )
        return paced

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Learn each node's speed from its reply, then aggregate with the inner strategy."""
        replies = list(replies)
        for reply in replies:
            self._observe(reply)
        return self.strategy.aggregate_train(server_round, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Delegate."""
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Delegate."""
        return self.strategy.aggregate_evaluate(server_round, replies)

    # -- per node -----------------------------------------------------------------------------
    def _known(self, message: Message) -> bool:
        speed = self.speeds.get(message.metadata.dst_node_id)
        return speed is not None and speed.full_examples > 0

    def _paced(self, message: Message, deadline_s: float) -> Message:
        node = message.metadata.dst_node_id
        speed = self.speeds.get(node)
        if speed is None:
            self.caps[node] = 0
            return message
        cap = example_cap(speed, deadline_s, self.min_work_fraction) if self._known(message) else 0
        self.caps[node] = cap
        content = RecordDict()
        for key, record in message.content.items():
            if isinstance(record, ConfigRecord):
                record = ConfigRecord({**record, MAX_EXAMPLES: cap, BATCH_SIZE: speed.batch_size})
            content[key] = record
        return Message(content, dst_node_id=node, message_type=message.metadata.message_type)

    def _observe(self, reply: Message) -> None:
        node = reply.metadata.src_node_id
        old = self.speeds.get(node)
        if reply.has_error():
            if reply.error.code == ERROR_CODE_BUDGET:
                batch = old.batch_size if old else self.config_batch_size
                self.speeds[node] = NodeSpeed(
                    old.seconds_per_example if old else 0.0,
                    old.full_examples if old else 0,
                    batch_after_budget_failure(batch, self.min_batch_size),
                    (old.budget_failures if old else 0) + 1,
                )
            return
        metrics: dict[str, float] = {}
        for record in reply.content.metric_records.values():
            metrics.update({k: float(v) for k, v in record.items() if isinstance(v, int | float)})
        processed = metrics.get(EXAMPLES_PROCESSED, 0.0)
        if processed <= 0 or TRAIN_S not in metrics:
            return
        uncapped = self.caps.get(node, 0) == 0
        self.speeds[node] = NodeSpeed(
            metrics[TRAIN_S] / processed,
            int(processed) if uncapped or old is None else old.full_examples,
            old.batch_size if old else self.config_batch_size,
            0,
        )
