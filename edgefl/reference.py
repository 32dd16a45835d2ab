"""Time one client's local round unmanaged: the reference the budgeted clients are compared with.

NOTE [reference round]: the end-of-run table compares each device class's training time with an
unmanaged client's, measured in the same run: the process that starts the run trains client 0's
first round once with vtensor off (same model, data, batch size and thread count as the
clients), before the clients start. Rounds differ in length between clients, so the comparison
is per example processed. It compares CPU time, the process's own (``time.process_time``: every
thread of it, vtensor's too), not wall time: the budgeted clients share the cores with each
other and with whatever else runs, while the reference runs alone, and wall time would count
that load as vtensor's, and read higher the busier the machine. Waits on swap I/O are not CPU
time; the round table states them (stall s).
"""

import time
from dataclasses import dataclass

import torch

from edgefl.client_data import client_split
from edgefl.models import build_model
from edgefl.settings import ClientSettings
from edgefl.train import settings_round, train_local


@dataclass(frozen=True)
class ReferenceRound:
    """One unmanaged local round: its wall and CPU time and the examples it processed."""

    train_s: float
    examples_processed: int
    cpu_s: float = 0.0  # 0: not measured (a checkpoint of an older run)

    @property
    def cpu_s_per_example(self) -> float:
        """CPU seconds per example processed (what "x unmanaged" compares)."""
        return self.cpu_s / max(1, self.examples_processed)


def time_unmanaged_round(settings: ClientSettings, num_partitions: int) -> ReferenceRound:
    """Train client 0's first local round with vtensor off, in this process; time it."""
    info, train, _ = client_split(
        settings.data, settings.data.root, 0, num_partitions, settings.seed
    )
    torch.manual_seed(settings.seed)
    torch.set_num_threads(settings.train.torch_threads)
    model = build_model(settings.model.name, info, settings.model.options)
    started = time.perf_counter()
    outcome = train_local(model, train, settings_round(settings.train, settings.seed))
    return ReferenceRound(
        time.perf_counter() - started, outcome.examples_processed, outcome.train_cpu_s
    )
