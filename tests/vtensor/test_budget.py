"""Budgets as users give them: bytes, a share of the unmanaged peak, or what the device can give."""

from pathlib import Path

import pytest
import torch
from torch import nn

import vtensor
from vtensor import budget as budgets
from vtensor.budget import BudgetKind, device_budget, parse_budget, share_of_peak
from vtensor.errors import BudgetFormatError

MIB = 1 << 20


def test_parse_budget_accepts_bytes_shares_and_auto() -> None:
    assert parse_budget("64MiB") == budgets.BudgetSpec(BudgetKind.BYTES, nbytes=64 * MIB)
    assert parse_budget(1000).nbytes == 1000
    assert parse_budget("50%") == budgets.BudgetSpec(BudgetKind.PEAK_SHARE, peak_fraction=0.5)
    assert parse_budget(" 100 %").peak_fraction == 1.0
    assert parse_budget("auto").kind is BudgetKind.DEVICE
    assert parse_budget("AUTO").kind is BudgetKind.DEVICE


@pytest.mark.parametrize("value", ["150%", "0%", "-5%", "%", "abc%", "nan%", "abc", "0", -1])
def test_parse_budget_names_the_value_and_the_forms(value: object) -> None:
    with pytest.raises(BudgetFormatError) as err:
        parse_budget(value)  # type: ignore[arg-type]
    message = str(err.value)
    assert repr(value) in message and "'auto'" in message and "%" in message


def test_share_of_peak_rounds_down_to_a_quantum_of_at_most_1_128() -> None:
    peak = 64 * MIB + 12345
    share = share_of_peak(0.4, peak)
    assert int(0.4 * peak) * (1 - 1 / 128) <= share <= int(0.4 * peak)
    assert share_of_peak(0.4, peak + 1000) == share  # a few KiB apart: the same budget


def _cgroup(tmp: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp / name).write_text(text)
    return tmp


def test_auto_reads_the_cgroup_v2_limit_less_its_usage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _cgroup(tmp_path, {"memory.max": str(512 * MIB), "memory.current": str(112 * MIB)})
    monkeypatch.setattr(budgets, "_cgroup_dir", lambda: folder)
    nbytes, source = device_budget(torch.device("cpu"), held_bytes=10 * MIB) or (0, "")
    assert nbytes == int(400 * MIB * (1 - budgets.AUTO_MARGIN)) + 10 * MIB
    assert "memory.max" in source and "10%" in source


def test_auto_reads_the_cgroup_v1_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = {"memory.limit_in_bytes": str(256 * MIB), "memory.usage_in_bytes": str(56 * MIB)}
    monkeypatch.setattr(budgets, "_cgroup_dir", lambda: _cgroup(tmp_path, files))
    nbytes, source = device_budget(torch.device("cpu"), held_bytes=0) or (0, "")
    assert nbytes == int(200 * MIB * (1 - budgets.AUTO_MARGIN)) and "limit_in_bytes" in source


def test_auto_without_a_cgroup_limit_reads_mem_available(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _cgroup(tmp_path, {"memory.max": "max", "memory.current": str(MIB)})
    monkeypatch.setattr(budgets, "_cgroup_dir", lambda: folder)
    _, source = device_budget(torch.device("cpu"), held_bytes=0) or (0, "")
    assert "MemAvailable" in source


def _model_and_batch() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.GELU(), nn.Conv2d(16, 16, 3, padding=1), nn.GELU()
    )
    return model, torch.randn(8, 3, 48, 48)


def _train(manager: vtensor.MemoryManager | None, steps: int = 4) -> nn.Module:
    model, x = _model_and_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        optimizer.zero_grad()
        if manager is None:
            model(x).square().mean().backward()
        else:
            with manager.step(model, optimizer, inputs=(x,)):
                model(x).square().mean().backward()
        optimizer.step()
    return model


def test_a_share_of_the_peak_resolves_from_the_profiled_trace_and_holds(tmp_path: Path) -> None:
    with vtensor.MemoryManager("70%", storage_dir=tmp_path) as manager:
        trained = _train(manager)
        reports = manager.reports
    first, later = reports[0], reports[1:]
    assert "profiled iteration, for 70%" in first.budget_source
    # The share is of the trace's peak plus the optimizer state the first step creates.
    momentum = sum(p.numel() * p.element_size() for p in trained.parameters())
    assert manager.budget_bytes <= 0.7 * (first.peak_device_bytes + momentum)
    for report in later:
        assert report.budget_source.startswith("70% of the unmanaged peak")
        assert report.budget_bytes == manager.budget_bytes
        assert report.peak_device_bytes <= report.budget_bytes + vtensor.DEFAULT_CHUNK_BYTES
    assert sum(r.bytes_out for r in later) > 0
    reference = _train(None)
    for mine, theirs in zip(trained.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_auto_resolves_at_the_first_step_and_reports_its_source(tmp_path: Path) -> None:
    with vtensor.MemoryManager("auto", storage_dir=tmp_path) as manager:
        _train(manager, steps=2)
        assert manager.unmanaged_peak_bytes is not None
        assert 0 < manager.unmanaged_peak_bytes < manager.budget_bytes
    assert manager.report().budget_source.startswith("auto: ")


def test_auto_where_nothing_can_be_read_names_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(budgets, "device_memory", lambda device: None)
    with (
        vtensor.MemoryManager("auto", storage_dir=tmp_path) as manager,
        pytest.raises(BudgetFormatError, match="give the budget in bytes"),
    ):
        _train(manager, steps=1)


def test_a_share_of_the_peak_needs_the_planned_policy() -> None:
    with pytest.raises(BudgetFormatError, match="policy='planned'"):
        vtensor.MemoryManager("50%", policy="reactive")


def test_the_unmanaged_peak_from_the_trace_is_what_an_unmanaged_step_holds(tmp_path: Path) -> None:
    model, x = _model_and_batch()

    def steps(manager: vtensor.MemoryManager) -> None:
        for _ in range(2):
            with manager.step(model, inputs=(x,)):
                model(x).square().mean().backward()
            model.zero_grad(set_to_none=True)

    with vtensor.MemoryManager("1TiB", storage_dir=tmp_path) as unlimited:
        steps(unlimited)
    assert unlimited.unmanaged_peak_bytes == unlimited.reports[0].peak_device_bytes
    with vtensor.MemoryManager("70%", storage_dir=tmp_path) as managed:
        steps(managed)
    # Under a budget that binds, the trace still knows what the step would have held: what the
    # unlimited manager's second step held (the first also holds torch's one-time allocations).
    assert managed.reports[1].bytes_out > 0
    held = unlimited.reports[1].peak_device_bytes
    assert managed.unmanaged_peak_bytes is not None
    assert abs(managed.unmanaged_peak_bytes - held) <= 0.02 * held, (
        managed.unmanaged_peak_bytes,
        held,
    )
