"""Parsing of memory sizes given as bytes or as strings such as "256MiB" or "1.5GB"."""

import math
import re

from vtensor.errors import BudgetFormatError

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")
ACCEPTED_FORMS = (
    "a positive number of bytes (int), or a string such as '268435456', '256MiB', '1.5GB', "
    "'512KiB' (units: B, KB/MB/GB/TB = powers of 1000, KiB/MiB/GiB/TiB = powers of 1024)"
)


def parse_bytes(value: int | float | str, *, what: str = "budget") -> int:
    """Return ``value`` as a positive whole number of bytes.

    Args:
        value: bytes as an int (or a whole float), or a string with an optional unit.
        what: the name of the setting, used in the error message.

    Raises:
        BudgetFormatError: the value is malformed, not positive, or not a whole number of bytes.
    """
    if isinstance(value, bool):
        raise BudgetFormatError(f"{what}={value!r} is a bool; expected {ACCEPTED_FORMS}")
    if isinstance(value, int):
        nbytes = value
    elif isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise BudgetFormatError(
                f"{what}={value!r} is not a whole number of bytes; expected {ACCEPTED_FORMS}"
            )
        nbytes = int(value)
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise BudgetFormatError(f"{what}={value!r} is not a size; expected {ACCEPTED_FORMS}")
        nbytes = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise BudgetFormatError(
            f"{what}={value!r} has type {type(value).__name__}; expected {ACCEPTED_FORMS}"
        )
    if nbytes <= 0:
        raise BudgetFormatError(f"{what}={value!r} must be positive; expected {ACCEPTED_FORMS}")
    return nbytes


def format_bytes(nbytes: int | float) -> str:
    """Format a byte count for humans, in binary units (``12.3 MiB``)."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB"):
        if abs(size) < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
