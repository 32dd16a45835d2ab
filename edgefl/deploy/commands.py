"""Build the command lines and environment of Flower's SuperLink, SuperNode and flwr tools."""

import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from edgefl.deploy.errors import DeployError
from edgefl.deploy.pki import TlsFiles

# Machines in the field are often offline: no telemetry, no update check, and no per-run
# `uv sync` of the app's dependencies (torch!) into a fresh environment; the app's
# dependencies are installed once with edgefl itself (flower-1.42 notes, section 3.5).
OFFLINE_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "TQDM_DISABLE": "1",
}
# A SuperExec (one beside the SuperLink, one per SuperNode) asks every interval whether a
# ServerApp or ClientApp process is to be started: once per message on a SuperNode. Flower's
# default is 1 s; a quarter of it costs a loopback request four times a second.
SUPEREXEC_POLL_ENV = {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.25"}
FLOWER_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_FLOWER_LOG_LEVEL = "WARNING"  # as simulation.flower_log_level; debug=verbose: INFO
CONNECTION = "edgefl"  # the SuperLink connection's name in $FLWR_HOME/config.toml
ConfigValue = str | int | float | bool


def flower_env(
    flwr_home: Path,
    base: Mapping[str, str] | None = None,
    flower_log_level: str = DEFAULT_FLOWER_LOG_LEVEL,
) -> dict[str, str]:
    """Environment for a Flower process: ``flwr_home`` as FLWR_HOME, offline, this venv on PATH.

    Flower starts its helpers (flower-superexec, flwr-serverapp, flwr-clientapp) by name, so
    the folder of this interpreter goes first on PATH even when the venv is not activated.
    ``flower_log_level`` is Flower's console level in them (FLWR_LOG_LEVEL; its HTTP servers'
    access logs follow it), which their helpers inherit.
    """
    env = dict(os.environ if base is None else base)
    env.update(OFFLINE_ENV)
    env.update(SUPEREXEC_POLL_ENV)
    env["FLWR_LOG_LEVEL"] = flower_log_level.upper()
    env["FLWR_HOME"] = str(Path(flwr_home).resolve())
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bin_dir, *(p for p in env.get("PATH", "").split(os.pathsep))])
    return env


def executable(name: str, env: Mapping[str, str]) -> str:
    """Full path of Flower's ``name`` tool on the PATH of ``env``; raise with the fix if absent."""
    path = shutil.which(name, path=env.get("PATH"))
    if path is None:
        raise DeployError(
            f"{name} is not on PATH; install edgefl with its dependencies (pip install -e .) "
            "into the environment that runs edgefl"
        )
    return path


def config_arg(values: Mapping[str, ConfigValue]) -> str:
    """``key=value`` pairs in Flower's --node-config / --run-config syntax (TOML values)."""
    return " ".join(f"{key}={toml_value(key, value)}" for key, value in values.items())


def toml_value(key: str, value: ConfigValue) -> str:
    """``value`` as a TOML literal Flower's key=value parser keeps whole (spaces included)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if "'" not in value:
        return f"'{value}'"  # a literal string: backslashes in paths stay as they are
    if '"' not in value and "\\" not in value:
        return f'"{value}"'
    raise DeployError(
        f"{key}={value!r} holds both quote characters, which Flower's key=value syntax "
        "cannot carry; drop one kind of quote"
    )


def superlink_argv(
    env: Mapping[str, str], host: str, port: int, tls: TlsFiles | None, database: Path | None
) -> list[str]:
    """The SuperLink on ``host:port``; TLS and node authentication unless ``tls`` is None."""
    argv = [executable("flower-superlink", env), "--host", host, "--port", str(port)]
    if tls is None:
        argv.append("--insecure")
    else:
        argv += [
            "--ssl-ca-certfile",
            _absolute(tls.ca_cert),
            "--ssl-certfile",
            _absolute(tls.server_cert),
            "--ssl-keyfile",
            _absolute(tls.server_key),
            "--enable-supernode-auth",  # only registered SuperNode keys may join
        ]
    if database is not None:
        argv += ["--database", _absolute(database)]
    return [*argv, "--disable-runtime-dependency-installation"]


def supernode_argv(
    env: Mapping[str, str],
    superlink: str,
    local_port: int,
    node_config: Mapping[str, ConfigValue],
    ca_cert: Path | None,
    private_key: Path | None,
) -> list[str]:
    """A SuperNode joining ``superlink``: TLS with ``ca_cert``, node auth with ``private_key``.

    Both None means an insecure node. ``local_port`` serves the SuperNode's own ClientApp
    processes (loopback only); each SuperNode on one machine needs its own.
    """
    argv = [executable("flower-supernode", env), "--superlink", superlink]
    argv += ["--port", str(local_port), "--node-config", config_arg(node_config)]
    if ca_cert is None:
        return [*argv, "--insecure"]
    argv += ["--root-certificates", _absolute(ca_cert)]
    if private_key is not None:
        argv += ["--auth-supernode-private-key", _absolute(private_key)]
    return argv


def register_argv(env: Mapping[str, str], public_key: Path, name: str) -> list[str]:
    """``flwr supernode register``: add a SuperNode public key to the SuperLink's allowed nodes."""
    return [
        executable("flwr", env),
        "supernode",
        "register",
        _absolute(public_key),
        CONNECTION,
        "--name",
        name,
        "--format",
        "json",
    ]


def run_argv(
    env: Mapping[str, str], app_dir: Path, run_config: Mapping[str, ConfigValue]
) -> list[str]:
    """``flwr run``: bundle the app in ``app_dir``, submit it, stream its logs to the end."""
    argv = [executable("flwr", env), "run", str(app_dir), CONNECTION, "--stream"]
    return [*argv, "--run-config", config_arg(run_config)] if run_config else argv


def run_status_argv(env: Mapping[str, str], run_id: int) -> list[str]:
    """``flwr ls`` of one run, as JSON (its status tells a completed run from a failed one)."""
    return [
        executable("flwr", env),
        "ls",
        CONNECTION,
        "--run-id",
        str(run_id),
        "--format",
        "json",
    ]


def _absolute(path: Path) -> str:
    """Flower's helpers may run elsewhere than this process: hand them absolute paths."""
    return str(Path(path).expanduser().resolve())
