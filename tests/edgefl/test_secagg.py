"""SecAgg+ on the Message API, driven over an in-process loopback Grid into a real ClientApp."""

from collections.abc import Iterable

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod
from flwr.clientapp.typing import Mod
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAdam,
    FedAvg,
    FedMedian,
    Krum,
    Strategy,
)
from scipy import stats  # type: ignore[import-untyped]

from edgefl.errors import ConfigError
from edgefl.secagg import (
    QUERY_TYPE,
    SECAGG_ACTION,
    MaskingParams,
    SecAggAbortedError,
    SecAggError,
    SecAggPlus,
    secagg_mod,
    secagg_query,
)
from edgefl.secagg.loopback import DropFn, LoopbackGrid
from edgefl.secagg.masking import apply_masks, encode_update
from edgefl.secagg.protocol import MASKED_RECORD, RECORD, ROUND, STAGE, VECTOR, Stage

SHAPES = {"conv.weight": (4, 3, 3), "fc.weight": (8, 16), "fc.bias": (8,)}
NODE_IDS = [101, 202, 303, 404, 505, 606, 707]
MAX_WEIGHT = 1000
EPS32 = 2.0**-24  # float32 rounding, relative


def _weight(pid: int) -> int:
    return 50 + 150 * pid  # distinct, so weighted and unweighted means differ


def _trained(pid: int, sent: dict[str, np.ndarray], scale: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(pid)
    return {k: (v + scale * rng.normal(size=v.shape)).astype(np.float32) for k, v in sent.items()}


def _app(
    scale: float = 0.05, failing: frozenset[int] = frozenset(), mods: Iterable[Mod] = ()
) -> ClientApp:
    """Train handler: deterministic update per partition; fails on ``failing`` partitions."""
    app = ClientApp()
    app.query(SECAGG_ACTION)(secagg_query)

    @app.train(mods=[secagg_mod, *mods])
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        if pid in failing:
            raise RuntimeError(f"partition {pid} cannot train")
        sent = {k: a.numpy() for k, a in next(iter(msg.content.array_records.values())).items()}
        arrays = ArrayRecord({k: Array(v) for k, v in _trained(pid, sent, scale).items()})
        metrics = MetricRecord(
            {"num-examples": _weight(pid), "train-loss": 0.5, "partition-id": pid}
        )
        return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

    return app


def _arrays() -> ArrayRecord:
    rng = np.random.default_rng(99)
    return ArrayRecord(
        {k: Array(rng.normal(0, 0.1, s).astype(np.float32)) for k, s in SHAPES.items()}
    )


def _expected(pids: Iterable[int], scale: float = 0.05) -> dict[str, np.ndarray]:
    """Exact (float64) weighted mean of the given partitions' trained arrays."""
    sent = {k: a.numpy() for k, a in _arrays().items()}
    weights = {p: _weight(p) for p in pids}
    total = sum(weights.values())
    trained = {p: _trained(p, sent, scale) for p in weights}
    return {
        k: np.sum([w * trained[p][k].astype(np.float64) for p, w in weights.items()], axis=0)
        / total
        for k in SHAPES
    }


def _secagg(inner: Strategy | None = None, **kwargs: int | float) -> SecAggPlus:
    options = {"num_shares": 5, "reconstruction_threshold": 3, "max_weight": MAX_WEIGHT} | kwargs
    return SecAggPlus(inner or FedAvg(min_available_nodes=2), **options)  # type: ignore[arg-type]


def _round(
    strategy: SecAggPlus, n: int, drop: DropFn | None = None, app: ClientApp | None = None
) -> tuple[ArrayRecord | None, MetricRecord | None]:
    grid = LoopbackGrid(app or _app(), NODE_IDS[:n], drop)
    return strategy.train_round(1, _arrays(), ConfigRecord({"lr": 0.1}), grid, 60.0)


def _max_error(arrays: ArrayRecord, expected: dict[str, np.ndarray]) -> float:
    return max(float(np.max(np.abs(arrays[k].numpy() - expected[k]))) for k in SHAPES)


def _bound(strategy: SecAggPlus, pids: list[int]) -> float:
    """The stated quantisation bound plus float32 rounding for |x| <= 1.

    Rounding: once casting x + mean to float32, and n times when the inner FedAvg re-averages
    the n identical survivor replies in float32.
    """
    params = strategy.protocol.params
    return params.error_bound(len(pids), sum(_weight(p) for p in pids)) + (len(pids) + 1) * EPS32


# -- (1) the unmasked aggregate is the weighted mean, within the quantisation bound ------------
@pytest.mark.parametrize(("n", "num_shares", "threshold"), [(5, 5, 3), (7, 3, 2)])
def test_secagg_aggregate_is_weighted_mean_within_bound(
    n: int, num_shares: int, threshold: int
) -> None:
    strategy = _secagg(num_shares=num_shares, reconstruction_threshold=threshold)
    arrays, metrics = _round(strategy, n)
    expected = _expected(range(n))
    assert arrays is not None and metrics is not None
    error, bound = _max_error(arrays, expected), _bound(strategy, list(range(n)))
    assert metrics["secagg-error-bound"] == pytest.approx(bound - (n + 1) * EPS32)
    assert error <= bound, f"error {error:.3g} above the stated bound {bound:.3g}"
    sent = {k: a.numpy() for k, a in _arrays().items()}
    plain_mean = {
        k: np.mean([_trained(p, sent, 0.05)[k] for p in range(n)], axis=0) for k in SHAPES
    }
    assert _max_error(arrays, plain_mean) > 10 * bound  # the weights matter, and were applied
    assert metrics["secagg-collect-clients"] == n
    assert "train-loss" not in metrics  # withheld by the client: computed on private data
    assert metrics["partition-id"] == pytest.approx(
        sum(p * _weight(p) for p in range(n)) / sum(_weight(p) for p in range(n))
    )


def test_secagg_plain_fedavg_gives_the_same_model() -> None:
    strategy = _secagg()
    secure, _ = _round(strategy, 5)
    fedavg = FedAvg(min_available_nodes=2)
    grid = LoopbackGrid(_app(), NODE_IDS[:5])
    messages = fedavg.configure_train(1, _arrays(), ConfigRecord({"lr": 0.1}), grid)
    plain, _ = fedavg.aggregate_train(1, grid.send_and_receive(messages))
    assert secure is not None and plain is not None
    expected = {k: plain[k].numpy().astype(np.float64) for k in SHAPES}
    assert (
        _max_error(secure, expected) <= _bound(strategy, list(range(5))) + 5 * EPS32
    )  # + FedAvg's own rounding


def test_secagg_fedadam_runs_unchanged_on_the_secure_mean() -> None:
    def adam() -> FedAdam:
        return FedAdam(min_available_nodes=2, eta=0.01, eta_l=0.05, tau=0.1)

    secure, _ = _round(_secagg(adam()), 5)
    plain_strategy = adam()
    grid = LoopbackGrid(_app(), NODE_IDS[:5])
    messages = plain_strategy.configure_train(1, _arrays(), ConfigRecord({"lr": 0.1}), grid)
    plain, _ = plain_strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert secure is not None and plain is not None
    # Adam's first step, eta * m / (sqrt(v) + tau) with m = (1 - beta_1) * delta, changes by at
    # most eta * (1 - beta_1) / tau = 0.01 times a change of delta.
    expected = {k: plain[k].numpy().astype(np.float64) for k in SHAPES}
    assert _max_error(secure, expected) <= 0.01 * _bound(_secagg(), list(range(5))) + 1e-7
    assert _max_error(secure, {k: a.numpy() for k, a in _arrays().items()}) > 1e-4  # it moved


def test_secagg_composes_with_client_side_dp_clipping() -> None:
    def dp() -> DifferentialPrivacyClientSideFixedClipping:
        return DifferentialPrivacyClientSideFixedClipping(
            FedAvg(min_available_nodes=2),
            noise_multiplier=0.0,
            clipping_norm=0.2,
            num_sampled_clients=5,
        )

    unit = DifferentialPrivacyClientSideFixedClipping(FedAvg(weighted_by_key="w"), 0.0, 1.0, 5)
    assert _secagg(unit).protocol.weight_key == "w"  # found through the DP wrapper
    app = _app(scale=0.5, mods=[fixedclipping_mod])  # updates of norm ~5: all clipped to 0.2
    secure, _ = _round(_secagg(dp()), 5, app=app)
    plain_strategy, grid = dp(), LoopbackGrid(app, NODE_IDS[:5])
    messages = plain_strategy.configure_train(1, _arrays(), ConfigRecord({"lr": 0.1}), grid)
    plain, _ = plain_strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert secure is not None and plain is not None
    expected = {k: plain[k].numpy().astype(np.float64) for k in SHAPES}
    assert _max_error(secure, expected) <= _bound(_secagg(), list(range(5))) + 5 * EPS32


# -- (2) one client's masked vector, as the server holds it, is uniform over the modulus -------
def _uniformity_p_values(vector: np.ndarray, modulus: int) -> tuple[float, float, float]:
    """Chi-square of the top and bottom bytes (256 bins each), and KS of vector / modulus."""
    bits = modulus.bit_length() - 1
    top = np.bincount((vector >> np.uint64(bits - 8)).astype(np.int64), minlength=256)
    low = np.bincount((vector & np.uint64(255)).astype(np.int64), minlength=256)
    ks = stats.kstest(vector.astype(np.float64) / modulus, "uniform").pvalue
    return stats.chisquare(top).pvalue, stats.chisquare(low).pvalue, ks


def test_masked_vector_is_uniform_for_fixed_seeds() -> None:
    params = MaskingParams(1.0, 2**22, 2**32, MAX_WEIGHT)
    np.random.seed(0)  # Flower's stochastic rounding draws from NumPy's global generator
    encoded, _ = encode_update(np.zeros(2**16), 700, params)  # worst case: one repeated value
    seeds = [bytes([i]) * 32 for i in range(3)]
    masked = apply_masks(encoded, seeds[0], [(seeds[1], 1), (seeds[2], -1)], params.modulus_range)
    # Deterministic (fixed seeds); a uniform vector passes at alpha = 0.001 with probability 0.999.
    assert min(_uniformity_p_values(masked, params.modulus_range)) > 1e-3
    assert max(_uniformity_p_values(encoded, params.modulus_range)) < 1e-12  # the test has power


class _SpyGrid(LoopbackGrid):
    """Keeps every collect reply as the server receives it."""

    def __init__(self, app: ClientApp, node_ids: list[int]) -> None:
        super().__init__(app, node_ids)
        self.collected: list[Message] = []

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        replies = list(super().send_and_receive(messages, timeout=timeout))
        self.collected += [r for r in replies if MASKED_RECORD in r.content.array_records]
        return replies


def test_server_view_of_one_client_is_uniform() -> None:
    grid = _SpyGrid(_app(scale=0.0), NODE_IDS[:5])  # no update at all: the most regular input
    arrays = ArrayRecord({"w": Array(np.zeros(2**16, np.float32))})
    _secagg(modulus_range=2**32).train_round(1, arrays, ConfigRecord(), grid, 60.0)
    assert len(grid.collected) == 5
    vector = grid.collected[0].content.array_records[MASKED_RECORD][VECTOR].numpy()
    assert vector.dtype == np.uint32 and vector.size == 2**16 + 1
    # Keys come from the OS generator, so this is random: alpha = 1e-6 per statistic.
    assert min(_uniformity_p_values(vector.astype(np.uint64), 2**32)) > 1e-6


# -- (3) dropouts: up to the threshold the round completes, below it aborts cleanly -----------
SURVIVABLE: dict[str, tuple[dict[int, str], frozenset[int], list[int]]] = {
    # name: (node index -> stage it goes silent at, partitions whose training fails, summed)
    "one at setup": ({1: Stage.SETUP}, frozenset(), [0, 2, 3, 4]),
    "after share-keys, before the vector": (
        {1: Stage.COLLECT, 3: Stage.COLLECT},
        frozenset(),
        [0, 2, 4],
    ),
    "after the vector, at unmask": (
        {0: Stage.UNMASK, 4: Stage.UNMASK},
        frozenset(),
        [0, 1, 2, 3, 4],
    ),
    "training fails, one at unmask": ({2: Stage.UNMASK}, frozenset({1}), [0, 2, 3, 4]),
}


@pytest.mark.parametrize("case", list(SURVIVABLE))
def test_secagg_round_survives_dropouts_up_to_threshold(case: str) -> None:
    drops, failing, summed = SURVIVABLE[case]
    silent = {(NODE_IDS[i], str(stage)) for i, stage in drops.items()}
    strategy = _secagg()
    arrays, metrics = _round(strategy, 5, lambda n, s: (n, s) in silent, _app(failing=failing))
    assert arrays is not None and metrics is not None
    assert metrics["secagg-collect-clients"] == len(summed)
    assert _max_error(arrays, _expected(summed)) <= _bound(strategy, summed)


@pytest.mark.parametrize(
    ("drops", "stage"),
    [
        ({1: Stage.COLLECT, 2: Stage.COLLECT, 3: Stage.COLLECT}, "collect"),
        ({0: Stage.UNMASK, 1: Stage.UNMASK, 2: Stage.UNMASK}, "unmask"),
        ({0: Stage.SETUP, 1: Stage.SETUP, 2: Stage.SETUP}, "setup"),
    ],
)
def test_secagg_round_aborts_below_threshold_leaving_model_unchanged(
    drops: dict[int, Stage], stage: str
) -> None:
    inner = FedAdam(min_available_nodes=2, eta=0.01, eta_l=0.05)
    strategy, arrays = _secagg(inner), _arrays()
    before = {k: a.numpy().copy() for k, a in arrays.items()}
    silent = {(NODE_IDS[i], str(s)) for i, s in drops.items()}
    grid = LoopbackGrid(_app(), NODE_IDS[:5], lambda n, s: (n, s) in silent)
    with pytest.raises(SecAggAbortedError, match=f"aborted at {stage}.*model is unchanged") as info:
        strategy.train_round(1, arrays, ConfigRecord(), grid, 60.0)
    assert info.value.stage == stage
    assert inner.m_t is None and inner.v_t is None  # the inner strategy never aggregated
    assert all(np.array_equal(arrays[k].numpy(), v) for k, v in before.items())


# -- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "inner",
    [FedMedian(), Krum(), DifferentialPrivacyServerSideFixedClipping(FedAvg(), 1.0, 1.0, 5)],
    ids=["FedMedian", "Krum", "DP server-side clipping"],
)
def test_secagg_refuses_strategies_that_need_each_update(inner: Strategy) -> None:
    with pytest.raises(ConfigError, match=f"cannot wrap {type(inner).__name__}"):
        _secagg(inner)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"num_shares": 4}, "num_shares=4"),
        ({"reconstruction_threshold": 2}, "threshold=2"),
        ({"modulus_range": 2**20}, "modulus_range"),
    ],
)
def test_secagg_rejects_bad_parameters(options: dict[str, int], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _secagg(None, **options)


def test_secagg_refuses_plain_train_exchanges() -> None:
    with pytest.raises(SecAggError, match="train_round"):
        _secagg().configure_train(1, _arrays(), ConfigRecord(), LoopbackGrid(_app(), NODE_IDS[:5]))


def test_client_refuses_messages_outside_the_protocol() -> None:
    grid = LoopbackGrid(_app(), NODE_IDS[:1])

    def send(stage: str, **values: object) -> Message:
        record = ConfigRecord({STAGE: stage, ROUND: 1, **values})  # type: ignore[dict-item]
        message = Message(
            RecordDict({RECORD: record}), dst_node_id=NODE_IDS[0], message_type=QUERY_TYPE
        )
        (reply,) = grid.send_and_receive([message])
        return reply

    unmask = send(Stage.UNMASK, active=[NODE_IDS[0]], dropped=[])
    assert unmask.has_error() and "without a setup" in str(unmask.error.reason)
    setup = {
        "threshold": 1,
        "weight-key": "num-examples",
        **MaskingParams(1.0, 2**22, 2**32, 9).to_config(),
    }
    assert "threshold=1" in str(send(Stage.SETUP, **setup).error.reason)
    assert not send(Stage.SETUP, **(setup | {"threshold": 2})).has_error()
    # A neighbourhood of 4 for threshold 2 would let a lying server rebuild both secrets.
    keys = [bytes([i]) for i in range(4)]
    reply = send(Stage.SHARE_KEYS, neighbours=[NODE_IDS[0], 1, 2, 3], pk1s=keys, pk2s=keys)
    assert reply.has_error() and "need t<=k<2t" in str(reply.error.reason)


def test_client_over_max_weight_drops_out_with_the_fix(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(SecAggAbortedError):
        _round(_secagg(max_weight=100), 5)  # weights 50..650: four of five exceed 100
    assert "raise SecAggPlus(max_weight=...) to at least 650" in caplog.text
