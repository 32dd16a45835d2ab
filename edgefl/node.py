"""Resolve what a node is (budget, device class, plan cache, data) from its Flower node config."""

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgefl.budget import Budget, parse_budget
from edgefl.errors import ConfigError
from edgefl.fleet import device_class_for
from edgefl.settings import ClientSettings

# Node-config keys of a deployed SuperNode (flower-supernode --node-config '...').
MEMORY_BUDGET = "memory-budget"
PLAN_CACHE_DIR = "plan-cache-dir"
DATA_DIR = "data-dir"
DEVICE_CLASS = "device-class"
PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"


@dataclass(frozen=True)
class NodeProfile:
    """The device a ClientApp runs on: its data partition, class, budget and plan cache."""

    partition_id: int
    num_partitions: int
    device_class: str
    class_index: int  # index in the fleet's classes; -1 for a deployed node
    budget: Budget  # bytes, or a share of the unmanaged peak resolved by the client
    plan_cache_dir: Path
    data_root: str | None


def resolve_node(node_config: Mapping[str, Any], settings: ClientSettings) -> NodeProfile:
    """Build the profile of the node running this ClientApp.

    Deployed (``memory-budget`` in the node config): from the node config keys. Simulated
    (node config holds only the partition id): from the fleet's device class of that id;
    clients of one class share that class's plan cache folder.
    """
    pid, num = _int(node_config, PARTITION_ID), _int(node_config, NUM_PARTITIONS)
    if MEMORY_BUDGET in node_config:
        budget = _budget(node_config[MEMORY_BUDGET])
        name = str(node_config.get(DEVICE_CLASS, "deployed"))
        default_cache = _cache_root(settings) / name
        cache = Path(str(node_config.get(PLAN_CACHE_DIR, default_cache)))
        data_dir = node_config.get(DATA_DIR)
        return NodeProfile(
            pid, num, name, -1, budget, cache, str(data_dir) if data_dir else settings.data.root
        )
    index, device = device_class_for(settings.fleet, pid, num)
    return NodeProfile(
        pid,
        num,
        device.name,
        index,
        device.budget,
        _cache_root(settings) / device.name,
        settings.data.root,
    )


def _cache_root(settings: ClientSettings) -> Path:
    root = settings.fleet.plan_cache_root
    return Path(root) if root else Path(tempfile.gettempdir()) / "edgefl-plan-cache"


def _budget(value: Any) -> Budget:
    try:
        return parse_budget(value, MEMORY_BUDGET)
    except ConfigError as exc:
        raise ConfigError(f'node config: {exc}; set e.g. {MEMORY_BUDGET}="64MiB"') from exc


def _int(node_config: Mapping[str, Any], key: str) -> int:
    if key not in node_config:
        raise ConfigError(
            f"node config lacks {key!r} (has {sorted(node_config)}); start the SuperNode with "
            f"--node-config '{PARTITION_ID}=0 {NUM_PARTITIONS}=10 {MEMORY_BUDGET}=\"64MiB\"'"
        )
    try:
        return int(node_config[key])
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"node config {key}={node_config[key]!r} is not an integer") from exc
