"""A real deployment on loopback: SuperLink and two SuperNodes with TLS and node authentication.

Every process is started through the ``edgefl`` command line (``python -m edgefl.deploy``) in
its own process group, which the ``processes`` fixture stops (SIGTERM, then SIGKILL), also when
the test fails.
"""

import csv
import dataclasses
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from edgefl.client_data import client_split
from edgefl.config import load_run_settings
from edgefl.deploy.processes import FlowerProcess
from edgefl.models import build_model
from edgefl.peak import PeakMeasurement, measure_unmanaged_peak

pytestmark = pytest.mark.slow
# A CNN whose smallest workable budget is well below its unmanaged peak (~57 % here).
MODEL = {"width": 8, "hidden": 32, "convs_per_stage": 3}
RUN_OVERRIDES = " ".join(
    [
        *(f"model.options.{k}={v}" for k, v in MODEL.items()),
        "server.save_plots=false",
        "strategy.fraction_evaluate=0",  # train only: every message costs a process start
    ]
)
EDGEFL = [sys.executable, "-m", "edgefl.deploy"]
READY = "SuperLink ready"  # edgefl server's line once the SuperLink listens
FLOWER_REFUSAL = "Failed to activate SuperNode"  # Flower's report of an unknown key [code: 2004]
EDGEFL_REFUSAL = "refused this node"  # edgefl client's line naming the fix
NODE_LINE = "client 0 (deployed) round 1: budget"  # a node's own line per round
FLOWER_INFO = "Receiving: train message"  # one of Flower's INFO lines per message on a node
WATCH = (READY, FLOWER_REFUSAL, EDGEFL_REFUSAL, NODE_LINE, FLOWER_INFO)


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port: int = sock.getsockname()[1]
        return port


def _edgefl(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*EDGEFL, *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )


def _wait_for(proc: FlowerProcess, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while proc.seen(text) is None:
        assert proc.proc.poll() is None, f"exited early:\n{proc.tail()}"
        assert time.monotonic() < deadline, f"no {text!r} after {timeout_s} s:\n{proc.tail()}"
        time.sleep(0.2)


@pytest.fixture
def processes() -> Iterator[list[FlowerProcess]]:
    """Processes the test starts; each one's process group is stopped at teardown."""
    started: list[FlowerProcess] = []
    yield started
    for proc in reversed(started):
        proc.stop(timeout_s=10)


@pytest.fixture(scope="module")
def peak() -> PeakMeasurement:
    """Unmanaged training peak of MODEL on client 0's data, measured as a client trains."""
    settings = load_run_settings(["experiment=smoke", "debug=fast"])
    c = dataclasses.replace(
        settings.client, model=dataclasses.replace(settings.client.model, options=MODEL)
    )
    info, train, _ = client_split(c.data, None, 0, 2, c.seed)
    torch.manual_seed(c.seed)
    torch.set_num_threads(c.train.torch_threads)
    model = build_model(c.model.name, info, c.model.options)
    return measure_unmanaged_peak(model, train, c.train.batch_size)


def test_tls_deployment_trains_under_budgets_and_refuses_unregistered_node(
    tmp_path: Path, processes: list[FlowerProcess], peak: PeakMeasurement
) -> None:
    deploy = tmp_path / "deploy"
    d = ["--dir", str(deploy)]
    assert _edgefl("certs", *d, "--nodes", "2").returncode == 0
    assert _edgefl("keys", *d, "stranger").returncode == 0
    env = dict(os.environ)  # each command gives Flower its FLWR_HOME under --dir

    def start(*args: str) -> FlowerProcess:
        proc = FlowerProcess([*EDGEFL, *args], env, watch=WATCH, new_session=True)
        processes.append(proc)
        return proc

    superlink = f"127.0.0.1:{_free_port()}"
    link = ["--superlink", superlink]
    server = start("server", *d, "--port", superlink.rpartition(":")[2])
    _wait_for(server, READY, timeout_s=90)

    nodes = deploy / "nodes"
    registered = _edgefl(
        "register", *d, *link, str(nodes / "node-1.pub"), str(nodes / "node-2.pub")
    )
    assert registered.returncode == 0, registered.stderr
    assert "registered node-1" in registered.stdout and "registered node-2" in registered.stdout

    budget = int(0.75 * peak.unmanaged_peak_bytes)
    assert peak.min_budget_bytes < budget < peak.unmanaged_peak_bytes
    spec = importlib.util.find_spec("mnist")  # the installed dataset, passed as --data
    assert spec is not None and spec.submodule_search_locations
    mnist_dir = Path(spec.submodule_search_locations[0]) / "data"

    def client(key: str, partition_id: int, *extra: str) -> FlowerProcess:
        return start(
            "client", *d, *link,
            "--key", str(nodes / key),
            "--budget", str(budget),
            "--plan-cache", str(tmp_path / f"plans-{key}"),
            "--partition-id", str(partition_id),
            "--num-partitions", "2",
            "--local-port", str(_free_port()),
            *extra,
        )  # fmt: skip

    node_1 = client("node-1", 0, "--data", str(mnist_dir))
    client("node-2", 1, "--device-class", "small")
    stranger = client("stranger", 0)

    out = tmp_path / "results"
    run = _edgefl(
        "run", *d, *link,
        "-c", "experiment=smoke",
        "-c", "debug=fast",
        "-c", f"overrides={RUN_OVERRIDES}",
        "--rounds", "2",
        "--output-dir", str(out),
        timeout_s=480,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]
    assert "completed" in run.stderr

    rounds = json.loads((out / "rounds.json").read_text())["rounds"]
    assert "unmanaged round time is not measured" in run.stdout  # devices train elsewhere
    assert [r["server_round"] for r in rounds] == [0, 1, 2]
    for r in rounds[1:]:
        assert r["clients_trained"] == 2 and r["clients_failed"] == 0
        assert r["bytes_swapped"] > 0  # the budget forced vtensor to swap
        assert 0 < r["max_peak_fraction"] <= 1.0
    with (out / "clients.csv").open() as f:
        rows = [row for row in csv.DictReader(f) if row["phase"] == "train"]
    assert len(rows) == 4
    classes = {int(float(row["partition-id"])): row["device-class"] for row in rows}
    assert classes == {0: "deployed", 1: "small"}  # by the names the nodes' configs give
    table = (out / "summary.txt").read_text().split("without vtensor\n")[1].splitlines()
    assert [line.split()[:2] for line in table[1:3]] == [["deployed", "1"], ["small", "1"]]
    for row in rows:
        assert float(row["budget-bytes"]) == budget  # the node config reached the ClientApp
        assert float(row["peak-device-bytes"]) <= budget
        assert float(row["bytes-swapped-out"]) > 0

    line = node_1.seen(NODE_LINE)  # budget, peak, swapped bytes and plan source
    assert line is not None and "swapped" in line and "plan " in line, node_1.tail()
    assert node_1.seen(FLOWER_INFO) is None, node_1.tail()  # Flower at WARNING on the node
    assert stranger.wait(timeout_s=120) == 2
    refusal = stranger.seen(EDGEFL_REFUSAL)
    assert refusal is not None and "edgefl register" in refusal and "stranger.pub" in refusal
    assert stranger.seen(FLOWER_REFUSAL) is None, stranger.tail()  # edgefl's line says it
