"""Pure pacing math: a round deadline from the nodes' speeds, each node's work cap and batch size.

A node's speed is what its memory manager made of its device: seconds per training example
measured in its last round, swap stalls included. A round lasts as long as its slowest node,
so a node predicted to need longer than the deadline (a quantile of all predicted round times)
gets a cap on the examples it trains, never below ``min_work_fraction`` of its full round.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeSpeed:
    """What one node's last replies said about its device."""

    seconds_per_example: float  # train-s / examples-processed of its last reply
    full_examples: int  # examples-processed of its last uncapped round
    batch_size: int  # the batch size it should train with next
    budget_failures: int = 0  # consecutive replies saying its budget could not be met

    @property
    def predicted_full_s(self) -> float:
        """Seconds an uncapped round would take on this node."""
        return self.seconds_per_example * self.full_examples


def round_deadline_s(predicted_s: Sequence[float], quantile: float) -> float:
    """The ``quantile`` (0..1, nearest rank) of the nodes' predicted round times."""
    if not predicted_s:
        raise ValueError("a deadline needs at least one node's predicted round time")
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"quantile={quantile} must be in (0, 1]")
    ranked = sorted(predicted_s)
    return ranked[max(0, math.ceil(quantile * len(ranked)) - 1)]


def example_cap(speed: NodeSpeed, deadline_s: float, min_work_fraction: float) -> int:
    """Examples the node may train this round so it ends near ``deadline_s``; 0 = no cap.

    The cap is a whole number of batches (the client cuts its last batch otherwise) and at
    least ``min_work_fraction`` of a full round, so no node's data drops out of the model.
    """
    if speed.predicted_full_s <= deadline_s or speed.seconds_per_example <= 0.0:
        return 0
    floor = math.ceil(min_work_fraction * speed.full_examples)
    affordable = int(deadline_s / speed.seconds_per_example)
    cap = max(floor, affordable // speed.batch_size * speed.batch_size, 1)
    return 0 if cap >= speed.full_examples else cap


def batch_after_budget_failure(batch_size: int, min_batch_size: int) -> int:
    """Half the batch (activation memory shrinks about linearly with it), not below the floor."""
    return max(min_batch_size, batch_size // 2)
