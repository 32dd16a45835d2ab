"""The tier evicted bytes go to (NOTE [tier choice] in vtensor/io/engines.py), and its errors."""

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

import vtensor
from vtensor.errors import VTensorError
from vtensor.io import engines
from vtensor.io.engines import Tier, engine_for, resolve_tier
from vtensor.io.staged import StagedTransferEngine
from vtensor.io.transfer import FileTransferEngine

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)


@dataclass(frozen=True)
class FakeProperties:
    """What ``torch.cuda.get_device_properties`` says of a GPU, as far as the choice reads."""

    is_integrated: bool


@pytest.fixture(params=[True, False], ids=["integrated", "discrete"])
def gpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """A CUDA device that reports ``is_integrated`` as the parameter; returns it."""
    integrated: bool = request.param

    def properties(device: torch.device) -> FakeProperties:
        return FakeProperties(is_integrated=integrated)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    return integrated


def test_resolve_tier_on_cpu_is_the_swap_file() -> None:
    assert resolve_tier(CPU) is Tier.STORAGE
    assert resolve_tier(CPU, Tier.AUTO) is Tier.STORAGE
    assert resolve_tier(CPU, "storage") is Tier.STORAGE


def test_resolve_tier_auto_on_cuda_follows_is_integrated(gpu: bool) -> None:
    assert resolve_tier(CUDA) is (Tier.STORAGE if gpu else Tier.HOST)
    assert resolve_tier(CUDA, "auto") is (Tier.STORAGE if gpu else Tier.HOST)


def test_resolve_tier_asked_for_on_cuda_is_kept(gpu: bool) -> None:
    assert resolve_tier(CUDA, Tier.HOST) is Tier.HOST
    assert resolve_tier(CUDA, "storage") is Tier.STORAGE


def test_resolve_tier_host_on_cpu_names_the_value_and_the_forms() -> None:
    with pytest.raises(VTensorError) as caught:
        resolve_tier(CPU, "host")
    message = str(caught.value)
    assert "tier='host'" in message and "'auto'" in message and "'storage'" in message
    assert message.count("\n") <= 1


@pytest.mark.parametrize("bad", ["disk", "HOST", "", 3])
def test_resolve_tier_rejects_a_bad_value(bad: object) -> None:
    with pytest.raises(VTensorError) as caught:
        resolve_tier(CPU, bad)  # type: ignore[arg-type]
    message = str(caught.value)
    assert repr(bad) in message
    assert all(t.value in message for t in Tier)
    assert message.count("\n") <= 1


def test_resolve_tier_rejects_other_devices() -> None:
    with pytest.raises(VTensorError, match="meta"):
        resolve_tier(torch.device("meta"))


def test_engine_for_cpu_is_the_file_engine(tmp_storage_dir: Path) -> None:
    for tier in (Tier.AUTO, Tier.STORAGE):
        engine = engine_for(
            CPU,
            tier=tier,
            host_capacity_bytes=None,
            storage_dir=tmp_storage_dir,
            drop_page_cache=True,
            encrypt=True,
        )
        assert isinstance(engine, FileTransferEngine)
        engine.close()
    with pytest.raises(VTensorError, match="tier='host'"):
        engine_for(
            CPU,
            tier=Tier.HOST,
            host_capacity_bytes=None,
            storage_dir=tmp_storage_dir,
            drop_page_cache=True,
            encrypt=True,
        )


class FakeCopier:
    """Stands in for ``CudaCopier`` where there is no GPU: plain CPU staging buffers."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def staging(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def close(self) -> None:
        pass


class FakeHostEngine:
    """Stands in for ``CudaTransferEngine``: records what it was built with."""

    def __init__(self, device: torch.device, tier: object) -> None:
        self.device, self.tier = device, tier


def test_engine_for_cuda_picks_the_staged_engine_on_an_integrated_gpu(
    gpu: bool, tmp_storage_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engines, "CudaCopier", FakeCopier)
    monkeypatch.setattr(engines, "CudaTransferEngine", FakeHostEngine)
    engine = engine_for(
        CUDA,
        host_capacity_bytes=None,
        storage_dir=tmp_storage_dir,
        drop_page_cache=True,
        encrypt=True,
        staging_bytes=256 << 10,
    )
    if gpu:
        assert isinstance(engine, StagedTransferEngine)
        assert engine.pinned_bytes == 2 * (256 << 10)
        assert engine.sealer is not None
        engine.close()
    else:
        assert isinstance(engine, FakeHostEngine)


def test_param_offload_takes_the_tier(tmp_storage_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(VTensorError, match="tier='host'"):
        vtensor.ParamOffload(model, optimizer, "1MiB", tier="host", storage_dir=tmp_storage_dir)
    with vtensor.ParamOffload(
        model, optimizer, "1MiB", tier=Tier.STORAGE, storage_dir=tmp_storage_dir
    ) as po:
        assert isinstance(po._engine, FileTransferEngine)
        model(torch.randn(4, 64)).sum().backward()
        po.step()
