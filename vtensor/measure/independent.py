"""The independent peak of an iteration: what the OS (CPU) or the CUDA allocator saw at most."""

import torch

from vtensor.measure.rss import RssMeter


def independent_start(device: torch.device, rss: RssMeter | None) -> int:
    """Start measuring an iteration's peak; returns the level it rises from (RSS on CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return 0
    assert rss is not None
    rss.reset_peak()
    return rss.current_rss_bytes()


def independent_peak(
    device: torch.device, rss: RssMeter | None, baseline: int, start: int, seen_peak: int
) -> int:
    """The iteration's peak: ``baseline`` plus the rise above ``start`` (CPU), or CUDA's max.

    ``seen_peak`` is the highest RSS a profiling iteration read per step (it resets the
    high-water mark at every step and keeps the maximum).
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    assert rss is not None
    peak = max(rss.peak_rss_bytes(), seen_peak)
    return baseline + max(0, peak - start)
