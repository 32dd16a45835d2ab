from pathlib import Path

import pytest

from edgefl.budget import Budget, parse_budget
from edgefl.errors import ConfigError
from edgefl.fleet import check_fleet, class_counts, device_class_for
from edgefl.node import resolve_node
from edgefl.settings import DeviceClass, FleetSettings, RunSettings

FLEET = FleetSettings(
    (
        DeviceClass("micro", Budget(1 << 20), 0.375),
        DeviceClass("small", Budget(2 << 20), 0.375),
        DeviceClass("medium", Budget(4 << 20), 0.25),
    )
)


def test_class_counts_follow_shares_and_cover_every_client() -> None:
    assert class_counts(FLEET, 8) == [3, 3, 2]
    for n in range(1, 30):
        assert sum(class_counts(FLEET, n)) == n


def test_device_class_is_a_deterministic_contiguous_block() -> None:
    names = [device_class_for(FLEET, pid, 8)[1].name for pid in range(8)]
    assert names == ["micro"] * 3 + ["small"] * 3 + ["medium"] * 2
    assert names == [device_class_for(FLEET, pid, 8)[1].name for pid in range(8)]


def test_partition_outside_the_fleet_is_refused() -> None:
    with pytest.raises(ConfigError, match="outside"):
        device_class_for(FLEET, 8, 8)


@pytest.mark.parametrize(
    "classes, match",
    [
        ((), "empty"),
        ((DeviceClass("a", Budget(1), 0.5), DeviceClass("a", Budget(1), 0.5)), "repeat"),
        ((DeviceClass("a", Budget(1), 0.5),), "sum to 0.5"),
        ((DeviceClass("a", Budget(1), 0.0), DeviceClass("b", Budget(1), 1.0)), "share=0.0"),
    ],
)
def test_bad_fleets_are_explained(classes: tuple[DeviceClass, ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        check_fleet(FleetSettings(classes))


def test_simulated_node_takes_budget_and_shared_cache_from_its_class(
    smoke_settings: RunSettings,
) -> None:
    a = resolve_node({"partition-id": 0, "num-partitions": 2}, smoke_settings.client)
    b = resolve_node({"partition-id": 1, "num-partitions": 2}, smoke_settings.client)
    assert a.device_class == b.device_class == "edge"
    assert a.budget == Budget(1 << 30)
    assert a.plan_cache_dir == b.plan_cache_dir  # one cache per device class
    assert a.plan_cache_dir.name == "edge"


def test_deployed_node_reads_its_node_config(smoke_settings: RunSettings, tmp_path: Path) -> None:
    node = resolve_node(
        {
            "partition-id": 3,
            "num-partitions": 10,
            "memory-budget": "64MiB",
            "plan-cache-dir": str(tmp_path / "plans"),
            "data-dir": "/data/mnist",
            "device-class": "pi4",
        },
        smoke_settings.client,
    )
    assert (node.partition_id, node.num_partitions) == (3, 10)
    assert node.budget == Budget(64 << 20)
    assert node.plan_cache_dir == tmp_path / "plans"
    assert node.data_root == "/data/mnist" and node.device_class == "pi4"


def test_bad_node_config_says_how_to_start_the_supernode(smoke_settings: RunSettings) -> None:
    with pytest.raises(ConfigError, match="--node-config"):
        resolve_node({"num-partitions": 2}, smoke_settings.client)
    with pytest.raises(ConfigError, match="memory-budget"):
        resolve_node(
            {"partition-id": 0, "num-partitions": 2, "memory-budget": "lots"}, smoke_settings.client
        )


@pytest.mark.parametrize(
    "value, budget",
    [("64MiB", Budget(64 << 20)), (1024, Budget(1024)), ("80%", Budget(peak_fraction=0.8))],
)
def test_budgets_are_bytes_or_a_share_of_the_unmanaged_peak(value: object, budget: Budget) -> None:
    assert parse_budget(value, "b") == budget


@pytest.mark.parametrize("value", ["0%", "120%", "lots", "x%", -5])
def test_bad_budgets_say_what_is_accepted(value: object) -> None:
    with pytest.raises(ConfigError, match=r"budget|percentage"):
        parse_budget(value, "fleet micro budget")
