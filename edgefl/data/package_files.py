"""Locate data files shipped inside installed Python packages without importing those packages."""

import importlib.util
from pathlib import Path

from edgefl.errors import DatasetMissingError


def package_file(package: str, relative: str, *, dataset: str, install_hint: str) -> Path:
    """Return the path of ``relative`` inside ``package``; raise with ``install_hint`` if absent.

    The package is located with ``find_spec`` only: several data packages have ``__init__``
    modules that fail to import on current numpy/pandas, and their data is all we need.
    """
    spec = importlib.util.find_spec(package)
    locations = [] if spec is None else list(spec.submodule_search_locations or [])
    for location in locations:
        path = Path(location) / relative
        if path.is_file():
            return path
    raise DatasetMissingError(
        f"dataset {dataset!r} is not installed (no {package}/{relative} on the Python path); "
        f"install it with: {install_hint}"
    )


def directory_file(directory: Path, name: str, *, dataset: str, install_hint: str) -> Path:
    """Return ``directory / name``; raise with ``install_hint`` if it is not a file."""
    path = directory / name
    if not path.is_file():
        raise DatasetMissingError(
            f"dataset {dataset!r} is not installed ({path} is missing); install it with: "
            f"{install_hint}, or point data.root (node config data-dir) at a folder holding {name}"
        )
    return path
