"""Demand layering and weight files: bit-identical outputs, memory bounds, and clear errors."""

import json
import os
import random
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks.zoo import ZOO
from vtensor.errors import (
    LayeringError,
    VTensorError,
    WeightFileChecksumError,
    WeightFileFormatError,
    WeightFileMismatchError,
    WeightFileTruncatedError,
    WeightFileVersionError,
)
from vtensor.layering.demand import DemandLayering
from vtensor.layering.placement import enclosing_calls, place_calls, ring_positions
from vtensor.layering.weightfile import WeightFile, write_weights


def _resident_and_file(build: Callable[[], nn.Module], path: Path) -> nn.Module:
    torch.manual_seed(0)
    model = build()
    model.eval()
    write_weights(model.state_dict(), path)
    return model


def _meta(build: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        model = build()
    return model.eval()


def _layer_bytes(model: nn.Module) -> list[int]:
    """Bytes of each module's own tensors as a layer holds them (packed at 64 bytes)."""
    sizes = []
    for module in model.modules():
        own = [*module._parameters.values(), *module._buffers.values()]
        size = sum(-(-t.numel() * t.element_size() // 64) * 64 for t in own if t is not None)
        if size:
            sizes.append(size)
    return sizes


@pytest.mark.parametrize("lookahead", [0, 1, 4])
@pytest.mark.parametrize("name", ["cnn", "resnet", "transformer"])
def test_layering_outputs_bit_identical(tmp_path: Path, name: str, lookahead: int) -> None:
    entry = ZOO[name]
    resident = _resident_and_file(entry.build, tmp_path / "w.vtw")
    model = _meta(entry.build)
    with DemandLayering(model, tmp_path / "w.vtw", lookahead=lookahead) as layered:
        for seed in range(3):  # the first forward plans, the others prefetch
            x, _ = entry.make_batch(entry.batch_size, seed=seed)
            with torch.no_grad():
                expected = resident(x)
            assert torch.equal(layered(x), expected)
        with torch.inference_mode():
            assert torch.equal(model(x), expected)
        report = layered.report()
    assert report.forwards == 4
    assert report.peak_live_bytes < report.model_bytes
    assert all(p.device.type == "meta" for p in model.parameters())


def test_layering_peak_at_lookahead_one_is_two_largest_layers(tmp_path: Path) -> None:
    # Bound: at lookahead k the held layers are the running call and the k after it, so the
    # peak is at most the largest sum of k + 1 consecutive layers; here, two layers. With a
    # ring as large as the model, only the lookahead keeps the reader from reading further.
    for name in ("cnn", "resnet"):
        entry = ZOO[name]
        resident = _resident_and_file(entry.build, tmp_path / f"{name}.vtw")
        x, _ = entry.make_batch(entry.batch_size)
        two_largest = sum(sorted(_layer_bytes(resident))[-2:])
        for ring in (None, 2**20):
            model = _meta(entry.build)
            with DemandLayering(
                model, tmp_path / f"{name}.vtw", lookahead=1, buffer_bytes=ring
            ) as dl:
                for _ in range(3):
                    dl(x)
                report = dl.report()
            assert max(_layer_bytes(resident)) <= report.peak_live_bytes <= two_largest


def test_layering_streams_from_the_file_instead_of_keeping_it(tmp_path: Path) -> None:
    def build() -> nn.Module:
        return nn.Sequential(*(nn.Linear(128, 128) for _ in range(16)))

    resident = _resident_and_file(build, tmp_path / "mlp.vtw")
    x = torch.randn(4, 128)
    with DemandLayering(_meta(build), tmp_path / "mlp.vtw", lookahead=1) as layered:
        for _ in range(3):
            assert torch.equal(layered(x), resident(x).detach())
        report = layered.report()
    layer = max(_layer_bytes(resident))
    assert report.peak_live_bytes <= 2 * layer < report.model_bytes / 7
    assert report.buffer_bytes <= 3 * layer
    assert report.bytes_read >= 3 * report.model_bytes  # every forward reads every layer


def test_layering_buffer_bytes_knob(tmp_path: Path) -> None:
    entry = ZOO["transformer"]
    resident = _resident_and_file(entry.build, tmp_path / "w.vtw")
    x, _ = entry.make_batch(4)
    largest = max(_layer_bytes(resident))
    with DemandLayering(_meta(entry.build), tmp_path / "w.vtw", buffer_bytes=largest) as layered:
        for _ in range(2):
            assert torch.equal(layered(x), resident(x).detach())
        report = layered.report()
    assert report.lookahead is None
    pos_bytes = resident.get_parameter("pos").numel() * 4  # the root's own: held throughout
    assert report.peak_live_bytes <= largest + pos_bytes
    with DemandLayering(_meta(entry.build), tmp_path / "w.vtw", buffer_bytes=largest - 64) as dl:
        with pytest.raises(LayeringError, match=f"at least {largest}"):
            dl(x)


def test_layering_direct_io_and_dropped_page_cache(tmp_path: Path) -> None:
    entry = ZOO["cnn"]
    resident = _resident_and_file(entry.build, tmp_path / "w.vtw")
    x, _ = entry.make_batch(entry.batch_size)
    for options in ({"direct_io": True}, {"drop_page_cache": True, "verify": "always"}):
        with DemandLayering(_meta(entry.build), tmp_path / "w.vtw", **options) as layered:
            for _ in range(2):
                assert torch.equal(layered(x), resident(x).detach())


def _safetensors(state: dict[str, torch.Tensor], path: Path) -> None:
    codes = {torch.float32: "F32", torch.int64: "I64"}
    header: dict[str, object] = {}
    data = b""
    for name, tensor in state.items():
        raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": codes[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_layering_reads_safetensors(tmp_path: Path) -> None:
    entry = ZOO["cnn"]
    torch.manual_seed(0)
    resident = entry.build().eval()
    _safetensors({k: v.clone() for k, v in resident.state_dict().items()}, tmp_path / "w.st")
    x, _ = entry.make_batch(entry.batch_size)
    with DemandLayering(_meta(entry.build), tmp_path / "w.st", lookahead=2) as layered:
        for _ in range(2):
            assert torch.equal(layered(x), resident(x).detach())


# -- execution order, reuse, tied weights --------------------------------------------------------


class Reversed(nn.Module):
    """Runs its layers in the reverse of their registration order, one of them twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.a(self.b(self.c(self.b(x))))
        return out


class TiedModules(nn.Module):
    """Embedding and output head share one Parameter, each used by its own module's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.relu(self.mid(self.embed(tokens))))
        return out


class Branching(nn.Module):
    """Control flow that depends on the input: the order of calls changes between forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(self.a(x)) if x.sum() > 0 else self.a(self.b(x))
        return out


@pytest.mark.parametrize("lookahead", [0, 1, 4])
def test_layering_order_and_reuse_work(tmp_path: Path, lookahead: int) -> None:
    for build, x in ((Reversed, torch.randn(3, 8)), (TiedModules, torch.tensor([[1, 5, 7]]))):
        resident = _resident_and_file(build, tmp_path / "w.vtw")
        model = _meta(build)
        with DemandLayering(model, tmp_path / "w.vtw", lookahead=lookahead) as layered:
            for _ in range(3):
                assert torch.equal(layered(x), resident(x).detach())
            report = layered.report()
        assert report.calls == (4 if build is Reversed else 3)  # `b` runs twice: two calls
    assert isinstance(model, TiedModules)
    assert model.head.weight is model.embed.weight  # the tie survives as one placeholder


def test_layering_changed_order_is_an_error(tmp_path: Path) -> None:
    resident = _resident_and_file(Branching, tmp_path / "w.vtw")
    with DemandLayering(_meta(Branching), tmp_path / "w.vtw") as layered:
        assert torch.equal(layered(torch.ones(1, 4)), resident(torch.ones(1, 4)).detach())
        with pytest.raises(LayeringError, match="order of calls changed"):
            layered(-torch.ones(1, 4))
        # The failed forward left nothing bound: the planned order still runs.
        assert torch.equal(layered(torch.ones(1, 4)), resident(torch.ones(1, 4)).detach())


def test_layering_functional_use_of_a_child_tensor_is_an_error_with_a_fix(tmp_path: Path) -> None:
    entry = ZOO["tied"]  # the root calls F.linear with embed.weight, outside embed's forward
    resident = _resident_and_file(entry.build, tmp_path / "w.vtw")
    x, _ = entry.make_batch(4)
    with DemandLayering(_meta(entry.build), tmp_path / "w.vtw") as layered:
        with pytest.raises(LayeringError, match=r"'embed\.weight'.*resident=\['embed'\]"):
            layered(x)
    for fix in ({"resident": ["embed"]}, {"group": [""]}):
        with DemandLayering(_meta(entry.build), tmp_path / "w.vtw", **fix) as layered:  # type: ignore[arg-type]
            for _ in range(2):
                assert torch.equal(layered(x), resident(x).detach())


def test_layering_refuses_training_and_autograd(tmp_path: Path) -> None:
    resident = _resident_and_file(Reversed, tmp_path / "w.vtw")
    model = _meta(Reversed)
    with DemandLayering(model, tmp_path / "w.vtw") as layered:
        with pytest.raises(LayeringError, match=r"torch\.no_grad"):
            model(torch.randn(2, 8))
        model.train()
        with pytest.raises(LayeringError, match=r"model\.eval\(\)"):
            layered(torch.randn(2, 8))
        model.eval()
        with pytest.raises(RuntimeError):  # a bad input fails inside a layer's forward ...
            layered(torch.randn(2, 5))
        x = torch.randn(2, 8)  # ... and the next forward runs from a clean state
        assert torch.equal(layered(x), resident(x).detach())


def test_layering_refuses_inputs_off_the_cpu_and_names_the_fix(tmp_path: Path) -> None:
    # A GPU input is refused the same way (no GPU here: the meta device stands in for it).
    resident = _resident_and_file(Reversed, tmp_path / "w.vtw")
    with DemandLayering(_meta(Reversed), tmp_path / "w.vtw") as layered:
        with pytest.raises(LayeringError, match=r"input 0 is on meta.*x\.cpu\(\)"):
            layered(torch.randn(2, 8, device="meta"))
        x = torch.randn(2, 8)
        assert torch.equal(layered(x), resident(x).detach())


def test_layering_reports_a_file_truncated_while_open(tmp_path: Path) -> None:
    build = ZOO["cnn"].build
    _resident_and_file(build, tmp_path / "w.vtw")
    x, _ = ZOO["cnn"].make_batch(2)
    with DemandLayering(_meta(build), tmp_path / "w.vtw", lookahead=2) as layered:
        layered(x)
        os.truncate(tmp_path / "w.vtw", 8192)
        with pytest.raises(WeightFileTruncatedError, match=r"w\.vtw"):
            layered(x)


# -- weight files ----------------------------------------------------------------------------


def test_weight_file_round_trip_and_atomic_write(tmp_path: Path) -> None:
    state = {
        "w": torch.randn(3, 5),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "half": torch.randn(7, dtype=torch.bfloat16),
        "mask": torch.tensor([True, False]),
        "empty": torch.zeros(0, 4),
        "strided": torch.arange(12).view(3, 4).t(),
    }
    path = write_weights(state, tmp_path / "w.vtw", metadata={"arch": "test"})
    with WeightFile(path) as weights:
        assert all(e.offset % 4096 == 0 for e in weights.entries.values())
        assert weights.metadata == {"arch": "test"} and weights.version == 1
        loaded = weights.read_state_dict()
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in state.items())
    before = path.read_bytes()
    with pytest.raises(WeightFileMismatchError, match="'bad'"):
        write_weights({"w": torch.ones(2), "bad": torch.empty(2, device="meta")}, path)
    assert path.read_bytes() == before  # a failed write leaves the old file whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.vtw"]  # no temporary left


def _corrupt(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_weight_file_errors_name_the_file_the_tensor_and_the_fix(tmp_path: Path) -> None:
    build = ZOO["cnn"].build
    good = tmp_path / "good.vtw"
    _resident_and_file(build, good)
    x, _ = ZOO["cnn"].make_batch(2)
    with WeightFile(good) as weights:
        entry = weights.entries["0.weight"]

    def variant(name: str) -> Path:
        path = tmp_path / name
        path.write_bytes(good.read_bytes())
        return path

    cases: list[tuple[Path, type[VTensorError], str]] = []
    path = variant("magic.vtw")
    _corrupt(path, 0, b"NOTVTWGT")
    cases.append((path, WeightFileFormatError, "not a vtensor weight file"))
    path = variant("version.vtw")
    _corrupt(path, 8, struct.pack("<I", 99))
    cases.append((path, WeightFileVersionError, "format version 99 is newer"))
    path = variant("header.vtw")
    _corrupt(path, 40, b"#")
    cases.append((path, WeightFileChecksumError, "header is corrupt"))
    path = variant("short.vtw")
    os.truncate(path, path.stat().st_size - 4096)
    cases.append((path, WeightFileTruncatedError, "interrupted copy or write"))
    for path, error, message in cases:
        with pytest.raises(error, match=message) as info:
            DemandLayering(_meta(build), path)
        assert str(path) in str(info.value) and "write_weights" in str(info.value)

    path = variant("data.vtw")
    _corrupt(path, entry.offset + 5, b"\xff\xfe")
    with DemandLayering(_meta(build), path) as layered:
        with pytest.raises(WeightFileChecksumError, match=r"tensor '0\.weight'.*write_weights"):
            layered(x)


def test_weight_file_mismatching_the_model_is_an_error(tmp_path: Path) -> None:
    torch.manual_seed(0)
    state = ZOO["cnn"].build().state_dict()
    changes: list[tuple[dict[str, torch.Tensor], str]] = [
        ({k: v for k, v in state.items() if k != "1.running_var"}, r"missing.*1\.running_var"),
        ({**state, "extra": torch.ones(1)}, r"extra tensors \['extra'\]"),
        ({**state, "0.weight": torch.ones(16, 3, 5, 5)}, r"'0\.weight'.*\[16, 3, 5, 5\]"),
        ({**state, "0.weight": state["0.weight"].double()}, r"'0\.weight' is torch\.float64"),
    ]
    for i, (changed, message) in enumerate(changes):
        path = write_weights(changed, tmp_path / f"m{i}.vtw")
        with pytest.raises(WeightFileMismatchError, match=message) as info:
            DemandLayering(_meta(ZOO["cnn"].build), path)
        assert str(path) in str(info.value) and "state_dict" in str(info.value)


# -- the plan (pure) -------------------------------------------------------------------------


def test_enclosing_calls_are_those_released_out_of_order() -> None:
    # root(0) loads, a(1) loads and releases, b(2) loads and releases, root releases.
    events = [(True, 0), (True, 1), (False, 1), (True, 2), (False, 2), (False, 0)]
    assert enclosing_calls(events) == {0}
    assert enclosing_calls([(True, 0), (False, 0), (True, 1), (False, 1)]) == set()


def _overlap(a: int, size_a: int, b: int, size_b: int) -> bool:
    return a < b + size_b and b < a + size_a


def test_placed_calls_never_overlap_a_call_held_with_them() -> None:
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([0, 64, 128, 640, 4096, 8192]) for _ in range(rng.randint(1, 12))]
        lookahead = rng.randint(0, 4)
        at, capacity = place_calls(sizes, lookahead)
        assert sorted(at) == [j for j, size in enumerate(sizes) if size]
        windows = [sum(sizes[max(0, j - lookahead) : j + 1]) for j in range(len(sizes))]
        assert max(windows) <= capacity <= sum(sizes)
        for j in at:
            assert at[j] + sizes[j] <= capacity
            for i in at:
                if i != j and abs(i - j) <= lookahead:
                    assert not _overlap(at[i], sizes[i], at[j], sizes[j])
    # One large layer last: placing by size puts it first, so the ring is the window, not more.
    assert place_calls([64, 64, 64, 4096], 1) == ({3: 0, 0: 0, 1: 64, 2: 4096}, 4160)


def test_ring_positions_wrap_to_the_start() -> None:
    assert ring_positions([64, 128, 64, 128], 256) == [0, 64, 192, 0]
