"""Shared fixtures: Flower's task identity for direct handler calls, and small run settings."""

import dataclasses
from collections.abc import Callable

import pytest
from flwr.supercore.task_identity import TaskIdentity

from edgefl.budget import Budget
from edgefl.config import load_run_settings
from edgefl.settings import DeviceClass, RunSettings


@pytest.fixture(autouse=True)
def task_identity() -> None:
    """Messages built outside a running app need a task identity (internal Flower API)."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


@pytest.fixture(scope="session")
def smoke_settings(tmp_path_factory: pytest.TempPathFactory) -> RunSettings:
    """experiment=smoke with outputs and plan cache in a temporary folder."""
    out = tmp_path_factory.mktemp("smoke")
    settings = load_run_settings(["experiment=smoke", f"output_dir={out}"])
    fleet = dataclasses.replace(settings.client.fleet, plan_cache_root=str(out / "plan-cache"))
    return dataclasses.replace(settings, client=dataclasses.replace(settings.client, fleet=fleet))


def _with_budget(settings: RunSettings, budget_bytes: int, **model_options: int) -> RunSettings:
    """``settings`` with one device class of ``budget_bytes`` (1 if 0) and new model options."""
    fleet = dataclasses.replace(
        settings.client.fleet, classes=(DeviceClass("tight", Budget(budget_bytes or 1), 1.0),)
    )
    model = dataclasses.replace(
        settings.client.model, options={**settings.client.model.options, **model_options}
    )
    client = dataclasses.replace(settings.client, fleet=fleet, model=model)
    return dataclasses.replace(settings, client=client)


@pytest.fixture
def with_budget() -> Callable[..., RunSettings]:
    """``with_budget(settings, budget_bytes, **model_options)``: one device class of that budget."""
    return _with_budget
