"""Write a run's results: per-round metrics (JSON, CSV), per-client metrics, model, settings.

Their folder is checked before the run starts (``check_output_dir``).

clients.csv has a row per reply, its metrics as sent, except the plan source and the device
class shown by name (NOTE [plan-source codes] in edgefl.records; ``edgefl.history.class_of``).
"""

import csv
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from edgefl.errors import ConfigError
from edgefl.history import ClientRound, RunHistory, class_of
from edgefl.records import DEVICE_CLASS, PLAN_SOURCE, plan_source_name
from edgefl.settings import RunSettings

ROUNDS_JSON, ROUNDS_CSV = "rounds.json", "rounds.csv"
CLIENTS_CSV = "clients.csv"
MODEL_FILE = "final_model.pt"
SETTINGS_JSON = "settings.json"
SUMMARY_TXT = "summary.txt"
# rounds.json's key naming what its central_acc counts (edgefl.data.DatasetInfo.accuracy)
CENTRAL_ACC_NAME = "central_acc_name"


def check_output_dir(out_dir: Path) -> None:
    """Create ``out_dir`` and write and remove a probe file there, before a run starts.

    Raises:
        ConfigError: naming ``output_dir``, the folder and the OS error.
    """
    probe = out_dir / f".write-probe-{os.getpid()}"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"output_dir={out_dir}: cannot write there ({exc}); choose a writable folder"
        ) from None


def write_results(
    out_dir: Path,
    history: RunHistory,
    final_state: dict[str, torch.Tensor],
    settings: RunSettings,
    extra: dict[str, Any],
) -> list[Path]:
    """Write every result file into ``out_dir`` (created) and return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rounds = [dataclasses.asdict(r) for r in history.rounds]
    (out_dir / ROUNDS_JSON).write_text(json.dumps({"rounds": rounds, **extra}, indent=2))
    _write_csv(out_dir / ROUNDS_CSV, rounds)
    fleet = [device.name for device in settings.client.fleet.classes]
    clients = [
        {
            "server_round": c.server_round,
            "phase": c.phase,
            "node_id": c.node_id,
            "error": c.error or "",
            **_named(c, fleet),
        }
        for c in history.clients
    ]
    _write_csv(out_dir / CLIENTS_CSV, clients)
    torch.save(final_state, out_dir / MODEL_FILE)
    (out_dir / SETTINGS_JSON).write_text(
        json.dumps(dataclasses.asdict(settings), indent=2, default=str)
    )
    return [out_dir / n for n in (ROUNDS_JSON, ROUNDS_CSV, CLIENTS_CSV, MODEL_FILE, SETTINGS_JSON)]


def _named(reply: ClientRound, fleet: list[str]) -> dict[str, float | str]:
    """A reply's metrics as clients.csv shows them: plan source and device class by name."""
    named: dict[str, float | str] = dict(reply.metrics)
    if PLAN_SOURCE in named:
        named[PLAN_SOURCE] = plan_source_name(reply.metrics[PLAN_SOURCE])
    if DEVICE_CLASS in named:
        named[DEVICE_CLASS] = class_of(reply, fleet)
    return named


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
