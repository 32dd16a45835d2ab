"""The frame every benchmark script shares: common flags, the environment record, JSON lines.

Every script runs from the repository root as ``python -m benchmarks.<name>``. With
``--out PATH`` it writes JSON lines: the first line is the environment record
(``"kind": "environment"``: the command, the date, the load average, torch and its thread
count, the thread and allocator variables, CPUs and platform), then one result row per line,
each tagged with its ``kind`` (``"variant"``, ``"summary"``, ...). Read a file back with
``[json.loads(line) for line in open(path)]``.
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from edgefl.data.arrays import ArrayDataset
    from edgefl.peak import PeakMeasurement
    from edgefl.settings import RunSettings

    ImageBatches = Callable[[int], tuple[torch.Tensor, torch.Tensor]]

# NOTE [honest RSS] in vtensor/measure/rss.py: with this threshold RSS follows the live bytes.
HONEST_RSS_ENV = "MALLOC_MMAP_THRESHOLD_"
HONEST_RSS_VALUE = "65536"
DEFAULT_MALLOC_FLAG = "--default-malloc"
RECORDED_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", HONEST_RSS_ENV)


# -- flags ----------------------------------------------------------------------------------------
def add_out(parser: argparse.ArgumentParser) -> None:
    """``--out PATH``: where the JSON lines go (nothing is written without it)."""
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="PATH",
        help="write JSON lines here: the environment record, then one result row per line",
    )


def add_quick(parser: argparse.ArgumentParser, what: str) -> None:
    """``--quick``: a CI-sized run that checks the script works; its figures are not results."""
    parser.add_argument(
        "--quick", action="store_true", help=f"CI-sized ({what}); its rows are not results"
    )


def add_repeats(parser: argparse.ArgumentParser, what: str, full: int, quick: int) -> None:
    """``--repeats N``: best-of repetitions; ``None`` until ``repeats`` resolves it."""
    parser.add_argument(
        "--repeats", type=int, default=None, help=f"{what} (default {full}; quick: {quick})"
    )


def repeats(args: argparse.Namespace, full: int, quick: int) -> int:
    """``--repeats`` as given, else ``quick`` under ``--quick`` and ``full`` without it."""
    if args.repeats is not None:
        return int(args.repeats)
    return quick if args.quick else full


def split_overrides(argv: Sequence[str] | None) -> tuple[list[str], list[str]]:
    """``argv`` (``sys.argv[1:]`` for None) as (the script's own arguments, the Hydra overrides
    after ``--``) for the scripts that train the main job's configuration."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args:
        return args, []
    cut = args.index("--")
    return args[:cut], args[cut + 1 :]


# -- environment ----------------------------------------------------------------------------------
def add_default_malloc(parser: argparse.ArgumentParser) -> None:
    """``--default-malloc``: run under glibc's default settings (see ``reexec_with_honest_rss``)."""
    parser.add_argument(
        DEFAULT_MALLOC_FLAG,
        action="store_true",
        help="keep glibc's default allocator settings: steps as a user's process runs them "
        "(freed memory is reused without page faults), but RSS figures do not follow the live "
        "bytes",
    )


def reexec_with_honest_rss() -> None:
    """Re-execute this process with ``MALLOC_MMAP_THRESHOLD_=65536`` unless it already has it.

    glibc reads the variable at start-up only, so a script that reports RSS calls this first
    thing under ``if __name__ == "__main__"``; the re-executed process runs the same module.
    With ``--default-malloc`` on the command line it does nothing: every allocation above the
    threshold is then a fresh mapping, page-faulted on first touch, which costs time a process
    under glibc's defaults does not spend (NOTE [honest RSS]).
    """
    if os.environ.get(HONEST_RSS_ENV) == HONEST_RSS_VALUE or DEFAULT_MALLOC_FLAG in sys.argv:
        return
    os.environ[HONEST_RSS_ENV] = HONEST_RSS_VALUE
    os.execv(sys.executable, [sys.executable, *_module_argv()])


def _module_argv() -> list[str]:
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is None:  # run as a file: the same file again
        return list(sys.argv)
    return ["-m", spec.name, *sys.argv[1:]]


def environment(**extra: Any) -> dict[str, Any]:
    """The environment record of this run; ``extra`` adds script-specific fields.

    Take it after ``torch.set_num_threads``: it records the thread count in effect.
    """
    import torch  # here, so that importing this module does not import torch

    return {
        "kind": "environment",
        "command": shlex.join(["python", *_module_argv()]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_avg": os.getloadavg(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "env": {name: os.environ.get(name) for name in RECORDED_ENV},
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        **extra,
    }


def describe(env: Mapping[str, Any]) -> str:
    """One ``#`` line that states the environment record, printed before a script's tables."""
    load = "/".join(f"{x:.2f}" for x in env["load_avg"])
    variables = ", ".join(f"{k}={v if v is not None else '-'}" for k, v in env["env"].items())
    return (
        f"# {env['command']}: torch {env['torch']}, {env['cpu_count']} CPUs, "
        f"{env['torch_threads']} torch threads, {variables}, load average {load}, "
        f"{env['platform']}, {env['date']}"
    )


# -- models ---------------------------------------------------------------------------------------
def main_job_model() -> tuple[str, "nn.Module", "ImageBatches"]:
    """The main job's model and client 0's batches, from the main job's configuration."""
    import numpy as np
    import torch  # here, so that importing this module does not import torch

    from edgefl.client_data import client_split
    from edgefl.config import load_run_settings
    from edgefl.models import build_model

    settings = load_run_settings([])
    c = settings.client
    info, data, _ = client_split(c.data, c.data.root, 0, settings.server.num_supernodes, c.seed)
    model = build_model(c.model.name, info, c.model.options)
    size = c.train.batch_size

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = np.random.default_rng(i).choice(len(data), size, replace=False)
        return torch.from_numpy(data.x[idx]), torch.from_numpy(data.y[idx])

    return f"main job's CNN ({c.model.name}), batch {size}", model, batch


def client_zero(settings: "RunSettings") -> tuple["ArrayDataset", "nn.Module", "PeakMeasurement"]:
    """Client 0's data, the main job's model as the clients seed it, and its unmanaged peak at
    the client's batch size (what the device classes' budgets are fractions of)."""
    import copy

    from edgefl.client_data import client_split
    from edgefl.models import build_model
    from edgefl.peak import measure_unmanaged_peak
    from edgefl.train import seed_everything

    c = settings.client
    info, data, _ = client_split(c.data, c.data.root, 0, settings.server.num_supernodes, c.seed)
    seed_everything(c.seed, c.train.torch_threads)
    model = build_model(c.model.name, info, c.model.options)
    return data, model, measure_unmanaged_peak(copy.deepcopy(model), data, c.train.batch_size)


# -- JSON lines -----------------------------------------------------------------------------------
def tagged(kind: str, rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` as result rows of ``kind``: each a dict whose ``"kind"`` comes first."""
    return [{"kind": kind, **row} for row in rows]


def write_json_lines(
    path: Path | str | None, env: Mapping[str, Any], rows: Iterable[Mapping[str, Any]]
) -> None:
    """Write ``env`` and then every row to ``path``, one JSON object per line (no-op for None)."""
    if path is None:
        return
    count = 0
    with open(path, "w") as f:
        f.write(json.dumps(env) + "\n")
        for row in rows:
            f.write(json.dumps(row) + "\n")
            count += 1
    print(f"# wrote the environment and {count} rows to {path}")
