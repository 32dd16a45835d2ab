"""Typed, frozen settings of a run: plain data built by edgefl.config, read by everything else."""

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import vtensor
from edgefl.budget import Budget
from edgefl.data.partition import Partitioner
from edgefl.privacy.settings import PrivacySettings


@dataclass(frozen=True)
class DataSettings:
    """Which dataset, how it is split over clients, and how much of it is used."""

    name: str = "mnist"
    root: str | None = None  # folder holding the dataset files; None = the installed package
    partitioner: Partitioner = Partitioner.DIRICHLET
    alpha: float = 0.5
    min_partition_size: int = 10
    split_labels: tuple[int, ...] = ()  # label_split: the labels the first partitions hold
    split_partitions: int = 0  # label_split: how many partitions (the first) hold them
    max_examples_per_client: int = 0  # training examples kept per client; 0 = all
    local_test_fraction: float = 0.1  # share of a client's partition kept for its local evaluation
    central_test_examples: int = 0  # examples of the held-out test set the server uses; 0 = all
    seq_len: int = 80  # characters per example (text datasets)


@dataclass(frozen=True)
class ModelSettings:
    """A model of the zoo and its own options."""

    name: str = "cnn"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainSettings:
    """Local training; the server sends lr, epochs and batch size in each round's config."""

    lr: float = 0.05
    momentum: float = 0.9
    local_epochs: int = 1
    batch_size: int = 32
    eval_batch_size: int = 256
    torch_threads: int = 1  # per client process; more threads only oversubscribe a small host


class OffloadParams(StrEnum):
    """When a client offloads its parameters too (the rule: ``edgefl.train.offload_setting``)."""

    # Parameters, gradients and optimizer state are offloaded and planned with the activations
    # (vtensor's one plan) when they would take more than half the budget.
    AUTO = "auto"
    ON = "on"  # always
    OFF = "off"  # never


@dataclass(frozen=True)
class VTensorSettings:
    """The memory manager: on or off, and its chunking and storage."""

    enabled: bool = True
    chunk_bytes: int = 1 << 20
    storage_dir: str | None = None
    granularity: vtensor.Granularity = vtensor.Granularity.CHUNK
    offload_params: OffloadParams = OffloadParams.AUTO
    recompute: bool = False  # plans may recompute modules as well as swap (hybrid plans)
    encode_masks: bool | str = False  # clamps (ReLU6, Hardtanh) save bits; "auto": plans decide


@dataclass(frozen=True)
class DeviceClass:
    """One kind of device in a simulated fleet."""

    name: str
    budget: Budget
    share: float  # fraction of the fleet's clients


@dataclass(frozen=True)
class FleetSettings:
    """Device classes of a simulated fleet and where each class keeps its plan cache."""

    classes: tuple[DeviceClass, ...]
    plan_cache_root: str | None = None  # None = <tmp>/edgefl-plan-cache


@dataclass(frozen=True)
class ClientSettings:
    """Everything a ClientApp needs besides its node config."""

    seed: int
    data: DataSettings
    model: ModelSettings
    train: TrainSettings
    vtensor: VTensorSettings
    fleet: FleetSettings
    privacy: PrivacySettings = field(default_factory=PrivacySettings)


@dataclass(frozen=True)
class StrategySpec:
    """A Flower strategy as a Hydra target and its keyword arguments."""

    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PacingSettings:
    """strategies.memory_aware.MemoryAware's knobs (see conf/pacing/memory_aware.yaml)."""

    deadline_quantile: float = 0.5
    min_work_fraction: float = 0.25
    min_batch_size: int = 4


@dataclass(frozen=True)
class SecAggSettings:
    """edgefl.secagg.SecAggPlus's parameters (see conf/secagg/secagg_plus.yaml)."""

    num_shares: int = 5
    reconstruction_threshold: int = 3
    clipping_range: float = 1.0
    quantization_range: int = 1 << 22
    modulus_range: int = 1 << 32
    max_weight: int = 10_000
    timeout_s: float = 600.0


@dataclass(frozen=True)
class ServerSettings:
    """The ServerApp's run: rounds, strategy, outputs."""

    num_rounds: int
    num_supernodes: int
    strategy: StrategySpec
    output_dir: str
    round_timeout_s: float = 3600.0
    central_eval: bool = True
    save_plots: bool = True
    pacing: PacingSettings | None = None  # None: every client trains its full round
    secagg: SecAggSettings | None = None  # None: the server sees each client's update
    checkpoint: bool = True  # save model and strategy state after every round
    resume_from: str | None = None  # output folder of a stopped run to continue


@dataclass(frozen=True)
class SimulationSettings:
    """Resources of Flower's Ray simulation engine, local or an existing Ray cluster."""

    client_num_cpus: float = 1.0
    ray_num_cpus: int = 2  # CPUs of the local Ray instance; unused with ray_address
    flower_log_level: str = "WARNING"
    ray_address: str | None = None  # "HOST:PORT" of a running Ray cluster's head; None = local


@dataclass(frozen=True)
class RunSettings:
    """One experiment: the client side, the server side and the simulation engine."""

    client: ClientSettings
    server: ServerSettings
    simulation: SimulationSettings
