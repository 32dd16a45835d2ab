"""The one bridge to Hydra/OmegaConf: compose conf/, turn it into RunSettings, build strategies."""

import dataclasses
import functools
import os
import re
import shlex
import threading
import time
from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import vtensor
from edgefl.data.partition import Partitioner
from edgefl.errors import ConfigError
from edgefl.fleet import fleet_settings
from edgefl.privacy import check_secure_aggregation, privacy_settings
from edgefl.settings import (
    ClientSettings,
    DataSettings,
    ModelSettings,
    OffloadParams,
    PacingSettings,
    RunSettings,
    SecAggSettings,
    ServerSettings,
    SimulationSettings,
    StrategySpec,
    TrainSettings,
    VTensorSettings,
)
from edgefl.train import check_offload_params

CONF_DIR_ENV = "EDGEFL_CONF_DIR"
GROUPS = (
    "dataset",
    "partitioner",
    "model",
    "fleet",
    "strategy",
    "pacing",
    "secagg",
    "vtensor",
    "privacy",
    "experiment",
    "debug",
)
_LOCK = threading.Lock()  # Hydra's global state: one compose at a time
_Choice = TypeVar("_Choice", bound=StrEnum)


def conf_dir() -> Path:
    """The Hydra config folder: $EDGEFL_CONF_DIR, else conf/ beside the edgefl package."""
    path = Path(os.environ.get(CONF_DIR_ENV) or Path(__file__).resolve().parent.parent / "conf")
    if not (path / "config.yaml").is_file():
        raise ConfigError(
            f"no config.yaml in {path}; run from the edgefl checkout or set "
            f"{CONF_DIR_ENV} to its conf/ folder"
        )
    return path


def group_options(group: str) -> list[str]:
    """Names of the options of a config group (the yaml files in conf/<group>/)."""
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def compose_config(overrides: Sequence[str] = (), *, with_hydra: bool = False) -> DictConfig:
    """Compose conf/config.yaml with Hydra command-line style ``overrides``.

    ``with_hydra`` keeps Hydra's own ``hydra`` node (for ``--cfg hydra`` and ``--info``).
    """
    try:
        return _compose(overrides, with_hydra)
    except (HydraException, OmegaConfBaseException) as exc:
        message = (
            _class_hint(overrides) or f"config overrides {list(overrides)} do not compose: {exc}"
        )
        raise ConfigError(message) from exc


def _compose(overrides: Sequence[str], with_hydra: bool) -> DictConfig:
    with _LOCK:
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
                return compose(
                    config_name="config",
                    overrides=list(overrides),
                    return_hydra_config=with_hydra,
                )
        finally:
            GlobalHydra.instance().clear()


_CLASS_OVERRIDE = re.compile(r"^([+~]*)fleet\.classes\.([^.=]+)(.*)$")


def _class_hint(overrides: Sequence[str]) -> str | None:
    """Why an override of a device class that the fleet lacks fails, or None.

    Device classes are keyed by name (``fleet.classes.micro.budget``); a number or a name the
    chosen fleet does not have gets the fleet's class names, in order.
    """
    for override in overrides:
        match = _CLASS_OVERRIDE.match(override)
        if match is None or match.group(1).startswith("+"):
            continue
        others = [o for o in overrides if not _CLASS_OVERRIDE.match(o)]
        try:
            classes = _compose(others, False).fleet.classes
        except (HydraException, OmegaConfBaseException):
            return None
        prefix, key, rest = match.groups()
        if not isinstance(classes, DictConfig) or not classes or key in classes:
            continue
        names = [str(name) for name in classes]
        listed = ", ".join(f"{i} {name}" for i, name in enumerate(names))
        if key.isdigit():
            name = names[int(key)] if int(key) < len(names) else names[0]
            return (
                f"fleet.classes.{key}: device classes are named, not numbered; set "
                f"{prefix}fleet.classes.{name}{rest} (classes: {listed})"
            )
        return (
            f"fleet.classes.{key}: the fleet has no such device class (classes: {listed}); "
            f"set e.g. {prefix}fleet.classes.{names[0]}{rest}, or add one with "
            f"+fleet.classes.{key}={{budget: 50%, share: 0.5}}"
        )
    return None


CFG_PARTS = ("job", "hydra", "all")


def config_text(overrides: Sequence[str] = (), part: str = "job") -> str:
    """The composed config as YAML, like Hydra's ``--cfg job|hydra|all``.

    Raises:
        ConfigError: ``part`` is none of ``CFG_PARTS``, or the overrides do not compose.
    """
    if part not in CFG_PARTS:
        raise ConfigError(f"--cfg {part!r} is not one of {', '.join(CFG_PARTS)}")
    cfg = compose_config(overrides, with_hydra=part != "job")
    if part == "hydra":
        return OmegaConf.to_yaml(cfg.hydra)
    return OmegaConf.to_yaml(cfg)


def config_info(overrides: Sequence[str] = ()) -> str:
    """Where the config comes from and what it is made of, like Hydra's ``--info``."""
    cfg = compose_config(overrides, with_hydra=True)
    choices = OmegaConf.to_container(cfg.hydra.runtime.choices)
    assert isinstance(choices, dict)
    lines = [f"config folder: {conf_dir()}", "config groups (chosen option; all options):"]
    lines += [
        f"  {group}: {choices.get(group, '-')}; {', '.join(group_options(group))}"
        for group in GROUPS
    ]
    lines.append(f"overrides: {' '.join(overrides) or '(none)'}")
    return "\n".join(lines)


def load_run_settings(overrides: Sequence[str] = ()) -> RunSettings:
    """Compose and convert in one call."""
    return run_settings(compose_config(overrides))


def run_settings(cfg: DictConfig) -> RunSettings:
    """Turn a composed config into typed, validated RunSettings (relative paths made absolute)."""
    try:
        raw: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
        return _settings(raw)
    except (KeyError, TypeError, ValueError, OmegaConfBaseException) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"bad configuration value: {exc!r}") from exc


# The keys each fixed-schema section accepts; groups whose options differ in their keys
# (strategy, pacing, secagg, privacy) are checked where they are built.
_KNOWN_KEYS: dict[str, frozenset[str]] = {
    "": frozenset({"seed", "num_rounds", "num_supernodes", "output_dir", *GROUPS[:-2]})
    | {"train", "server", "simulation"},
    "train": frozenset(f.name for f in dataclasses.fields(TrainSettings)),
    "simulation": frozenset(f.name for f in dataclasses.fields(SimulationSettings)),
    "vtensor": frozenset(f.name for f in dataclasses.fields(VTensorSettings)),
    "server": frozenset(
        {"central_eval", "save_plots", "round_timeout_s", "checkpoint", "resume_from"}
    ),
    "dataset": frozenset(
        {f.name for f in dataclasses.fields(DataSettings)}
        - {"partitioner", "alpha", "min_partition_size", "labels", "partitions"}
    ),
    "partitioner": frozenset({"name", "alpha", "min_partition_size", "labels", "partitions"}),
    "model": frozenset({"name", "options"}),
    "fleet": frozenset({"plan_cache_root", "classes"}),
}


def check_known_keys(raw: Mapping[str, Any]) -> None:
    """Refuse a key that no setting reads (a typo or ``+key=...`` would else be ignored).

    Raises:
        ConfigError: naming the unknown key and the known keys of its section.
    """
    for section, known in _KNOWN_KEYS.items():
        values = raw if not section else raw.get(section)
        if not isinstance(values, Mapping):
            continue
        unknown = sorted(set(values) - known)
        if unknown:
            where = f"{section}." if section else ""
            raise ConfigError(
                f"unknown config key {where}{unknown[0]}; the known keys of "
                f"{section or 'the top level'} are {', '.join(sorted(known))}"
            )


def _settings(raw: dict[str, Any]) -> RunSettings:
    check_known_keys(raw)
    privacy = privacy_settings(raw["privacy"])
    resume_from = raw["server"].get("resume_from")
    output_dir = raw["output_dir"] or resume_from or f"outputs/{time.strftime('%Y%m%d-%H%M%S')}"
    fleet = fleet_settings(raw["fleet"])
    client = ClientSettings(
        seed=int(raw["seed"]),
        data=_data(raw["dataset"], raw["partitioner"]),
        model=ModelSettings(str(raw["model"]["name"]), dict(raw["model"].get("options") or {})),
        train=TrainSettings(**raw["train"]),
        vtensor=VTensorSettings(
            enabled=bool(raw["vtensor"]["enabled"]),
            chunk_bytes=_bytes(raw["vtensor"]["chunk_bytes"], "vtensor.chunk_bytes"),
            storage_dir=raw["vtensor"].get("storage_dir"),
            granularity=_choice(
                raw["vtensor"]["granularity"], vtensor.Granularity, "vtensor.granularity"
            ),
            offload_params=_choice(
                raw["vtensor"].get("offload_params", "auto"),
                OffloadParams,
                "vtensor.offload_params",
            ),
            recompute=_flag(raw["vtensor"].get("recompute", False), "vtensor.recompute"),
            encode_masks=_masks(raw["vtensor"].get("encode_masks", False)),
        ),
        fleet=fleet,
        privacy=privacy,
    )
    strategy = dict(raw["strategy"])
    check_offload_params(  # NOTE [offloading under FedProx]
        client.vtensor.offload_params == OffloadParams.ON,
        float(strategy.get("proximal_mu", 0) or 0),
    )
    server = ServerSettings(
        num_rounds=_positive(raw["num_rounds"], "num_rounds"),
        num_supernodes=_positive(raw["num_supernodes"], "num_supernodes"),
        strategy=StrategySpec(str(strategy.pop("_target_")), strategy),
        output_dir=str(Path(output_dir).resolve()),
        round_timeout_s=float(raw["server"]["round_timeout_s"]),
        central_eval=bool(raw["server"]["central_eval"]),
        save_plots=bool(raw["server"]["save_plots"]),
        pacing=_options(raw["pacing"], "pacing", {"memory_aware": PacingSettings}),
        secagg=_options(raw["secagg"], "secagg", {"secagg_plus": SecAggSettings}),
        checkpoint=bool(raw["server"].get("checkpoint", True)),
        resume_from=str(Path(resume_from).resolve()) if resume_from else None,
    )
    if server.secagg is not None:
        check_secure_aggregation(privacy)
    return RunSettings(client, server, SimulationSettings(**raw["simulation"]))


def _data(dataset: Mapping[str, Any], partitioner: Mapping[str, Any]) -> DataSettings:
    try:
        method = Partitioner(partitioner["name"])
    except ValueError:
        raise ConfigError(
            f"partitioner={partitioner['name']!r} is unknown; choose one of "
            f"{[p.value for p in Partitioner]}"
        ) from None
    return DataSettings(
        name=str(dataset["name"]),
        root=dataset.get("root"),
        partitioner=method,
        alpha=float(partitioner["alpha"]),
        min_partition_size=int(partitioner["min_partition_size"]),
        split_labels=tuple(int(x) for x in partitioner.get("labels") or ()),
        split_partitions=int(partitioner.get("partitions") or 0),
        max_examples_per_client=int(dataset["max_examples_per_client"]),
        local_test_fraction=float(dataset["local_test_fraction"]),
        central_test_examples=int(dataset["central_test_examples"]),
        seq_len=int(dataset["seq_len"]),
    )


def _options(raw: Mapping[str, Any], group: str, kinds: Mapping[str, Any]) -> Any:
    """The settings dataclass of a group whose option ``name: none`` means "off"."""
    options = dict(raw)
    name = options.pop("name")
    if name == "none":
        return None
    if name not in kinds:
        raise ConfigError(f"{group}={name!r} is unknown; choose one of {group_options(group)}")
    try:
        return kinds[name](**options)
    except TypeError as exc:
        raise ConfigError(f"{group}={name}: {exc}; see conf/{group}/{name}.yaml") from exc


def _bytes(value: Any, what: str) -> int:
    try:
        return vtensor.parse_bytes(value, what=what)
    except vtensor.VTensorError as exc:
        raise ConfigError(str(exc)) from exc


def _choice(value: Any, choices: type[_Choice], what: str) -> _Choice:
    try:
        return choices(str(value))
    except ValueError:
        raise ConfigError(f"{what}={value!r} is not one of {[c.value for c in choices]}") from None


def _flag(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{what}={value!r} is not true or false; set e.g. {what}=true")
    return value


def _masks(value: Any) -> bool | str:
    """``vtensor.encode_masks``: true, false, or auto (NOTE [mask encoding] in vtensor)."""
    if value == "auto":
        return "auto"
    if not isinstance(value, bool):
        raise ConfigError(
            f"vtensor.encode_masks={value!r} is not true, false or auto; set e.g. "
            "vtensor.encode_masks=auto"
        )
    return value


def _positive(value: Any, what: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what}={value!r} is not a whole number; set e.g. {what}=5") from None
    if number < 1:
        raise ConfigError(f"{what}={value} must be at least 1")
    return number


# -- flwr run: [tool.flwr.app.config] keys -> Hydra overrides --------------------------------
RUN_CONFIG_GROUP_KEYS = GROUPS
RUN_CONFIG_NUM_ROUNDS = "num-server-rounds"
RUN_CONFIG_OUTPUT_DIR = "output-dir"
RUN_CONFIG_OVERRIDES = "overrides"


def overrides_from_run_config(run_config: Mapping[str, Any]) -> list[str]:
    """Hydra overrides from a Flower run config; empty strings and 0 mean "keep the default"."""
    overrides = [
        f"{group}={run_config[group]}"
        for group in RUN_CONFIG_GROUP_KEYS
        if str(run_config.get(group, "") or "")
    ]
    rounds = int(run_config.get(RUN_CONFIG_NUM_ROUNDS, 0) or 0)
    if rounds > 0:
        overrides.append(f"num_rounds={rounds}")
    if str(run_config.get(RUN_CONFIG_OUTPUT_DIR, "") or ""):
        overrides.append(f"output_dir={run_config[RUN_CONFIG_OUTPUT_DIR]}")
    return overrides + shlex.split(str(run_config.get(RUN_CONFIG_OVERRIDES, "") or ""))


def settings_from_run_config(run_config: Mapping[str, Any]) -> RunSettings:
    """RunSettings of a ``flwr run`` (cached per distinct run config in this process)."""
    return _cached_settings(
        tuple(sorted((k, str(v)) for k, v in run_config.items())),
        tuple(overrides_from_run_config(run_config)),
    )


@functools.lru_cache(maxsize=8)
def _cached_settings(_key: tuple[tuple[str, str], ...], overrides: tuple[str, ...]) -> RunSettings:
    return load_run_settings(overrides)


def instantiate_strategy(spec: StrategySpec) -> Any:
    """Build the Flower strategy named by ``spec.target`` (Hydra ``_target_``) with its kwargs."""
    try:
        return instantiate({"_target_": spec.target, **spec.kwargs})
    except HydraException as exc:
        raise ConfigError(
            f"strategy {spec.target} with {spec.kwargs} cannot be built: {exc}"
        ) from exc
