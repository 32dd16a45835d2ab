"""Resident set size of this process, now and at its peak: the OS's view of its memory.

NOTE [honest RSS]: glibc keeps freed memory in its arenas and raises its mmap threshold at run
time, so by default RSS understates a step's peak and overstates the steady state. RSS follows
the live bytes only when the process was *started* with ``MALLOC_MMAP_THRESHOLD_=65536`` (or
``MALLOC_TRIM_THRESHOLD_=0``); ``rss_is_honest()`` checks for that.
"""

import enum
import logging
import os
import threading
from typing import Self

from vtensor.errors import VTensorError

logger = logging.getLogger(__name__)


class RssMode(enum.StrEnum):
    """How ``RssMeter`` finds the peak RSS."""

    CLEAR_REFS = "clear_refs"
    """The kernel's high-water mark VmHWM, reset through /proc/self/clear_refs: exact."""
    SAMPLING = "sampling"
    """A thread sampling RSS every interval: misses peaks shorter than the interval."""


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def _read_proc(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as exc:
        raise VTensorError(f"cannot read {path} ({exc}); RssMeter needs Linux procfs.") from exc


def _status_kib(field: str) -> int:
    for line in _read_proc("/proc/self/status").splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise VTensorError(f"/proc/self/status has no {field} line; RssMeter needs Linux procfs.")


class RssMeter:
    """Resident set size of this process, now and at its peak. See NOTE [honest RSS].

    Args:
        mode: force a peak mode; by default CLEAR_REFS if /proc/self/clear_refs is writable, else
            SAMPLING (logged as a warning).
        sample_interval_s: sampling period in SAMPLING mode.
    """

    def __init__(self, mode: RssMode | None = None, sample_interval_s: float = 0.001) -> None:
        self.current_rss_bytes()  # fail early off Linux
        if mode is None:
            mode = RssMode.CLEAR_REFS if self._clear_refs() else RssMode.SAMPLING
        self.mode = mode
        self._interval_s = sample_interval_s
        self._sampled_peak_bytes = 0
        self._sample_lock = threading.Lock()
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        if mode is RssMode.SAMPLING:
            self._sampled_peak_bytes = self.current_rss_bytes()
            self._sampler = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
            self._sampler.start()

    @staticmethod
    def _clear_refs() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # "5" resets only the peak RSS (VmHWM), see proc(5).
        except OSError as exc:
            logger.warning("cannot reset VmHWM via /proc/self/clear_refs (%s); sampling RSS", exc)
            return False
        return True

    def current_rss_bytes(self) -> int:
        """Returns the resident set size now, from /proc/self/statm."""
        return int(_read_proc("/proc/self/statm").split()[1]) * _PAGE_BYTES

    def peak_rss_bytes(self) -> int:
        """Returns the largest RSS since construction (SAMPLING) or the last ``reset_peak``."""
        if self.mode is RssMode.CLEAR_REFS:
            return _status_kib("VmHWM") * 1024
        return max(self._sampled_peak_bytes, self.current_rss_bytes())

    def reset_peak(self) -> None:
        """Starts a new peak window at the current RSS."""
        if self.mode is RssMode.CLEAR_REFS:
            if not self._clear_refs():
                raise VTensorError("/proc/self/clear_refs stopped accepting writes; use SAMPLING.")
        else:
            with self._sample_lock:
                self._sampled_peak_bytes = self.current_rss_bytes()

    def close(self) -> None:
        """Stops the sampling thread, if any."""
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join()
            self._sampler = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            rss_bytes = self.current_rss_bytes()
            # Under the lock, so a sample taken before reset_peak cannot land after it.
            with self._sample_lock:
                self._sampled_peak_bytes = max(self._sampled_peak_bytes, rss_bytes)


def rss_is_honest() -> bool:
    """Whether glibc was told at start-up to return freed memory, so RSS follows live bytes."""
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if threshold is not None and threshold.isdigit() and int(threshold) <= 65536:
        return True
    if os.environ.get("MALLOC_TRIM_THRESHOLD_") == "0":
        return True
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    for item in tunables.replace(":", " ").split():
        name, _, value = item.partition("=")
        if name == "glibc.malloc.mmap_threshold" and value.isdigit() and int(value) <= 65536:
            return True
        if name == "glibc.malloc.trim_threshold" and value == "0":
            return True
    return False
