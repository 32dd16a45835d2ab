"""A simulation on an existing Ray cluster: a head and a worker node started here as processes.

Both nodes run on this machine (Ray registers them under its own IP even when asked for
127.0.0.1, so traffic stays local), each with one CPU, so Flower's pool of two 1-CPU client
actors must place one actor on each node.
"""

import dataclasses
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray._private import state as ray_state
from ray.core.generated import common_pb2, gcs_pb2

from edgefl.errors import EdgeFLError
from edgefl.settings import RunSettings
from edgefl.sim import simulate

RAY = str(Path(sys.executable).with_name("ray"))  # the venv's CLI: same Ray as the driver
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports nothing listens on now (held together so none repeats)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _start_node(args: list[str], temp_dir: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """``ray start --block`` in its own process group, on free ports, dashboard off.

    Every port Ray would otherwise take at a fixed default (client server 10001, agent 52365,
    ...) is a free one, so the test shares nothing with other Ray instances on the machine.
    """
    agent, agent_grpc, metrics, runtime_env = _free_ports(4)
    command = [
        RAY, "start", "--block", "--num-cpus", "1", "--disable-usage-stats",
        "--temp-dir", str(temp_dir),
        "--dashboard-agent-listen-port", str(agent),
        "--dashboard-agent-grpc-port", str(agent_grpc),
        "--metrics-export-port", str(metrics),
        "--runtime-env-agent-port", str(runtime_env),
        *args,
    ]  # fmt: skip
    with log_path.open("wb") as log:  # the child keeps its own copy
        # own session: killpg reaches raylet, GCS, agents and actor workers, and nothing else
        return subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def _stop_node(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the node's process group (``ray start --block`` then stops its children)."""
    group = process.pid  # the session leader's pid is the group id
    for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            process.poll()  # reap the leader, or the group never empties
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def _wait_for_cpu_nodes(address: str, count: int, nodes: list[subprocess.Popen[bytes]]) -> None:
    """Wait until ``count`` alive nodes with CPUs have joined the cluster at ``address``.

    The head's port is polled first: ``ray.init`` on a dead address retries for minutes.
    """
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        exited = [p.args for p in nodes if p.poll() is not None]
        assert not exited, f"ray start exited early (see head.log, worker.log): {exited}"
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            break
        except OSError:
            assert time.monotonic() < deadline, f"no Ray head at {address} in time"
            time.sleep(0.5)
    ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    try:
        while len(_alive_cpu_nodes()) < count:
            exited = [p.args for p in nodes if p.poll() is not None]
            assert not exited, f"ray start exited early: {exited}"
            assert time.monotonic() < deadline, f"{count} Ray nodes did not join in time"
            time.sleep(0.5)
    finally:
        ray.shutdown()  # Flower initialises Ray itself: init_args are ignored if already up


def _alive_cpu_nodes() -> set[str]:
    nodes = ray.nodes()  # type: ignore[no-untyped-call]
    return {n["NodeID"] for n in nodes if n["Alive"] and n["Resources"].get("CPU", 0) > 0}


@pytest.fixture
def ray_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Address of a running head + worker cluster; both stopped afterwards, also on failure.

    Ray's temp dirs go under a short /tmp folder: Ray refuses socket paths over 107 bytes,
    which pytest's ``tmp_path`` plus Ray's session folder exceed. Logs stay in ``tmp_path``.
    """
    monkeypatch.setenv("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # no GPUs; silences a warning
    head_port, client_port, dashboard_port = _free_ports(3)
    address = f"127.0.0.1:{head_port}"
    temp_root = Path(tempfile.mkdtemp(prefix="edgefl-ray-"))
    nodes: list[subprocess.Popen[bytes]] = []
    try:
        head_args = ["--head", "--port", str(head_port), "--include-dashboard", "false"]
        head_args += ["--ray-client-server-port", str(client_port)]
        head_args += ["--dashboard-port", str(dashboard_port)]
        nodes.append(_start_node(head_args, temp_root / "head", tmp_path / "head.log"))
        _wait_for_cpu_nodes(address, 1, nodes)
        worker_args = ["--address", address]
        nodes.append(_start_node(worker_args, temp_root / "worker", tmp_path / "worker.log"))
        _wait_for_cpu_nodes(address, 2, nodes)
        yield address
    finally:
        for node in reversed(nodes):
            _stop_node(node)
        shutil.rmtree(temp_root, ignore_errors=True)


def _nodes_that_ran(task_name: str) -> set[str]:
    """Ids of the nodes where a task named ``task_name`` finished, from the GCS's task events.

    ``ray.util.state.list_tasks`` would need the dashboard; the GCS holds the same events.
    """
    finished = common_pb2.TaskStatus.Value("FINISHED")  # type: ignore[attr-defined]
    names: dict[tuple[bytes, int], str] = {}
    node_of: dict[tuple[bytes, int], bytes] = {}
    done: set[tuple[bytes, int]] = set()
    # one task's events may come in several records (a worker flushes them every second)
    for raw in ray_state.state._connect_and_get_accessor().get_task_events():
        event = gcs_pb2.TaskEvents.FromString(raw)  # type: ignore[attr-defined]
        key = (event.task_id, event.attempt_number)
        if event.HasField("task_info"):
            names[key] = event.task_info.name
        if event.HasField("state_updates"):
            if event.state_updates.node_id:
                node_of[key] = event.state_updates.node_id
            if finished in event.state_updates.state_ts_ns:
                done.add(key)
    return {node_of[k].hex() for k in done if names.get(k) == task_name and k in node_of}


@pytest.mark.slow
def test_simulation_runs_on_both_nodes_of_an_existing_cluster(
    ray_cluster: str, smoke_settings: RunSettings, tmp_path: Path
) -> None:
    settings = dataclasses.replace(
        smoke_settings,
        server=dataclasses.replace(smoke_settings.server, output_dir=str(tmp_path / "out")),
        simulation=dataclasses.replace(smoke_settings.simulation, ray_address=ray_cluster),
    )
    assert settings.server.num_supernodes == 2 and settings.simulation.client_num_cpus == 1

    outcome = simulate(settings)

    history = outcome["history"]
    assert [r.server_round for r in history.rounds] == [0, 1]
    assert history.rounds[1].clients_trained == 2 and history.rounds[1].clients_failed == 0
    ray.init(address=ray_cluster, logging_level=logging.WARNING, log_to_driver=False)
    try:
        nodes = _alive_cpu_nodes()
        assert len(nodes) == 2  # Flower's ray.shutdown() disconnected; it stopped no node
        deadline = time.monotonic() + 20.0  # task events reach the GCS within seconds
        while (ran_on := _nodes_that_ran("ClientAppActor.run")) != nodes:
            assert time.monotonic() < deadline, f"client work ran on {ran_on}, nodes {nodes}"
            time.sleep(0.5)
    finally:
        ray.shutdown()


@pytest.mark.parametrize(
    "listening",
    [
        pytest.param(False, id="closed-port"),
        pytest.param(True, id="silent-listener", marks=pytest.mark.slow),  # a 5 s timeout
    ],
)
def test_address_without_a_ray_head_fails_naming_it(
    smoke_settings: RunSettings, listening: bool
) -> None:
    """A closed port, or one that accepts but never answers (ray.init would retry for minutes)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        if listening:
            server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        settings = dataclasses.replace(
            smoke_settings,
            simulation=dataclasses.replace(smoke_settings.simulation, ray_address=address),
        )
        with pytest.raises(EdgeFLError, match=rf"ray_address='{re.escape(address)}'.*ray start"):
            simulate(settings)
    assert not ray.is_initialized()
