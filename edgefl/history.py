"""What happened in a run, round by round and client by client, built from observed exchanges."""

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from flwr.app import MessageType

from edgefl.recording_grid import Exchange
from edgefl.records import (
    BUDGET_BYTES,
    BYTES_SWAPPED_IN,
    BYTES_SWAPPED_OUT,
    DEVICE_CLASS,
    EVAL_ACC,
    NODE,
    NUM_EXAMPLES,
    PEAK_DEVICE_BYTES,
    STALL_S,
    TRAIN_LOSS,
    device_class_name,
)
from edgefl.train import EvalOutcome


@dataclass(frozen=True)
class ClientRound:
    """One client's reply in one round's train or evaluate phase."""

    server_round: int
    phase: str  # "train" or "evaluate"
    node_id: int
    metrics: dict[str, float]  # empty for an error reply
    error: str | None = None
    device_class: str = ""  # the class the node named (its NODE record); "" if none

    @property
    def deployed(self) -> bool:
        """A deployed node's reply (its class from its node config), not a fleet client's."""
        return self.metrics.get(DEVICE_CLASS, 0) < 0


@dataclass(frozen=True)
class RoundRecord:
    """One round: central evaluation and a summary of the clients' train replies."""

    server_round: int
    central_loss: float | None
    central_acc: float | None
    clients_trained: int
    clients_failed: int
    train_loss: float | None  # weighted by num-examples
    max_peak_fraction: float | None  # max over clients of peak-device-bytes / budget-bytes
    bytes_swapped: int  # out + in, summed over clients
    stall_s: float  # summed over clients
    local_acc: float | None  # clients' local evaluation, weighted
    wall_s: float
    epsilon: float | None = None  # DP budget spent after this round (at privacy.delta)


@dataclass
class RunHistory:
    """Accumulates ClientRound rows (from exchanges) and RoundRecords (one per closed round)."""

    clients: list[ClientRound] = field(default_factory=list)
    rounds: list[RoundRecord] = field(default_factory=list)
    _round_started: float = field(default_factory=time.perf_counter)

    def on_exchange(self, exchange: Exchange) -> None:
        """Record every reply of a train or evaluate exchange (a RecordingGrid observer).

        Other exchanges (secure aggregation's key stages) are protocol, not client rounds.
        """
        if exchange.message_type not in (MessageType.TRAIN, MessageType.EVALUATE):
            return
        phase = "train" if exchange.message_type == MessageType.TRAIN else "evaluate"
        for reply in exchange.replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                self.clients.append(
                    ClientRound(exchange.server_round, phase, node, {}, str(reply.error.reason))
                )
                continue
            metrics: dict[str, float] = {}
            for record in reply.content.metric_records.values():
                metrics.update(
                    {k: float(v) for k, v in record.items() if isinstance(v, int | float)}
                )
            name = device_class_name(reply.content.config_records.get(NODE))
            row = ClientRound(exchange.server_round, phase, node, metrics, device_class=name)
            self.clients.append(row)

    def close_round(
        self, server_round: int, central: EvalOutcome | None, epsilon: float | None = None
    ) -> RoundRecord:
        """Summarise the round's client rows with its central evaluation; start the next round."""
        train = [c for c in self.clients if c.server_round == server_round and c.phase == "train"]
        ok = [c for c in train if c.error is None]
        evals = [
            c
            for c in self.clients
            if c.server_round == server_round and c.phase == "evaluate" and c.error is None
        ]
        fractions = [
            c.metrics[PEAK_DEVICE_BYTES] / c.metrics[BUDGET_BYTES]
            for c in ok
            if c.metrics.get(BUDGET_BYTES) and c.metrics.get(PEAK_DEVICE_BYTES)
        ]
        now = time.perf_counter()
        record = RoundRecord(
            server_round=server_round,
            central_loss=None if central is None else central.loss,
            central_acc=None if central is None else central.accuracy,
            clients_trained=len(ok),
            clients_failed=len(train) - len(ok),
            train_loss=_weighted(ok, TRAIN_LOSS),
            max_peak_fraction=max(fractions) if fractions else None,
            bytes_swapped=int(
                sum(
                    c.metrics.get(BYTES_SWAPPED_OUT, 0) + c.metrics.get(BYTES_SWAPPED_IN, 0)
                    for c in ok
                )
            ),
            stall_s=sum(c.metrics.get(STALL_S, 0.0) for c in ok),
            local_acc=_weighted(evals, EVAL_ACC),
            wall_s=now - self._round_started,
            epsilon=epsilon,
        )
        self._round_started = now
        self.rounds.append(record)
        return record

    def restart_clock(self) -> None:
        """Time the next round from now (a resumed run's first round)."""
        self._round_started = time.perf_counter()

    def errors(self) -> list[ClientRound]:
        """Every error reply, in order."""
        return [c for c in self.clients if c.error is not None]


def class_of(row: ClientRound, fleet: Sequence[str]) -> str:
    """The device class of a reply by name: the one its node sent, else its fleet index's."""
    if row.device_class:
        return row.device_class
    index = int(row.metrics.get(DEVICE_CLASS, -1))
    return fleet[index] if 0 <= index < len(fleet) else "deployed"


def class_names(rows: Sequence[ClientRound], fleet: Sequence[str]) -> list[str]:
    """The device classes a run's results show, in order: the fleet's, then deployed ones'.

    A run whose replies all came from deployed nodes shows only the classes those named: the
    fleet of its settings had no clients (its classes would read "none trained").
    """
    deployed = list(dict.fromkeys(class_of(c, fleet) for c in rows if c.deployed))
    if rows and all(c.deployed for c in rows):
        return deployed
    return [*fleet, *(name for name in deployed if name not in fleet)]


def _weighted(rows: list[ClientRound], key: str) -> float | None:
    pairs = [(c.metrics[key], c.metrics.get(NUM_EXAMPLES, 1.0)) for c in rows if key in c.metrics]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else None
