"""Map a simulated client's partition id to a device class of the fleet, deterministically."""

import math

from edgefl.errors import ConfigError
from edgefl.settings import DeviceClass, FleetSettings


def check_fleet(fleet: FleetSettings) -> None:
    """Raise ConfigError unless the fleet has named classes with positive shares summing to 1."""
    if not fleet.classes:
        raise ConfigError("fleet.classes is empty; list at least one device class")
    names = [c.name for c in fleet.classes]
    if len(set(names)) != len(names):
        raise ConfigError(f"fleet.classes names {names} repeat; give each class its own name")
    for c in fleet.classes:
        if not c.share > 0:
            raise ConfigError(f"fleet class {c.name!r} has share={c.share}; shares must be > 0")
    total = sum(c.share for c in fleet.classes)
    if not math.isclose(total, 1.0, abs_tol=1e-6):
        raise ConfigError(f"fleet class shares sum to {total:g}; make them sum to 1")


def class_counts(fleet: FleetSettings, num_partitions: int) -> list[int]:
    """Clients per class for ``num_partitions`` clients (largest-remainder rounding of shares)."""
    exact = [c.share * num_partitions for c in fleet.classes]
    counts = [math.floor(e) for e in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: num_partitions - sum(counts)]:
        counts[i] += 1
    return counts


def device_class_for(
    fleet: FleetSettings, partition_id: int, num_partitions: int
) -> tuple[int, DeviceClass]:
    """Return (class index, class) of ``partition_id``.

    Classes take contiguous blocks of partition ids in the order they are listed, sized by
    ``class_counts``.
    """
    if not 0 <= partition_id < num_partitions:
        raise ConfigError(f"partition-id={partition_id} is outside [0, {num_partitions})")
    upper = 0
    for index, count in enumerate(class_counts(fleet, num_partitions)):
        upper += count
        if partition_id < upper:
            return index, fleet.classes[index]
    raise AssertionError("class_counts must cover every partition")  # pragma: no cover
