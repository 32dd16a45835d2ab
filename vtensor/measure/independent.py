"""The independent peak of an iteration: what the OS (CPU) or the CUDA allocator saw at most."""

from enum import StrEnum

import torch

from vtensor.errors import VTensorError
from vtensor.measure.rss import RssMeter


class PeakSource(StrEnum):
    """How the independent peak of a report was measured."""

    CUDA_MAX_ALLOCATED = "cuda-max-allocated"  # torch.cuda.max_memory_allocated
    RSS_VMHWM = "rss-vmhwm"  # the process's peak RSS (VmHWM) over the iteration


class IndependentPeak:
    """Measures each iteration's independent peak, when ``enabled``.

    Measuring resets process-wide high-water marks other tools read; disabled, every peak is None.
    """

    def __init__(self, device: torch.device, *, enabled: bool, rss: bool = False) -> None:
        """``rss``: the caller measures with the process's RSS (``count_workspaces``)."""
        if rss and device.type != "cpu":
            raise VTensorError(
                f"count_workspaces=True measures op workspaces with the process's RSS, which the "
                f"memory of a {device.type} device is not in: use it on a cpu device; on "
                f"{device.type}, measure_peaks=True reports the allocator's peak, workspaces "
                "included"
            )
        self.device = device
        self.enabled = enabled
        self.rss = RssMeter() if enabled and device.type == "cpu" else None
        self._start = 0

    @property
    def kind(self) -> PeakSource | None:
        """What the peaks measure (None: not measured)."""
        if not self.enabled:
            return None
        return PeakSource.CUDA_MAX_ALLOCATED if self.device.type == "cuda" else PeakSource.RSS_VMHWM

    def start(self) -> None:
        """An iteration begins: reset the high-water mark and note the level it rises from."""
        if not self.enabled:
            return
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            return
        assert self.rss is not None
        self.rss.reset_peak()
        self._start = self.rss.current_rss_bytes()

    def peak(self, baseline_bytes: int, seen_peak_bytes: int) -> int | None:
        """The iteration's peak: ``baseline_bytes`` plus the rise of RSS (CPU) or CUDA's count.

        ``seen_peak_bytes``: the highest RSS a profiling iteration read per step.
        """
        if not self.enabled:
            return None
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            assert self.rss is not None
            peak = max(self.rss.peak_rss_bytes(), seen_peak_bytes)
        return baseline_bytes + max(0, peak - self._start)

    def close(self) -> None:
        """Stop the RSS meter's sampling thread, if any."""
        if self.rss is not None:
            self.rss.close()
