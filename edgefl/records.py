"""Every message key, once: record names, config and metric keys, the plan-source code, packing.

The keys and codes a strategy reads are ``strategies.replies``' (a protocol that the strategies
own, so they import nothing of edgefl); they are re-exported here, so edgefl takes every key
from this module.

NOTE [plan-source codes]: a MetricRecord holds numbers only, so vtensor's ``plan_source`` (a
``vtensor.PlanSource``) is sent as an int: 0 = unmanaged (vtensor off), and each member of
``vtensor.PlanSource`` its position in that enum plus 1 (profiled = 1: the client profiled the
model itself this round; planned: a plan made earlier in this process; cached: the round started
from a plan in the plan cache, no profiling; fallback: a step diverged from its plan; reactive:
no plan). Client and server run the same vtensor, so they agree on the order. The round's
source is its first step's, unless a later step fell back (see ``edgefl.train.train_local``).
Results (clients.csv) show the names again (``plan_source_name``).
"""

from flwr.app import ConfigRecord, MetricRecord

import vtensor
from edgefl.node import NodeProfile
from edgefl.train import EvalOutcome, TrainOutcome
from strategies.replies import BATCH_SIZE as BATCH_SIZE
from strategies.replies import ERROR_CODE_BUDGET as ERROR_CODE_BUDGET
from strategies.replies import EXAMPLES_PROCESSED as EXAMPLES_PROCESSED
from strategies.replies import MAX_EXAMPLES as MAX_EXAMPLES
from strategies.replies import NUM_EXAMPLES as NUM_EXAMPLES
from strategies.replies import TRAIN_S as TRAIN_S

# -- record names of a message's RecordDict (those Flower's strategies use) -------------------
ARRAYS = "arrays"
METRICS = "metrics"
NODE = "node"  # a reply's ConfigRecord of what the node is (``node_record``)

# -- a train/evaluate instruction's ConfigRecord (sent by the server or strategy) ----------
SERVER_ROUND = "server-round"  # set by Flower's strategies
LR = "lr"
LOCAL_EPOCHS = "local-epochs"
SEED = "seed"
PROXIMAL_MU = "proximal-mu"  # set by Flower's FedProx
TRAIN_CONFIG_KEYS = frozenset(
    {SERVER_ROUND, LR, LOCAL_EPOCHS, BATCH_SIZE, SEED, PROXIMAL_MU, MAX_EXAMPLES}
)

# -- a reply's MetricRecord -----------------------------------------------------------------
TRAIN_LOSS = "train-loss"
PEAK_DEVICE_BYTES = "peak-device-bytes"
BUDGET_BYTES = "budget-bytes"
BYTES_SWAPPED_OUT = "bytes-swapped-out"
BYTES_SWAPPED_IN = "bytes-swapped-in"
STALL_S = "stall-s"
TRAIN_CPU_S = "train-cpu-s"  # the client process's CPU time over train-s (NOTE [reference round])
PLAN_SOURCE = "plan-source"  # NOTE [plan-source codes]
PARTITION_ID = "partition-id"
# The index of the node's device class in the fleet (-1: a deployed node) in a MetricRecord;
# its name in the NODE ConfigRecord.
DEVICE_CLASS = "device-class"
EVAL_LOSS = "eval-loss"
EVAL_ACC = "eval-acc"
TRAIN_METRIC_KEYS = (
    NUM_EXAMPLES,
    EXAMPLES_PROCESSED,
    TRAIN_LOSS,
    PEAK_DEVICE_BYTES,
    BUDGET_BYTES,
    BYTES_SWAPPED_OUT,
    BYTES_SWAPPED_IN,
    STALL_S,
    TRAIN_S,
    TRAIN_CPU_S,
    PLAN_SOURCE,
    PARTITION_ID,
    DEVICE_CLASS,
)
EVAL_METRIC_KEYS = (NUM_EXAMPLES, EVAL_LOSS, EVAL_ACC, PARTITION_ID, DEVICE_CLASS)
# The server's evaluation of the global model (its evaluate function's MetricRecord).
CENTRAL_LOSS = "central-loss"
CENTRAL_ACC = "central-acc"

# -- plan-source codes (NOTE [plan-source codes]) --------------------------------------------
UNMANAGED_CODE = 0
UNMANAGED = "unmanaged"  # the name of UNMANAGED_CODE
_SOURCES = list(vtensor.PlanSource)


def plan_source_code(source: vtensor.PlanSource | None) -> int:
    """Code of a ``report().plan_source``; None means vtensor was off."""
    return UNMANAGED_CODE if source is None else _SOURCES.index(source) + 1


def plan_source_of(code: float) -> vtensor.PlanSource | None:
    """The plan source a code stands for; None for unmanaged (vtensor off).

    Raises:
        ValueError: ``code`` is no plan-source code.
    """
    if code == UNMANAGED_CODE:
        return None
    if code != int(code) or not 1 <= code <= len(_SOURCES):
        raise ValueError(
            f"{PLAN_SOURCE}={code!r} is no plan-source code: 0 (unmanaged) or 1..{len(_SOURCES)} "
            f"({', '.join(_SOURCES)})"
        )
    return _SOURCES[int(code) - 1]


def plan_source_name(code: float) -> str:
    """``"unmanaged"`` or the plan source's name (``"profiled"``, ``"cached"``, ...)."""
    source = plan_source_of(code)
    return UNMANAGED if source is None else str(source)


def node_record(node: NodeProfile) -> ConfigRecord:
    """What a reply says of its node: the device class by name (a MetricRecord holds numbers).

    A deployed node's class is the name in its node config, which the server cannot know
    otherwise; results and tables name every class by this name.
    """
    return ConfigRecord({DEVICE_CLASS: node.device_class})


def device_class_name(record: ConfigRecord | None) -> str:
    """The device class a reply's NODE record names; "" for a reply without one."""
    value = None if record is None else record.get(DEVICE_CLASS)
    return value if isinstance(value, str) else ""


def train_metrics(outcome: TrainOutcome, node: NodeProfile, budget_bytes: int) -> MetricRecord:
    """Metrics of a train reply; every reply has exactly ``TRAIN_METRIC_KEYS``."""
    values: dict[str, int | float | list[int] | list[float]] = {
        NUM_EXAMPLES: outcome.num_examples,
        EXAMPLES_PROCESSED: outcome.examples_processed,
        TRAIN_LOSS: outcome.loss,
        PEAK_DEVICE_BYTES: outcome.peak_device_bytes,
        BUDGET_BYTES: budget_bytes,
        BYTES_SWAPPED_OUT: outcome.bytes_out,
        BYTES_SWAPPED_IN: outcome.bytes_in,
        STALL_S: outcome.stall_s,
        TRAIN_S: outcome.train_s,
        TRAIN_CPU_S: outcome.train_cpu_s,
        PLAN_SOURCE: plan_source_code(outcome.plan_source),
        PARTITION_ID: node.partition_id,
        DEVICE_CLASS: node.class_index,
    }
    assert tuple(values) == TRAIN_METRIC_KEYS
    return MetricRecord(values)


def eval_metrics(outcome: EvalOutcome, node: NodeProfile) -> MetricRecord:
    """Metrics of an evaluate reply; every reply has exactly ``EVAL_METRIC_KEYS``."""
    values: dict[str, int | float | list[int] | list[float]] = {
        NUM_EXAMPLES: outcome.num_examples,
        EVAL_LOSS: outcome.loss,
        EVAL_ACC: outcome.accuracy,
        PARTITION_ID: node.partition_id,
        DEVICE_CLASS: node.class_index,
    }
    assert tuple(values) == EVAL_METRIC_KEYS
    return MetricRecord(values)
