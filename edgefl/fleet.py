"""The fleet's device classes: read from config, checked, and dealt to clients deterministically."""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from edgefl.budget import Budget, parse_budget
from edgefl.errors import ConfigError
from edgefl.settings import DeviceClass, FleetSettings

_CLASS_EXAMPLES = {"budget": "50%", "share": "0.5"}  # the keys of a class, with an example value


def fleet_settings(raw: Mapping[str, Any]) -> FleetSettings:
    """Checked settings of conf/fleet's plain data: classes keyed by name, kept in their order.

    Raises:
        ConfigError: naming the key (``fleet.classes.<name>.<key>``) and what it accepts.
    """
    classes = raw["classes"]
    if not isinstance(classes, Mapping):
        raise ConfigError(
            f"fleet.classes={classes!r} must map each class name to its budget and share, "
            "e.g. {micro: {budget: 40%, share: 0.5}, small: {budget: 60%, share: 0.5}}"
        )
    devices = []
    for name, entry in classes.items():
        where = f"fleet.classes.{name}"
        if not isinstance(entry, Mapping):
            raise ConfigError(
                f"{where}={entry!r} must set budget and share, e.g. "
                f"{where}={{budget: 50%, share: 0.5}}"
            )
        unknown = sorted(set(entry) - set(_CLASS_EXAMPLES))
        if unknown:
            raise ConfigError(
                f"unknown config key {where}.{unknown[0]}; a device class sets budget and share"
            )
        for key, example in _CLASS_EXAMPLES.items():
            if key not in entry:
                raise ConfigError(f"{where} has no {key}; set e.g. +{where}.{key}={example}")
        budget = parse_budget(entry["budget"], f"{where}.budget")
        devices.append(DeviceClass(str(name), budget, _share(entry["share"], f"{where}.share")))
    fleet = FleetSettings(tuple(devices), plan_cache_root=raw.get("plan_cache_root"))
    check_fleet(fleet)
    return fleet


def _share(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{what}={value!r} is not a number; set e.g. {what}=0.5")
    return float(value)


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


def fleet_in_bytes(fleet: FleetSettings, peak_bytes: int) -> FleetSettings:
    """``fleet`` with each share-of-peak budget as its bytes of ``peak_bytes``.

    A run that measured the unmanaged peak before its clients start gives them these bytes, so
    that its log, its clients and its tables state one budget (NOTE [relative budgets]).
    """
    classes = tuple(
        dataclasses.replace(c, budget=Budget(bytes=c.budget.of_peak(peak_bytes)))
        if c.budget.peak_fraction
        else c
        for c in fleet.classes
    )
    return dataclasses.replace(fleet, classes=classes)


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
