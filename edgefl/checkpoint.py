"""Save the server's state after every round, and load it to resume a stopped run.

A checkpoint holds what the next round depends on: the global model, the strategy object with
its state (FedAdam's moments, a memory-aware wrapper's telemetry, a DP wrapper's clipping norm),
the history so far, the RNG states the strategy samples clients with, and a key of the
settings that must not change across a resume (model, data, strategy, seed, fleet).

The strategy travels as a pickle inside a ``torch.save`` file: like any pickle, load only
checkpoints your own runs wrote.
"""

import dataclasses
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.serverapp.strategy import Strategy

from edgefl.errors import ConfigError
from edgefl.history import RunHistory
from edgefl.settings import RunSettings

CHECKPOINT_FILE = "checkpoint.pt"
SCHEMA_VERSION = 1


@dataclass
class Checkpoint:
    """The server's state after ``server_round``."""

    server_round: int
    state_dict: dict[str, torch.Tensor]
    strategy: Strategy
    history: RunHistory
    run_key: dict[str, Any]
    rng: dict[str, Any]
    extra: dict[str, Any]  # measured once per run (e.g. the unmanaged peak)


def run_key(settings: RunSettings) -> dict[str, Any]:
    """What a resumed run must share with the run it resumes (JSON-like, comparable)."""
    client = dataclasses.asdict(settings.client)
    client["fleet"].pop("plan_cache_root", None)  # where caches live may change
    client["data"].pop("root", None)
    key = {
        "client": client,
        "strategy": dataclasses.asdict(settings.server.strategy),
        "num_supernodes": settings.server.num_supernodes,
    }
    normalized: dict[str, Any] = json.loads(json.dumps(key, default=str))
    return normalized


def capture_rng() -> dict[str, Any]:
    """The RNG states a strategy may draw from (client sampling uses Python's ``random``)."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Put back the RNG states of ``capture_rng``."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(out_dir: Path, checkpoint: Checkpoint) -> Path:
    """Write ``checkpoint`` into ``out_dir`` atomically (a crash leaves the previous one)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / CHECKPOINT_FILE
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    payload = {"schema": SCHEMA_VERSION, **dataclasses.asdict(checkpoint)}
    payload["strategy"] = checkpoint.strategy  # asdict would not copy it faithfully
    payload["history"] = checkpoint.history
    try:
        with tmp.open("wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_checkpoint(run_dir: Path, expected_key: dict[str, Any]) -> Checkpoint:
    """The checkpoint of the run in ``run_dir``, checked against this run's settings.

    Raises:
        ConfigError: no checkpoint, an unreadable one, or one of a run with other settings.
    """
    path = run_dir / CHECKPOINT_FILE
    if not path.is_file():
        raise ConfigError(
            f"server.resume_from={str(run_dir)!r} holds no {CHECKPOINT_FILE}; point it at the "
            "output folder of a run that ran with server.checkpoint=true"
        )
    try:
        payload = torch.load(path, weights_only=False)
    except Exception as exc:  # a truncated or foreign file: any unpickling error
        raise ConfigError(
            f"checkpoint {path} cannot be read ({exc.__class__.__name__}: {exc}); "
            "it is damaged: start a new run or resume from another folder"
        ) from exc
    if not isinstance(payload, dict) or payload.get("schema") != SCHEMA_VERSION:
        raise ConfigError(
            f"checkpoint {path} has schema {_schema(payload)}, this edgefl reads "
            f"{SCHEMA_VERSION}; resume it with the edgefl version that wrote it"
        )
    payload.pop("schema")
    checkpoint = Checkpoint(**payload)
    differences = _differences(checkpoint.run_key, expected_key)
    if differences:
        raise ConfigError(
            f"cannot resume {run_dir}: its run had other settings ({'; '.join(differences[:5])}); "
            "resume with the same overrides (only num_rounds and outputs may change)"
        )
    return checkpoint


def _schema(payload: Any) -> Any:
    return payload.get("schema") if isinstance(payload, dict) else "none"


def _differences(saved: Any, wanted: Any, where: str = "") -> list[str]:
    """Human-readable paths where two JSON-like values differ."""
    if isinstance(saved, dict) and isinstance(wanted, dict):
        found: list[str] = []
        for key in sorted(set(saved) | set(wanted), key=str):
            path = f"{where}.{key}" if where else str(key)
            if key not in saved or key not in wanted:
                found.append(f"{path} only in one run")
            else:
                found += _differences(saved[key], wanted[key], path)
        return found
    return [] if saved == wanted else [f"{where}: was {saved!r}, now {wanted!r}"]
