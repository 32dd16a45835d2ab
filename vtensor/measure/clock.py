"""Wall-clock readings that time device work.

On CUDA the host runs ahead of the GPU, so a host reading alone times the launches, not the work.
Profiling steps and units, and every step's wall time, read ``device_now``; a replay's hooks do not.
"""

import time

import torch


def device_now(device: torch.device) -> float:
    """``time.perf_counter()`` once the work queued on ``device`` has completed."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
