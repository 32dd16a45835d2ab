"""Secure aggregation and central DP together on the real simulation engine.

Three clients train under SecAgg+ with client-side clipping and central noise; the privacy
budget allows two rounds of three, so the run stops cleanly before round 3.
"""

import dataclasses

import pytest
from flwr.app import MessageType

from edgefl.config import load_run_settings
from edgefl.privacy import epsilon_after
from edgefl.recording_grid import Exchange
from edgefl.secagg import QUERY_TYPE
from edgefl.secagg.protocol import MASKED_RECORD
from edgefl.settings import RunSettings
from edgefl.sim import prepare, simulate

pytestmark = pytest.mark.slow


def test_secure_aggregation_with_central_dp_stops_at_the_privacy_budget(
    smoke_settings: RunSettings, tmp_path_factory: pytest.TempPathFactory
) -> None:
    base = load_run_settings(["privacy=central_fixed", "secagg=secagg_plus"])
    privacy = base.client.privacy
    epsilons = [epsilon_after(privacy, rounds, 3) for rounds in (1, 2, 3)]
    privacy = dataclasses.replace(privacy, target_epsilon=(epsilons[1] + epsilons[2]) / 2)
    assert base.server.secagg is not None
    secagg = dataclasses.replace(base.server.secagg, num_shares=3, reconstruction_threshold=2)
    settings = dataclasses.replace(
        smoke_settings,
        client=dataclasses.replace(smoke_settings.client, privacy=privacy),
        server=dataclasses.replace(
            smoke_settings.server,
            num_rounds=3,
            num_supernodes=3,
            secagg=secagg,
            output_dir=str(tmp_path_factory.mktemp("private")),
        ),
    )
    exchanges: list[Exchange] = []
    outcome = simulate(prepare(settings), [exchanges.append])

    history = outcome["history"]
    assert outcome["last_round"] == 2  # round 3 would have passed the target
    assert [r.server_round for r in history.rounds] == [0, 1, 2]
    assert all(r.clients_trained == 3 and r.clients_failed == 0 for r in history.rounds[1:])
    assert [r.epsilon for r in history.rounds[1:]] == pytest.approx(epsilons[:2], rel=1e-6)

    stages = [e for e in exchanges if e.sent[0].metadata.message_type == QUERY_TYPE]
    assert len(stages) == 2 * 3  # setup, share keys, unmask per round
    for exchange in exchanges:
        if exchange.message_type != MessageType.TRAIN:
            continue
        for reply in exchange.replies:  # the server never holds a client's model
            assert set(reply.content.array_records) == {MASKED_RECORD}
        for sent in exchange.sent:
            assert sent.content["config"]["clipping_norm"] == privacy.clipping_norm
