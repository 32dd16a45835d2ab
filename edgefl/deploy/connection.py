"""Write the flwr CLI's connection to the SuperLink into an isolated FLWR_HOME's config.toml.

Flower 1.42 keeps connections in ``$FLWR_HOME/config.toml`` (``[superlink.<name>]`` tables
with ``address`` and ``root-certificates`` or ``insecure``), not in the app's pyproject.toml.
edgefl's commands use their own FLWR_HOME, so the user's ``~/.flwr`` is never touched.
"""

import tomllib
from pathlib import Path
from typing import Any

import tomli_w

from edgefl.deploy.commands import CONNECTION
from edgefl.deploy.errors import DeployError

CONFIG_FILE = "config.toml"


def write_connection(flwr_home: Path, address: str, ca_cert: Path | None) -> Path:
    """Make ``[superlink.edgefl]`` point at ``address`` (TLS with ``ca_cert``, else insecure).

    Other connections in the file are kept; the edgefl one becomes the default.
    """
    path = Path(flwr_home) / CONFIG_FILE
    config = _read(path)
    superlink = config.setdefault("superlink", {})
    if not isinstance(superlink, dict):
        raise DeployError(f"{path}: [superlink] is not a table; delete {path} to start afresh")
    entry: dict[str, Any] = {"address": address}
    if ca_cert is None:
        entry["insecure"] = True
    else:
        entry["root-certificates"] = str(Path(ca_cert).resolve())
    superlink[CONNECTION] = entry
    superlink["default"] = CONNECTION
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(config))
    return path


def _read(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise DeployError(f"{path} is not valid TOML ({exc}); delete it to start afresh") from None
