"""What the strategy tests share: a task identity for messages built outside a running app."""

import pytest
from flwr.supercore.task_identity import TaskIdentity


@pytest.fixture(autouse=True)
def task_identity() -> None:
    """Messages built outside a running app need a task identity (internal Flower API)."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
