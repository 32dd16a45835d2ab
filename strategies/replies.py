"""The reply codes and metric keys a strategy reads, and the config keys it sends to clients.

A protocol between the clients and the strategies of this repository: the clients (edgefl)
import these names from here (re-exported by ``edgefl.records``), so the strategies depend on
no client code.
"""

# -- in a train reply's MetricRecord --------------------------------------------------------
NUM_EXAMPLES = "num-examples"  # distinct examples trained on: FedAvg's weighting key
EXAMPLES_PROCESSED = "examples-processed"  # examples through the model, each epoch counted
TRAIN_S = "train-s"  # seconds of local training, swap stalls included

# -- in a train instruction's ConfigRecord ---------------------------------------------------
MAX_EXAMPLES = "max-examples"  # examples a client may train this round (0 = all)
BATCH_SIZE = "batch-size"

# -- Error.code of an error reply ------------------------------------------------------------
ERROR_CODE_BUDGET = 4001  # the client's memory budget cannot be met
