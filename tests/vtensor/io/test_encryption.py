"""Sealed swap file: no plaintext at rest, tampering detected, nothing left after exit or crash."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import vtensor
from vtensor.errors import SwapAuthenticationError
from vtensor.io.chunk import Chunk, split_into_chunks
from vtensor.io.tiers import StorageTier
from vtensor.io.transfer import FileTransferEngine

# Four distinct float32 values: 16 bytes that any plaintext activation below repeats.
PATTERN = torch.tensor([3.1415927, -2.7182817, 1.4142135, 0.5772157])
PATTERN_BYTES = PATTERN.numpy().tobytes()
ROWS, WIDTH, LAYERS = 1024, 256, 8  # 1 MiB per activation
CHUNK_BYTES = 64 * 1024  # page multiple: the swap file has no holes between extents
PAGE = 4096
# Chi-square of a 256-bin byte histogram has 255 degrees of freedom (mean 255, sd 22.6):
# uniform bytes exceed 400 with probability ~1e-9; plaintext floats land in the millions.
CHI2_LIMIT = 400.0


class _Scale(nn.Module):
    """Multiplies by a learnable 1.0: the output is bitwise the input, and mul saves it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _pattern_model() -> tuple[nn.Module, torch.Tensor]:
    """A model whose every saved activation is the known pattern, repeated."""
    x = PATTERN.repeat(ROWS * WIDTH // 4).reshape(ROWS, WIDTH)
    return nn.Sequential(*[_Scale() for _ in range(LAYERS)]), x


def _manager(storage: Path, budget: int | str, **kw: object) -> vtensor.MemoryManager:
    return vtensor.MemoryManager(budget, chunk_bytes=CHUNK_BYTES, storage_dir=str(storage), **kw)  # type: ignore[arg-type]


def _tight_budget(model: nn.Module, x: torch.Tensor, storage: Path) -> int:
    """A budget 30 % of the way from the smallest feasible one to the unmanaged peak."""
    with _manager(storage, "1GiB") as mm, mm.step(model):
        model(x).sum().backward()
    model.zero_grad()
    rep = mm.report()
    return int(rep.min_budget_bytes + 0.3 * (rep.peak_device_bytes - rep.min_budget_bytes))


def _swap_fds(pid: int | str, storage: Path) -> list[int]:
    """Descriptors of process ``pid`` that point at a deleted file in ``storage``."""
    root = os.path.realpath(storage) + "/"
    found = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:  # closed while listing
            continue
        if target.startswith(root) and target.endswith(" (deleted)"):
            found.append(int(name))
    return found


def _scan(path: str, buffer: bytearray) -> tuple[int, bool, float]:
    """Bytes in non-zero pages, whether the pattern occurs, chi-square of their histogram.

    Reads through the preallocated ``buffer`` so that a scan inside a managed step adds next
    to nothing to the heap the budget tracks. All-zero pages are holes (extents not written
    yet) and are skipped; a page of ciphertext is all zero with probability 2**-32768.
    """
    counts = torch.zeros(256, dtype=torch.int64)
    data = torch.frombuffer(buffer, dtype=torch.uint8)
    seen = found = 0
    with open(path, "rb", buffering=0) as f:
        while got := f.readinto(buffer):
            # Activations sit at 16-byte-aligned file offsets, so no occurrence of the pattern
            # straddles two reads of a page-multiple buffer.
            found |= buffer.find(PATTERN_BYTES, 0, got) >= 0
            for start in range(0, got, PAGE):
                page = data[start : min(got, start + PAGE)]
                if page.any():
                    counts += torch.bincount(page, minlength=256)
                    seen += page.numel()
    expected = max(seen, 1) / 256
    chi2 = float(((counts.double() - expected) ** 2 / expected).sum())
    return seen, bool(found), chi2


@pytest.mark.parametrize("encrypt", [True, False])
def test_swapped_activations_are_unreadable_at_rest(tmp_storage_dir: Path, encrypt: bool) -> None:
    model, x = _pattern_model()
    budget = _tight_budget(model, x, tmp_storage_dir)
    buffer = bytearray(1 << 20)
    with _manager(tmp_storage_dir, budget, encrypt_storage=encrypt) as mm, mm.step(model):
        out = model(x)
        (fd,) = _swap_fds("self", tmp_storage_dir)
        seen, found, chi2 = _scan(f"/proc/self/fd/{fd}", buffer)
        out.sum().backward()
    assert mm.report().bytes_out >= 2 << 20
    assert seen >= 2 << 20  # the scan really read swapped activations
    if encrypt:
        assert not found
        assert chi2 < CHI2_LIMIT
    else:  # the control: the same scan sees plaintext when sealing is off
        assert found
        assert chi2 > 100 * CHI2_LIMIT


def _engine_with_chunks(storage: Path) -> tuple[FileTransferEngine, torch.Tensor, list[Chunk]]:
    engine = FileTransferEngine(StorageTier(storage))
    data = torch.randint(0, 256, (3 * CHUNK_BYTES,), dtype=torch.uint8)
    return engine, data, split_into_chunks(data.numel(), CHUNK_BYTES)


def _file_bytes(engine: FileTransferEngine, chunk: Chunk) -> bytes:
    assert chunk.slot is not None
    return os.pread(engine.tier.fd, chunk.nbytes, chunk.slot)


@pytest.mark.parametrize("attack", ["flip", "stale", "swap"])
def test_modified_stale_or_swapped_extent_fails_authentication(
    tmp_storage_dir: Path, attack: str
) -> None:
    engine, data, chunks = _engine_with_chunks(tmp_storage_dir)
    storage = data.untyped_storage()
    expected = data.clone()
    engine.evict(storage, chunks).wait()
    data.zero_()
    engine.restore(storage, chunks).wait()
    assert torch.equal(data, expected)  # untouched extents open to the original bytes
    first, second = chunks[0], chunks[1]
    assert first.slot is not None and second.slot is not None
    if attack == "flip":
        os.pwrite(engine.tier.fd, bytes([_file_bytes(engine, first)[100] ^ 1]), first.slot + 100)
    elif attack == "stale":
        old = _file_bytes(engine, first)
        engine.release(chunks)
        engine.evict(storage, chunks).wait()  # same bytes, same extent (first fit), new seal
        assert first.slot is not None
        assert _file_bytes(engine, first) != old  # a fresh nonce: new ciphertext
        os.pwrite(engine.tier.fd, old, first.slot)
    else:
        a, b = _file_bytes(engine, first), _file_bytes(engine, second)
        os.pwrite(engine.tier.fd, b, first.slot)
        os.pwrite(engine.tier.fd, a, second.slot)
    with pytest.raises(SwapAuthenticationError, match="failed authentication"):
        engine.restore(storage, chunks).wait()
    assert not data[:CHUNK_BYTES].any()  # unauthenticated bytes are never handed out
    engine.close()


def test_extent_restored_as_another_chunk_fails_authentication(tmp_storage_dir: Path) -> None:
    engine, data, chunks = _engine_with_chunks(tmp_storage_dir)
    engine.evict(data.untyped_storage(), chunks).wait()
    other = torch.zeros_like(data)  # same sizes, same slots, another vTensor
    with pytest.raises(SwapAuthenticationError):
        engine.restore(other.untyped_storage(), chunks).wait()
    renumbered = [Chunk(c.index + 1, c.offset_bytes, c.nbytes, c.state, c.slot) for c in chunks]
    with pytest.raises(SwapAuthenticationError):
        engine.restore(data.untyped_storage(), renumbered).wait()
    engine.close()


def test_tampered_swap_file_stops_backward_instead_of_wrong_gradients(
    tmp_storage_dir: Path,
) -> None:
    model, x = _pattern_model()
    budget = _tight_budget(model, x, tmp_storage_dir)
    with _manager(tmp_storage_dir, budget) as mm:
        with pytest.raises(vtensor.VTensorError) as caught, mm.step(model):
            out = model(x)
            (fd,) = _swap_fds("self", tmp_storage_dir)
            size = os.fstat(fd).st_size
            os.pwrite(fd, os.urandom(size), 0)
            out.sum().backward()
    chain = [caught.value, caught.value.__cause__, caught.value.__context__]
    assert any(isinstance(e, SwapAuthenticationError) for e in chain)
    assert list(tmp_storage_dir.iterdir()) == []


def test_exception_in_step_leaves_no_file_descriptor_or_key(tmp_storage_dir: Path) -> None:
    model, x = _pattern_model()
    budget = _tight_budget(model, x, tmp_storage_dir)
    with pytest.raises(ValueError, match="boom"):
        with _manager(tmp_storage_dir, budget) as mm, mm.step(model):
            out = model(x)
            (fd,) = _swap_fds("self", tmp_storage_dir)
            assert os.fstat(fd).st_size > 0  # activations were swapped
            sealer = mm._store.engine.sealer  # type: ignore[union-attr]
            assert sealer is not None and sealer.sealed_segments > 0
            raise ValueError(f"boom {out.shape}")
    assert _swap_fds("self", tmp_storage_dir) == []
    assert list(tmp_storage_dir.iterdir()) == []
    assert sealer.sealed_segments == 0
    with pytest.raises(vtensor.VTensorError, match="key is gone"):
        sealer.open([], lambda offset, views: None)


def _train(model: nn.Module, manager: vtensor.MemoryManager | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for step in range(2):
        x = torch.randn(1024, 64, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        if manager is None:
            model(x).square().mean().backward()
        else:
            with manager.step(model, opt, inputs=(x,)):
                model(x).square().mean().backward()
            assert manager.report().bytes_out > 0
        grads += [p.grad.clone() for p in model.parameters() if p.grad is not None]
        opt.step()
    return grads


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)])


def test_gradients_identical_with_encryption_on_and_off(tmp_storage_dir: Path) -> None:
    x = torch.randn(1024, 64)
    budget = _tight_budget(_mlp(), x, tmp_storage_dir)
    reference = _train(_mlp(), None)
    for encrypt in (True, False):
        with _manager(tmp_storage_dir, budget, encrypt_storage=encrypt) as mm:
            got = _train(_mlp(), mm)
        assert len(got) == len(reference)
        assert all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))


CRASH_SCRIPT = r"""
import os, sys, time, torch, vtensor
from torch import nn

class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
    def forward(self, x):
        return x * self.scale

storage, budget = sys.argv[1], int(sys.argv[2])
pattern = torch.tensor([3.1415927, -2.7182817, 1.4142135, 0.5772157])
x = pattern.repeat(1024 * 256 // 4).reshape(1024, 256)
model = nn.Sequential(*[Scale() for _ in range(8)])
mm = vtensor.MemoryManager(budget, chunk_bytes=64 * 1024, storage_dir=storage)
with mm.step(model):
    out = model(x)
    print("READY", os.getpid(), flush=True)
    time.sleep(600)
"""


def test_killed_process_leaves_nothing_and_never_held_plaintext(tmp_storage_dir: Path) -> None:
    model, x = _pattern_model()
    budget = _tight_budget(model, x, tmp_storage_dir)
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASH_SCRIPT, str(tmp_storage_dir), str(budget)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline().split()
        assert ready[:1] == ["READY"], proc.stderr.read() if proc.stderr else ""
        pid = int(ready[1])
        assert pid == proc.pid
        (fd,) = _swap_fds(pid, tmp_storage_dir)
        assert list(tmp_storage_dir.iterdir()) == []  # no name, even while alive
        seen, found, chi2 = _scan(f"/proc/{pid}/fd/{fd}", bytearray(1 << 20))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert seen >= 2 << 20
    assert not found
    assert chi2 < CHI2_LIMIT
    assert list(tmp_storage_dir.iterdir()) == []
