"""The storage tier on CUDA: device bytes to the sealed swap file through pinned staging slots."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from vtensor.io.chunk import ChunkState, split_into_chunks
from vtensor.io.engines import Tier, engine_for
from vtensor.io.staged import StagedTransferEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MIB = 1 << 20


@pytest.fixture
def engine(tmp_storage_dir: Path) -> Iterator[StagedTransferEngine]:
    """The engine ``engine_for`` gives a CUDA device with the storage tier forced."""
    made = engine_for(
        torch.device("cuda"),
        tier=Tier.STORAGE,
        host_capacity_bytes=None,
        storage_dir=tmp_storage_dir,
        drop_page_cache=True,
        encrypt=True,
        staging_bytes=MIB,
    )
    assert isinstance(made, StagedTransferEngine)
    try:
        yield made
    finally:
        made.close()


def test_staged_cuda_engine_round_trips_chunks(engine: StagedTransferEngine) -> None:
    device = torch.device("cuda")
    data = torch.randint(0, 256, (5 * MIB + 123,), dtype=torch.uint8, device=device)
    expected = data.clone()
    storage = data.untyped_storage()
    tail = split_into_chunks(storage.nbytes(), 2 * MIB)[1:]  # parts of one slot each
    for chunk in tail:
        chunk.move(ChunkState.EVICTING)
    engine.evict(storage, tail).wait()
    storage.resize_(tail[0].offset_bytes)
    storage.resize_(data.numel())
    engine.restore(storage, tail).wait()
    whole = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
    assert torch.equal(whole, expected)
    engine.release(tail)
    assert engine.tier.extents.used_bytes == 0
    assert engine.pinned_bytes == 2 * MIB


def test_cuda_training_step_through_the_storage_tier_is_bit_identical(
    engine: StagedTransferEngine,
) -> None:
    """Saved activations leave the device through the engine and come back for backward."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(4)])
    model = model.to(device)
    x = torch.randn(1024, 512, device=device)
    moved = []

    def pack(saved: torch.Tensor) -> tuple[torch.Tensor, list, torch.Size]:
        copy = saved.detach().clone()  # a storage of its own, which can leave whole
        storage = copy.untyped_storage()
        chunks = split_into_chunks(storage.nbytes(), MIB)
        engine.evict(storage, chunks).wait()
        storage.resize_(0)  # the device memory is free while the bytes are in the file
        moved.append(storage.nbytes() == 0)
        return copy, chunks, saved.shape

    def unpack(packed: tuple[torch.Tensor, list, torch.Size]) -> torch.Tensor:
        copy, chunks, shape = packed
        storage = copy.untyped_storage()
        storage.resize_(sum(c.nbytes for c in chunks))
        engine.restore(storage, chunks).wait()
        engine.release(chunks)
        return copy.view(shape)

    def grads(offload: bool) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        if offload:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                loss = model(x).square().mean()
        else:
            loss = model(x).square().mean()
        loss.backward()
        torch.cuda.synchronize()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    reference = grads(offload=False)
    offloaded = grads(offload=True)
    assert moved and all(moved)
    assert all(torch.equal(a, b) for a, b in zip(reference, offloaded, strict=True))
    assert engine.tier.extents.used_bytes == 0
