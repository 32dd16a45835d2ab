"""Per-round overhead of SecAgg+ against plain FedAvg: wall time and bytes per client.

Both modes run the same in-process harness (edgefl.secagg.loopback.LoopbackGrid: every message
is serialised and rebuilt as Flower's transport does, and clients run one after another in
this process). The train handler only perturbs the arrays it receives, so a round's time is the
protocol's own cost: serialisation, and for SecAgg+ the key exchange, secret sharing,
quantisation, masking and unmasking. Real training adds the same time to both modes.

Run from the repository root::

    python -m benchmarks.secagg                 # cnn and mlp-1m, 5 and 10 clients
    python -m benchmarks.secagg --quick         # CI-sized: cnn, 5 clients, 2 rounds
    python -m benchmarks.secagg --out secagg.jsonl
"""

import argparse
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import flwr
import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

from benchmarks.common import add_out, add_quick, describe, environment, tagged, write_json_lines
from edgefl.models.cnn import SmallCNN
from edgefl.secagg import SECAGG_ACTION, SecAggPlus, secagg_mod, secagg_query
from edgefl.secagg.loopback import LoopbackGrid


def cnn_arrays() -> ArrayRecord:
    """edgefl's SmallCNN for 28x28 greyscale, 10 classes (105,866 parameters)."""
    return ArrayRecord(SmallCNN(in_channels=1, num_classes=10, image_size=28).state_dict())


def mlp_arrays() -> ArrayRecord:
    """A 1000-1000 linear layer with bias (1,001,000 parameters)."""
    rng = np.random.default_rng(0)
    weight = rng.normal(0, 0.03, (1000, 1000)).astype(np.float32)
    return ArrayRecord({"fc.weight": Array(weight), "fc.bias": Array(np.zeros(1000, np.float32))})


MODELS: dict[str, Callable[[], ArrayRecord]] = {"cnn": cnn_arrays, "mlp-1m": mlp_arrays}


def client_app() -> ClientApp:
    """A ClientApp whose "training" adds small noise; SecAgg+ registered as in edgefl."""
    app = ClientApp()
    app.query(SECAGG_ACTION)(secagg_query)

    @app.train(mods=[secagg_mod])
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        rng = np.random.default_rng(pid)
        sent = next(iter(msg.content.array_records.values()))
        arrays = ArrayRecord(
            {
                k: Array((a.numpy() + rng.normal(0, 0.01, a.numpy().shape)).astype(np.float32))
                for k, a in sent.items()
            }
        )
        metrics = MetricRecord({"num-examples": 500 + 100 * pid, "partition-id": pid})
        return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

    return app


@dataclass(frozen=True)
class Row:
    """One (model, clients, mode) measurement: medians over the timed rounds."""

    model: str
    parameters: int
    clients: int
    mode: str  # "fedavg" or "secagg+ k=<num_shares> t=<threshold>"
    round_s: float
    bytes_down_per_client: int
    bytes_up_per_client: int
    stage_s: dict[str, float]


def measure(model: str, clients: int, secure: bool, rounds: int) -> Row:
    """Median wall time and per-client bytes of ``rounds`` rounds after one warm-up round."""
    arrays = MODELS[model]()
    num_shares, threshold = min(5, clients), 3
    times, down, up, stages = [], [], [], []
    for server_round in range(rounds + 1):
        grid = LoopbackGrid(client_app(), [1000 + i for i in range(clients)])
        fedavg = FedAvg(min_available_nodes=clients)
        config = ConfigRecord({"lr": 0.05})
        started = time.perf_counter()
        if secure:
            strategy = SecAggPlus(fedavg, num_shares=num_shares, reconstruction_threshold=threshold)
            _, metrics = strategy.train_round(server_round + 1, arrays, config, grid, 600.0)
            stage = {
                k.removeprefix("secagg-").removesuffix("-s"): float(v)
                for k, v in (metrics or {}).items()
                if k.startswith("secagg-") and k.endswith("-s") and isinstance(v, float)
            }
        else:
            messages = fedavg.configure_train(server_round + 1, arrays, config, grid)
            fedavg.aggregate_train(server_round + 1, grid.send_and_receive(messages))
            stage = {}
        if server_round == 0:
            continue  # warm-up: imports, allocator, caches
        times.append(time.perf_counter() - started)
        down.append(statistics.median(grid.bytes_down.values()))
        up.append(statistics.median(grid.bytes_up.values()))
        stages.append(stage)
    mode = f"secagg+ k={num_shares} t={threshold}" if secure else "fedavg"
    stage_s = {k: statistics.median(s[k] for s in stages) for k in stages[0]}
    parameters = sum(a.numpy().size for a in arrays.values())
    return Row(
        model,
        parameters,
        clients,
        mode,
        statistics.median(times),
        int(statistics.median(down)),
        int(statistics.median(up)),
        stage_s,
    )


def table(rows: list[Row]) -> str:
    """Markdown table with the SecAgg+ / FedAvg ratios."""
    plain = {(r.model, r.clients): r for r in rows if r.mode == "fedavg"}
    lines = [
        "| model | params | clients | mode | round s | + s | x fedavg | down KB/client"
        " | up KB/client | stages s (setup/share-keys/collect/unmask/reconstruct) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = plain[(r.model, r.clients)]
        stages = "/".join(f"{v:.2f}" for v in r.stage_s.values()) or "-"
        lines.append(
            f"| {r.model} | {r.parameters:,} | {r.clients} | {r.mode} | {r.round_s:.2f} | "
            f"{r.round_s - base.round_s:+.2f} | {r.round_s / base.round_s:.1f} | "
            f"{r.bytes_down_per_client / 1e3:,.1f} | {r.bytes_up_per_client / 1e3:,.1f} | "
            f"{stages} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Measure every (model, clients) pair in both modes; print a table, optionally JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--clients", nargs="+", type=int, default=[5, 10])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (median)")
    add_quick(parser, "cnn, 5 clients, 2 rounds")
    add_out(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.clients, args.rounds = ["cnn"], [5], 2
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    # Messages built outside a running Flower app need a task identity (internal Flower API).
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    env = environment(flwr=flwr.__version__)
    print(describe(env))
    rows = [
        measure(model, clients, secure, args.rounds)
        for model in args.models
        for clients in args.clients
        for secure in (False, True)
    ]
    print(table(rows))
    write_json_lines(args.out, env, tagged("mode", (asdict(r) for r in rows)))


if __name__ == "__main__":
    main()
