"""Memory-aware pacing on the real simulation engine: the slower client trains less in round 2."""

import dataclasses

import pytest

from edgefl.recording_grid import Exchange
from edgefl.settings import PacingSettings, RunSettings
from edgefl.sim import prepare, simulate

pytestmark = pytest.mark.slow


def test_the_slower_client_is_capped_and_weighted_by_what_it_trained(
    smoke_settings: RunSettings, tmp_path_factory: pytest.TempPathFactory
) -> None:
    server = dataclasses.replace(
        smoke_settings.server,
        num_rounds=2,
        pacing=PacingSettings(deadline_quantile=0.5, min_work_fraction=0.25),
        output_dir=str(tmp_path_factory.mktemp("paced")),
    )
    exchanges: list[Exchange] = []
    history = simulate(
        prepare(dataclasses.replace(smoke_settings, server=server)), [exchanges.append]
    )["history"]

    def trained(server_round: int) -> dict[int, dict[str, float]]:
        return {
            c.node_id: c.metrics
            for c in history.clients
            if c.server_round == server_round and c.phase == "train"
        }

    first, second = trained(1), trained(2)
    assert len(first) == len(second) == 2
    slower = max(first, key=lambda node: first[node]["train-s"] / first[node]["num-examples"])
    faster = next(node for node in first if node != slower)
    assert second[faster]["examples-processed"] == first[faster]["examples-processed"]
    capped = second[slower]["examples-processed"]
    assert first[slower]["examples-processed"] * 0.25 <= capped
    assert capped < first[slower]["examples-processed"]
    assert second[slower]["num-examples"] == capped  # FedAvg weighs what it trained on
    sent = next(e for e in exchanges if e.server_round == 2 and e.message_type == "train")
    caps = {m.metadata.dst_node_id: m.content["config"]["max-examples"] for m in sent.sent}
    assert caps == {faster: 0, slower: capped}
