"""Wall-clock readings that time device work.

On CUDA the host queues kernels and runs ahead of the GPU, so a host reading alone times the
launches, not the work: the profile's step and unit times, which the planner weighs against
transfer and recomputation times, would be meaningless. ``device_now`` first waits for the
device. A profiling iteration's steps and units use it, and every step's wall time (which the
race compares) is taken with it, one wait at its start and one at its end; a replay's hook
points do not wait.
"""

import time

import torch


def device_now(device: torch.device) -> float:
    """``time.perf_counter()`` once the work queued on ``device`` has completed."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
