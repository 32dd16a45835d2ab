"""Tests of vtensor.planner.keys and vtensor.planner.cache, on real files under tmp_path."""

import dataclasses
import hashlib
import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from vtensor.errors import VTensorError
from vtensor.planner.cache import CACHE_SCHEMA_VERSION, PlanCache
from vtensor.planner.keys import (
    PlanKey,
    architecture_fingerprint,
    dtype_of,
    input_signature,
    plan_key,
)
from vtensor.planner.plan import PLAN_SCHEMA_VERSION, Plan, TensorMove

HERE = Path(__file__).resolve().parent
CACHE_LOGGER = "vtensor.planner.cache"


def make_plan(n_moves: int = 20, seed: int = 0) -> Plan:
    """A deterministic plan with ``n_moves`` moves; ``seed`` varies its numbers."""
    moves = tuple(
        TensorMove(vid=i, evict_bytes=4096 * (i % 7 + 1) + seed, evict_step=i, prefetch_step=i + 3)
        for i in range(n_moves)
    )
    return Plan(
        budget_bytes=64 * 2**20,
        chunk_bytes=2**20,
        moves=moves,
        step_names=tuple(f"forward.layer{i}" for i in range(n_moves + 4)),
        tensor_bytes=tuple(8192 * (i % 5 + 1) for i in range(n_moves)),
        predicted_peak_bytes=60_000_123 + seed,
        predicted_stall_s=0.0125,
        planner=f"lgm-test/{seed}",
    )


def make_key(index: int = 0, **changes: object) -> PlanKey:
    """A key without a model; ``index`` varies the architecture field."""
    fields: dict[str, object] = {
        "architecture": f"{index:064x}",
        "input_signature": "(torch.float32[8,3,32,32]@cpu)",
        "dtype": "torch.float32",
        "budget_bytes": 64 * 2**20,
        "chunk_bytes": 2**20,
        "device_kind": "cpu",
        "planner_version": "lgm-test/1",
    }
    fields.update(changes)
    return PlanKey(**fields)  # type: ignore[arg-type]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == logging.WARNING]


def _entry_is_valid(path: Path) -> bool:
    entry = json.loads(path.read_bytes())
    text = entry["plan"]
    Plan.from_json(text)
    return bool(entry["plan_sha256"] == hashlib.sha256(text.encode()).hexdigest())


# -- fingerprint -------------------------------------------------------------------------------


class Named(nn.Module):
    """The layers of ``nn.Sequential(Linear(4, 8), ReLU(), Linear(8, 2))`` as named attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.act(self.fc1(x)))
        return out


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_fingerprint_same_architecture_different_weights_equal() -> None:
    torch.manual_seed(0)
    first = _mlp()
    torch.manual_seed(1)
    second = _mlp()
    weight, other_weight = next(first.parameters()), next(second.parameters())
    assert not torch.equal(weight, other_weight)
    assert architecture_fingerprint(first) == architecture_fingerprint(second)
    with torch.no_grad():
        other_weight.fill_(3.0)
    assert architecture_fingerprint(first) == architecture_fingerprint(second)
    assert len(architecture_fingerprint(first)) == 64


VARIANTS: dict[str, Callable[[], nn.Module]] = {
    "mlp": _mlp,
    "wider": lambda: nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 2)),
    "float64": lambda: _mlp().to(torch.float64),
    "gelu": lambda: nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)),
    "no_bias": lambda: nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU(), nn.Linear(8, 2)),
    "deeper": lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.ReLU()),
    "named": Named,
    "nested": lambda: nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Linear(8, 2)),
    "conv_stride1": lambda: nn.Conv2d(3, 8, 3, stride=1),
    "conv_stride2": lambda: nn.Conv2d(3, 8, 3, stride=2),
    "batchnorm": lambda: nn.BatchNorm1d(8),
    "batchnorm_no_stats": lambda: nn.BatchNorm1d(8, track_running_stats=False),
    "frozen_first": lambda: _frozen(_mlp()),
}


def _frozen(model: nn.Sequential) -> nn.Module:
    for p in model[0].parameters():
        p.requires_grad_(False)
    return model


def test_fingerprint_differs_for_every_architecture_change() -> None:
    prints = {name: architecture_fingerprint(build()) for name, build in VARIANTS.items()}
    assert len(set(prints.values())) == len(prints), prints


def test_fingerprint_sees_weight_tying() -> None:
    untied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    shared_layer = nn.Linear(4, 4)
    shared = nn.Sequential(shared_layer, shared_layer)
    prints = {architecture_fingerprint(m) for m in (untied, tied, shared)}
    assert len(prints) == 3


def test_input_signature_ignores_values_not_shapes_dtypes_devices() -> None:
    x = torch.randn(8, 3)
    y = torch.randint(0, 5, (8,))
    assert input_signature(x, y) == input_signature(torch.zeros(8, 3), torch.ones(8, dtype=y.dtype))
    assert input_signature(x, y) != input_signature(torch.randn(9, 3), y)
    assert input_signature(x, y) != input_signature(x.double(), y)
    assert input_signature(x, y) != input_signature(y, x)
    assert input_signature(x) != input_signature(x.requires_grad_())
    assert input_signature(x) != input_signature(torch.randn(8, 3, device="meta"))
    assert "@meta" in input_signature(torch.randn(8, 3, device="meta"))


def test_input_signature_nested_containers() -> None:
    x = torch.randn(2, 3)
    nested = input_signature({"b": [x, x], "a": (x, None)}, 4)
    assert nested == input_signature({"a": (torch.ones(2, 3), None), "b": [x, x]}, 4)
    assert nested != input_signature({"a": (x, None), "b": (x, x)}, 4)
    assert nested != input_signature({"a": (x, None), "b": [x, x]}, 5)


def test_plan_key_digest_changes_with_every_field() -> None:
    base = make_key()
    changed = [
        make_key(1),
        make_key(input_signature="(torch.float32[4,3,32,32]@cpu)"),
        make_key(dtype="torch.bfloat16"),
        make_key(budget_bytes=base.budget_bytes + 1),
        make_key(chunk_bytes=None),
        make_key(device_kind="cuda"),
        make_key(planner_version="lgm-test/2"),
        make_key(torch_version="0.0.0"),
    ]
    digests = {k.digest() for k in [base, *changed]}
    assert len(digests) == len(changed) + 1
    assert base.digest() == make_key().digest()
    assert base.torch_version == torch.__version__


@pytest.mark.parametrize(
    "changes",
    [{"budget_bytes": 0}, {"chunk_bytes": -1}, {"device_kind": ""}, {"device_kind": "CUDA"}],
)
def test_plan_key_rejects_bad_values(changes: dict[str, Any]) -> None:
    with pytest.raises(VTensorError):
        make_key(**changes)


def test_plan_key_of_a_model() -> None:
    model = _mlp()
    x = torch.randn(8, 4)
    key = plan_key(model, (x,), budget_bytes=2**20, chunk_bytes=None, planner_version="v")
    assert key.architecture == architecture_fingerprint(model)
    assert key.input_signature == input_signature(x)
    assert key.dtype == dtype_of(model.parameters()) == "torch.float32"
    assert key.device_kind == "cpu"


# -- cache: round trip, LRU, errors ------------------------------------------------------------


def test_plan_cache_round_trip(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = PlanCache(tmp_path / "a" / "cache")
    key, plan = make_key(), make_plan()
    assert cache.get(key) is None
    cache.put(key, plan)
    assert (tmp_path / "a" / "cache" / f"{key.digest()}.json").is_file()
    loaded = cache.get(key)
    assert loaded == plan
    assert loaded is not None and loaded.digest() == plan.digest()
    assert cache.last_load_s > 0.0
    assert cache.get(make_key(1)) is None
    assert _warnings(caplog) == []


@pytest.mark.parametrize("chunk_bytes", [2**20, None])
def test_a_plans_json_is_that_of_its_fields_and_its_digest_is_kept(chunk_bytes: int | None) -> None:
    # Every field set, nested tuples included: to_json writes what dataclasses.asdict would,
    # so the digests of plans stored before stay valid.
    plan = dataclasses.replace(
        make_plan(),
        chunk_bytes=chunk_bytes,
        recompute=("a", "b.c"),
        watched_steps=(1, 4),
        step_headroom_bytes=(5, 6),
        watched_events=((3, 0), (4, 1)),
        step_reserve_bytes=((1, 2), (), (3,)),
        encoded=True,
        tensor_names=("w", ""),
    )
    assert plan.to_json() == json.dumps(dataclasses.asdict(plan), sort_keys=True)
    assert Plan.from_json(plan.to_json()) == plan
    digest = hashlib.sha256(plan.to_json().encode()).hexdigest()
    assert plan.digest() == digest and plan.digest() is plan.digest()
    assert dataclasses.replace(plan, encoded=False).digest() != digest


def test_plan_cache_put_replaces_entry(tmp_path: Path) -> None:
    cache = PlanCache(tmp_path)
    cache.put(make_key(), make_plan(seed=1))
    cache.put(make_key(), make_plan(seed=2))
    assert cache.get(make_key()) == make_plan(seed=2)
    assert len(list(tmp_path.glob("*.json"))) == 1


def _garbage(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 4)


def _truncate(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


def _edit_entry(path: Path, edit: Callable[[dict[str, object]], None]) -> None:
    entry = json.loads(path.read_bytes())
    edit(entry)
    path.write_text(json.dumps(entry))


def _foreign_schema(path: Path) -> None:
    _edit_entry(path, lambda e: e.update(cache_schema_version=CACHE_SCHEMA_VERSION + 1))


def _one_digit(path: Path) -> None:
    def edit(entry: dict[str, object]) -> None:
        text = str(entry["plan"])
        assert '"predicted_peak_bytes": 60000123' in text
        entry["plan"] = text.replace(
            '"predicted_peak_bytes": 60000123', '"predicted_peak_bytes": 60000124'
        )

    _edit_entry(path, edit)


def _foreign_plan_schema(path: Path) -> None:
    def edit(entry: dict[str, object]) -> None:
        text = str(entry["plan"]).replace(
            f'"schema_version": {PLAN_SCHEMA_VERSION}', '"schema_version": 99'
        )
        entry.update(plan=text, plan_sha256=hashlib.sha256(text.encode()).hexdigest())

    _edit_entry(path, edit)


def _other_keys_entry(path: Path) -> None:
    other = PlanCache(path.parent)
    other.put(make_key(7), make_plan(seed=7))
    other.path_for(make_key(7)).replace(path)


CORRUPTIONS: dict[str, tuple[Callable[[Path], object], str]] = {
    "garbage": (_garbage, "not valid JSON"),
    "truncated": (_truncate, "not valid JSON"),
    "empty": (lambda p: p.write_bytes(b""), "not valid JSON"),
    "not_an_object": (lambda p: p.write_text("[1, 2]"), "not an object"),
    "foreign_schema": (_foreign_schema, "schema version"),
    "checksum": (_one_digit, "checksum"),
    "foreign_plan_schema": (_foreign_plan_schema, "does not parse"),
    "key_mismatch": (_other_keys_entry, "does not match"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_plan_cache_bad_entry_is_a_miss_with_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, corruption: str
) -> None:
    corrupt, reason = CORRUPTIONS[corruption]
    cache = PlanCache(tmp_path)
    key, plan = make_key(), make_plan()
    cache.put(key, plan)
    path = cache.path_for(key)
    corrupt(path)
    with caplog.at_level(logging.WARNING, logger=CACHE_LOGGER):
        assert cache.get(key) is None
    [warning] = _warnings(caplog)
    assert path.name in warning.getMessage() and reason in warning.getMessage()
    cache.put(key, plan)
    assert cache.get(key) == plan
    assert _entry_is_valid(path)


def test_plan_cache_lru_evicts_least_recently_used(tmp_path: Path) -> None:
    cache = PlanCache(tmp_path, max_entries=3)
    for i in range(3):
        cache.put(make_key(i), make_plan(seed=i))
    assert cache.get(make_key(0)) is not None  # 0 is now more recent than 1
    cache.put(make_key(3), make_plan(seed=3))
    cache.put(make_key(4), make_plan(seed=4))
    present = {i for i in range(5) if cache.get(make_key(i)) is not None}
    assert present == {0, 3, 4}
    assert len(list(tmp_path.glob("*.json"))) == 3


def test_plan_cache_rejects_max_entries_below_one(tmp_path: Path) -> None:
    with pytest.raises(VTensorError, match="max_entries"):
        PlanCache(tmp_path, max_entries=0)


def test_plan_cache_unwritable_directory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A path below a regular file cannot be created even by root (chmod would not stop root).
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("")
    cache = PlanCache(blocker / "cache")
    with pytest.raises(VTensorError, match="not_a_directory") as info:
        cache.put(make_key(), make_plan())
    assert "writable" in str(info.value)
    with caplog.at_level(logging.WARNING, logger=CACHE_LOGGER):
        assert cache.get(make_key()) is None
    assert len(_warnings(caplog)) == 1


def test_plan_cache_load_time_of_a_typical_plan(tmp_path: Path) -> None:
    # Timing is measured, not asserted (STYLE: tests); the figure is reported with -s.
    cache = PlanCache(tmp_path)
    plan = make_plan(n_moves=500)
    cache.put(make_key(), plan)
    loads_s = []
    for _ in range(20):
        assert cache.get(make_key()) == plan
        loads_s.append(cache.last_load_s)
    size_kib = cache.path_for(make_key()).stat().st_size / 1024
    print(f"500-move plan ({size_kib:.0f} KiB): median load {sorted(loads_s)[10] * 1e3:.2f} ms")


# -- cache: several processes ------------------------------------------------------------------

_WORKER = """
import logging, sys
sys.path.insert(0, sys.argv[1])
from test_plan_cache import make_key, make_plan
from vtensor.planner.cache import PlanCache

directory, worker, rounds = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
logging.basicConfig(level=logging.WARNING)
warnings = []
class Count(logging.Handler):
    def emit(self, record):
        warnings.append(record)
logging.getLogger("vtensor").addHandler(Count(logging.WARNING))
cache = PlanCache(directory, max_entries=8)
plans = {i: make_plan(200, seed=i) for i in range(20)}
for r in range(rounds):
    shared, own = r % 6, 10 + worker * 2 + r % 2
    for index in (shared, own):
        cache.put(make_key(index), plans[index])
    for index in (shared, (shared + 1) % 6, own, 10 + (worker + 1) % 4 * 2):
        got = cache.get(make_key(index))
        if got is not None and got != plans[index]:
            sys.exit(f"worker {worker}: wrong plan for key {index}")
sys.exit(f"worker {worker}: {len(warnings)} warnings" if warnings else 0)
"""


def test_plan_cache_concurrent_processes(tmp_path: Path) -> None:
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(HERE), str(tmp_path), str(w), "60"],
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(4)
    ]
    errors = [w.communicate(timeout=300)[1] for w in workers]
    assert [w.returncode for w in workers] == [0] * 4, errors
    entries = list(tmp_path.glob("*.json"))
    assert 0 < len(entries) <= 8
    assert all(_entry_is_valid(p) for p in entries)
    assert list(tmp_path.glob(".tmp-*")) == []


_READER = """
import sys
sys.path.insert(0, sys.argv[1])
from test_plan_cache import make_key
from vtensor.planner.cache import PlanCache

plan = PlanCache(sys.argv[2]).get(make_key(3))
print(plan.digest() if plan is not None else "miss")
"""


def test_plan_cache_fresh_process_reads_plan(tmp_path: Path) -> None:
    plan = make_plan(100, seed=3)
    PlanCache(tmp_path).put(make_key(3), plan)
    result = subprocess.run(
        [sys.executable, "-c", _READER, str(HERE), str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert result.stdout.strip() == plan.digest()
