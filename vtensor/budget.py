"""Budgets as users give them: bytes, a share of the unmanaged peak, or what the device can give.

NOTE [budget forms]
- bytes (``268435456``, ``"256MiB"``): used as given.
- ``"N%"``: N % of the unmanaged peak, read from the profiled trace (no unmanaged iteration,
  which may not fit, is needed); the first iteration profiles under ``"auto"``.
- ``"auto"``: what the device can give now: on CPU the cgroup's limit less its usage, else
  ``MemAvailable``; on CUDA the free device memory. ``AUTO_MARGIN`` of it is left for what no
  counter sees, and the tensors the process already holds are added.
A share of the peak is rounded down to a power-of-two quantum of at most 1/128 of it, so that
processes whose peaks differ by a few KiB share one cached plan.
"""

import math
import os
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch

from vtensor.errors import BudgetFormatError
from vtensor.sizes import ACCEPTED_FORMS, format_bytes, parse_bytes

AUTO_MARGIN = 0.10
QUANTUM_DIVISOR = 128
BUDGET_FORMS = f"{ACCEPTED_FORMS}; or 'N%' of the unmanaged peak (0 < N <= 100); or 'auto'"
_CGROUP = Path("/sys/fs/cgroup")
_NO_LIMIT = 1 << 60  # cgroup v1 writes a huge number where v2 writes "max"


class BudgetKind(StrEnum):
    """Which form a budget was given in (NOTE [budget forms])."""

    BYTES = "bytes"
    PEAK_SHARE = "share of the unmanaged peak"
    DEVICE = "auto"


@dataclass(frozen=True)
class BudgetSpec:
    """A parsed budget: ``nbytes`` for BYTES, ``peak_fraction`` for PEAK_SHARE."""

    kind: BudgetKind
    nbytes: int = 0
    peak_fraction: float = 0.0

    def __str__(self) -> str:
        if self.kind is BudgetKind.BYTES:
            return format_bytes(self.nbytes)
        if self.kind is BudgetKind.PEAK_SHARE:
            return f"{100 * self.peak_fraction:g}%"
        return "auto"


@dataclass(frozen=True)
class DeviceMemory:
    """Memory a device can give this process now, and where the figure was read."""

    free_bytes: int
    source: str


def parse_budget(value: int | float | str, *, what: str = "budget") -> BudgetSpec:
    """Parse any budget form (NOTE [budget forms]); ``BudgetFormatError`` lists them."""
    text = value.strip() if isinstance(value, str) else ""
    if text.lower() == "auto":
        return BudgetSpec(BudgetKind.DEVICE)
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            percent = math.nan
        if not 0 < percent <= 100:  # NaN fails too
            raise BudgetFormatError(
                f"{what}={value!r} is not a share of the unmanaged peak in (0%, 100%]; expected "
                f"{BUDGET_FORMS}"
            )
        return BudgetSpec(BudgetKind.PEAK_SHARE, peak_fraction=percent / 100)
    try:
        return BudgetSpec(BudgetKind.BYTES, nbytes=parse_bytes(value, what=what))
    except BudgetFormatError as exc:
        raise BudgetFormatError(f"{exc}; or 'N%' of the unmanaged peak; or 'auto'") from None


def share_of_peak(fraction: float, peak_bytes: int) -> int:
    """``fraction`` of ``peak_bytes``, rounded down to its quantum (NOTE [budget forms])."""
    exact = max(1, int(fraction * peak_bytes))
    quantum = 1 << max(0, (exact // QUANTUM_DIVISOR).bit_length() - 1)
    return exact - exact % quantum


def device_memory(device: torch.device) -> DeviceMemory | None:
    """What ``device`` can give this process now; None where nothing can be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return DeviceMemory(int(free), f"free memory of {device} (torch.cuda.mem_get_info)")
    if device.type != "cpu":
        return None
    available = _mem_available()
    limited = _cgroup_room()
    if limited is not None and (available is None or limited.free_bytes <= available.free_bytes):
        return limited
    return available


def device_budget(device: torch.device, held_bytes: int) -> tuple[int, str] | None:
    """The ``"auto"`` budget: free memory less ``AUTO_MARGIN``, plus ``held_bytes`` already held.

    Returns the bytes and where they came from; None where nothing can be read.
    """
    memory = device_memory(device)
    if memory is None or memory.free_bytes <= 0:
        return None
    usable = int(memory.free_bytes * (1 - AUTO_MARGIN))
    source = (
        f"auto: {format_bytes(memory.free_bytes)} {memory.source}, less a "
        f"{AUTO_MARGIN:.0%} margin, plus {format_bytes(held_bytes)} of tensors already held"
    )
    return usable + held_bytes, source


def _mem_available() -> DeviceMemory | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                kib = int(line.split()[1])
                return DeviceMemory(kib * 1024, "MemAvailable (/proc/meminfo)")
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> DeviceMemory | None:
    """The cgroup's limit less its usage, where this process's cgroup has a limit."""
    base = _cgroup_dir()
    pairs = (("memory.max", "memory.current"), ("memory.limit_in_bytes", "memory.usage_in_bytes"))
    for limit_file, usage_file in pairs:
        limit, usage = _read_int(base / limit_file), _read_int(base / usage_file)
        if limit is not None and usage is not None and limit < _NO_LIMIT:
            return DeviceMemory(
                max(0, limit - usage),
                f"left under the cgroup's {limit_file} of {format_bytes(limit)}",
            )
    return None


def _cgroup_dir() -> Path:
    """This process's memory cgroup folder (v2 unified, or v1's memory controller)."""
    try:
        lines = Path(f"/proc/{os.getpid()}/cgroup").read_text().splitlines()
    except OSError:
        return _CGROUP
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            return _CGROUP / path.lstrip("/")
        if "memory" in controllers.split(","):
            return _CGROUP / "memory" / path.lstrip("/")
    return _CGROUP


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
        return _NO_LIMIT if text == "max" else int(text)
    except (OSError, ValueError):
        return None
