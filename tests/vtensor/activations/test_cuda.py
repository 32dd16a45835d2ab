"""The CUDA path: side-stream transfers to pinned host memory, and managed training on a GPU."""

import pytest
import torch
from torch import nn

import vtensor
from vtensor.io.chunk import ChunkState, split_into_chunks
from vtensor.io.tiers import HostTier
from vtensor.io.transfer import CudaTransferEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_engine_round_trips_chunks_through_pinned_memory():
    device = torch.device("cuda")
    engine = CudaTransferEngine(device, HostTier(capacity_bytes=64 * 2**20))
    data = torch.randint(0, 256, (3 * 2**20 + 123,), dtype=torch.uint8, device=device)
    expected = data.clone()
    storage = data.untyped_storage()
    chunks = split_into_chunks(storage.nbytes(), 2**20)
    tail = chunks[1:]
    for chunk in tail:
        chunk.move(ChunkState.EVICTING)
    engine.evict(storage, tail).wait()
    torch.cuda.synchronize()
    storage.resize_(tail[0].offset_bytes)
    storage.resize_(data.numel())
    engine.restore(storage, tail).wait()  # the compute stream waits on the side stream
    whole = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
    assert torch.equal(whole, expected)
    engine.release(tail)
    engine.close()


@pytest.mark.parametrize("granularity", ["chunk", "tensor"])
def test_cuda_training_is_bit_identical_under_half_the_activations(granularity):
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(8)]).to(
        device
    )
    x = torch.randn(4096, 1024, device=device)
    state = {k: v.cpu() for k, v in model.state_dict().items()}  # copies off the device

    def train(mm: vtensor.MemoryManager | None) -> list[torch.Tensor]:
        model.load_state_dict(state)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        for _ in range(3):
            opt.zero_grad()
            if mm is None:
                model(x).square().mean().backward()
            else:
                with mm.step(model, opt, inputs=(x,)):
                    model(x).square().mean().backward()
            opt.step()
        torch.cuda.synchronize()
        return [p.detach().cpu() for p in model.parameters()]

    ref = train(None)  # also the warm-up: cuBLAS workspaces of both threads
    # The parameters, their momenta and the input stay; the budget is half of what a step adds.
    with vtensor.MemoryManager("64GiB") as probe:
        train(probe)
        peak = probe.report().peak_device_bytes
    static = x.nbytes + 2 * sum(p.nbytes for p in model.parameters())
    budget = static + (peak - static) // 2
    with vtensor.MemoryManager(budget, granularity=granularity, measure_peaks=True) as mm:
        got = train(mm)
        rep = mm.report()
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    assert rep.bytes_out > 0
    assert rep.peak_independent_bytes is not None
    assert rep.peak_device_bytes <= rep.budget_bytes + 2**20
