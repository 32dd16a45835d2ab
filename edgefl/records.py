"""What travels in messages: metric keys, the plan-source code, and packing results into records.

NOTE [plan-source codes]: a MetricRecord holds numbers only, so vtensor's ``plan_source``
string is sent as an int: 0 = unmanaged (vtensor off), 1 = profiled (the client profiled the
model itself this round), 2 = cached (the round started from a plan in the plan cache, no
profiling), 3 = planned (a plan made earlier in this process), 4 = fallback (a step diverged
from its plan), 5 = reactive (no plan), 9 = any other source. The round's source is its first
step's, unless a later step fell back (see ``edgefl.train.train_local``).
"""

from enum import IntEnum

from flwr.app import MetricRecord

from edgefl.node import NodeProfile
from edgefl.train import EvalOutcome, TrainOutcome


class PlanSource(IntEnum):
    """Int codes of vtensor's plan source (see NOTE [plan-source codes])."""

    UNMANAGED = 0
    PROFILED = 1
    CACHED = 2
    PLANNED = 3
    FALLBACK = 4
    REACTIVE = 5
    OTHER = 9


def plan_source_code(source: str | None) -> PlanSource:
    """Code of a ``report().plan_source`` string; None means vtensor was off."""
    if source is None:
        return PlanSource.UNMANAGED
    codes = {s.name.lower(): s for s in PlanSource if s is not PlanSource.UNMANAGED}
    return codes.get(source, PlanSource.OTHER)


NUM_EXAMPLES = "num-examples"  # FedAvg's weighting key
TRAIN_METRIC_KEYS = (
    NUM_EXAMPLES,
    "examples-processed",
    "train-loss",
    "peak-device-bytes",
    "budget-bytes",
    "bytes-swapped-out",
    "bytes-swapped-in",
    "stall-s",
    "train-s",
    "plan-source",
    "partition-id",
    "device-class",
)
EVAL_METRIC_KEYS = (NUM_EXAMPLES, "eval-loss", "eval-acc", "partition-id", "device-class")
# Keys a train/evaluate instruction's ConfigRecord may carry (sent by the server or strategy).
TRAIN_CONFIG_KEYS = frozenset(
    {"server-round", "lr", "local-epochs", "batch-size", "seed", "proximal-mu", "max-examples"}
)
ERROR_CODE_BUDGET = 4001  # Error.code of a reply from a client whose budget cannot be met


def train_metrics(outcome: TrainOutcome, node: NodeProfile, budget_bytes: int) -> MetricRecord:
    """Metrics of a train reply; every reply has exactly ``TRAIN_METRIC_KEYS``."""
    values: dict[str, int | float | list[int] | list[float]] = {
        NUM_EXAMPLES: outcome.num_examples,
        "examples-processed": outcome.examples_processed,
        "train-loss": outcome.loss,
        "peak-device-bytes": outcome.peak_device_bytes,
        "budget-bytes": budget_bytes,
        "bytes-swapped-out": outcome.bytes_out,
        "bytes-swapped-in": outcome.bytes_in,
        "stall-s": outcome.stall_s,
        "train-s": outcome.train_s,
        "plan-source": int(plan_source_code(outcome.plan_source)),
        "partition-id": node.partition_id,
        "device-class": node.class_index,
    }
    assert tuple(values) == TRAIN_METRIC_KEYS
    return MetricRecord(values)


def eval_metrics(outcome: EvalOutcome, node: NodeProfile) -> MetricRecord:
    """Metrics of an evaluate reply; every reply has exactly ``EVAL_METRIC_KEYS``."""
    values: dict[str, int | float | list[int] | list[float]] = {
        NUM_EXAMPLES: outcome.num_examples,
        "eval-loss": outcome.loss,
        "eval-acc": outcome.accuracy,
        "partition-id": node.partition_id,
        "device-class": node.class_index,
    }
    assert tuple(values) == EVAL_METRIC_KEYS
    return MetricRecord(values)
