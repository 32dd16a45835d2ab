"""Submit the edgefl app to a SuperLink (``edgefl run``): run config, logs, final status."""

import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import edgefl
from edgefl.deploy.commands import (
    DEFAULT_FLOWER_LOG_LEVEL,
    ConfigValue,
    flower_env,
    run_argv,
    run_status_argv,
)
from edgefl.deploy.connection import write_connection
from edgefl.deploy.errors import DeployError
from edgefl.deploy.processes import (
    UNAVAILABLE,
    FilteredEcho,
    FlowerProcess,
    below_level,
    check_reachable,
    connection_failed,
)

ROUNDS_KEY, OUTPUT_DIR_KEY = "num-server-rounds", "output-dir"  # see edgefl.config
STARTED = "Successfully started run"
_RUN_ID = re.compile(rf"{STARTED} (\d+)")
COMPLETED = "finished:completed"


def default_app_dir() -> Path:
    """The edgefl checkout this package was installed from (where pyproject.toml lies)."""
    return Path(edgefl.__file__).resolve().parent.parent


def app_run_config(app_dir: Path) -> dict[str, Any]:
    """The ``[tool.flwr.app.config]`` defaults of the Flower app in ``app_dir``."""
    path = Path(app_dir) / "pyproject.toml"
    fix = "pass --app with the edgefl checkout (the folder holding its pyproject.toml)"
    try:
        project = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise DeployError(f"{path} does not exist; {fix}") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise DeployError(f"{path} cannot be read ({exc}); {fix}") from None
    app = project.get("tool", {}).get("flwr", {}).get("app")
    if not isinstance(app, dict):
        raise DeployError(f"{path} has no [tool.flwr.app] table, so it is not a Flower app; {fix}")
    config = app.get("config", {})
    return dict(config) if isinstance(config, dict) else {}


def build_run_config(
    defaults: Mapping[str, Any],
    pairs: Sequence[str],
    rounds: int | None = None,
    output_dir: Path | None = None,
) -> dict[str, ConfigValue]:
    """Run-config overrides from ``KEY=VALUE`` pairs, typed like the app's defaults."""
    config: dict[str, ConfigValue] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or key not in defaults:
            raise DeployError(
                f"--run-config {pair!r} is not KEY=VALUE with a key of the app's run config; "
                f"keys: {', '.join(sorted(defaults))}"
            )
        config[key] = _typed(key, text.strip(), defaults[key])
    if rounds is not None:
        if rounds < 1:
            raise DeployError(f"--rounds {rounds} must be at least 1")
        config[ROUNDS_KEY] = rounds
    if output_dir is not None:
        # The ServerApp runs beside the SuperLink, in another working directory.
        config[OUTPUT_DIR_KEY] = str(output_dir.expanduser().resolve())
    return config


def submit(
    app_dir: Path,
    superlink: str,
    ca_cert: Path | None,
    flwr_home: Path,
    run_config: Mapping[str, ConfigValue],
    flower_log_level: str = DEFAULT_FLOWER_LOG_LEVEL,
) -> int:
    """``flwr run`` the app on the SuperLink, stream its logs; 0 if the run completed, else 1."""
    app_run_config(app_dir)  # not a Flower app: say so before Flower builds a bundle
    check_reachable(superlink)
    write_connection(flwr_home, superlink, ca_cert)
    env = flower_env(flwr_home, flower_log_level=flower_log_level)
    argv = run_argv(env, Path(app_dir).resolve(), run_config)
    echo = FilteredEcho(sys.stdout, below_level(flower_log_level))
    proc = FlowerProcess(argv, env, echo, watch=[STARTED, UNAVAILABLE])
    rc = proc.wait()
    echo.release()
    match = _RUN_ID.search(proc.seen(STARTED) or "")
    if match is None and proc.seen(UNAVAILABLE):
        raise connection_failed(superlink)
    if match is None:
        raise DeployError(f"flwr run did not start a run (exit code {rc}): {proc.last_line()}")
    run_id = int(match.group(1))
    status, details = run_status(env, run_id)
    if status != COMPLETED:
        first = (details.strip().splitlines() or ["no details"])[0]
        print(f"edgefl: run {run_id} ended as {status}: {first} (log above)", file=sys.stderr)
        return 1
    print(f"edgefl: run {run_id} completed", file=sys.stderr)
    return 0


def run_status(env: Mapping[str, str], run_id: int) -> tuple[str, str]:
    """(status, details) of run ``run_id`` as the SuperLink reports it."""
    done = subprocess.run(run_status_argv(env, run_id), env=env, capture_output=True, text=True)
    try:
        run = json.loads(done.stdout)["runs"][0]
        return str(run["status"]), str(run.get("status-details", ""))
    except (json.JSONDecodeError, KeyError, IndexError, TypeError):
        return "unknown", (done.stdout + done.stderr).strip()[-200:]


def _typed(key: str, text: str, default: Any) -> ConfigValue:
    if isinstance(default, bool):
        if text.lower() not in ("true", "false"):
            raise DeployError(f"--run-config {key}={text!r} must be true or false")
        return text.lower() == "true"
    for kind in (int, float):
        if isinstance(default, kind):
            try:
                return kind(text)
            except ValueError:
                raise DeployError(
                    f"--run-config {key}={text!r} must be a number like its default {default!r}"
                ) from None
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]  # accept shell-style quoting: overrides="seed=7"
    return text
