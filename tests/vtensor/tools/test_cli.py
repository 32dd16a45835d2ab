"""The command line (python -m vtensor plan / demo) and the timeline plot."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.vtensor.tools.reports import MIB, lean, report, trace
from vtensor.planner.belady import plan_lgm
from vtensor.tools import cli, figures, plan_run, workload

REPO = Path(__file__).resolve().parents[3]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# Written into a module under tmp_path: tests/vtensor must never be on sys.path (its name would
# shadow the vtensor package).
TINY_MODELS = """
from torch import nn


def make_model():
    layers = []
    for _ in range(6):
        layers += [nn.Linear(256, 256), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(256, 10))


def make_blocks():
    blocks = [nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(6)]
    return nn.Sequential(*blocks, nn.Linear(256, 10))


def not_a_model():
    return 42
"""


@pytest.fixture
def tiny_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "tiny_models.py").write_text(TINY_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _figure(stdout: str, label: str) -> int:
    match = re.search(rf"^{re.escape(label)}: .*?\((\d+) bytes\)", stdout, re.MULTILINE)
    assert match, f"no {label!r} line in:\n{stdout}"
    return int(match.group(1))


def test_cli_plan_profiles_plans_replays_and_writes_plot_and_json(tiny_models: Path) -> None:
    png, out_json = tiny_models / "out" / "timeline.png", tiny_models / "figures.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tiny_models)])}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "vtensor", "plan", "tiny_models:make_model"]
    command += ["--batch-shape", "2048,256", "--fraction", "0.9", "--chunk-bytes", "64KiB"]
    command += ["--steps", "2", "--plot", str(png), "--json", str(out_json)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    peak, budget = _figure(out, "unmanaged peak"), _figure(out, "budget")
    assert budget == int(peak * 0.9)
    assert 0 < _figure(out, "smallest feasible budget (the manager's stated minimum)") <= budget
    assert out.count("smallest") == 1
    assert _figure(out, "bytes to move per iteration (plan)") > 0
    assert _figure(out, "predicted peak") <= budget
    assert _figure(out, "measured peak") <= budget + 64 * 1024  # the budget holds to a chunk
    assert "plan source per iteration: profiled, planned" in out
    assert "loss: cross-entropy" in out
    assert "weights bit-identical to unmanaged training: True" in out
    assert re.search(r"\[\s*\d+\.\d+ s\] managed iteration 1 \(2 of 2\)", done.stderr)
    assert png.read_bytes().startswith(PNG_SIGNATURE)
    figures = json.loads(out_json.read_text())
    assert figures["budget_bytes"] == budget
    assert figures["unmanaged_peak_bytes"] == peak
    assert [it["plan_source"] for it in figures["iterations"]] == ["profiled", "planned"]


def test_cli_plan_offload_params_plans_parameters_with_activations(tiny_models: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tiny_models)])}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "vtensor", "plan", "tiny_models:make_model"]
    command += ["--batch-shape", "512,256", "--fraction", "0.6", "--chunk-bytes", "64KiB"]
    command += ["--steps", "3", "--offload-params", "on"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    found = re.search(r"parameter-side tensors in the plan: (\d+)", out)
    assert found and int(found.group(1)) > 0, out
    # The first step creates the momentum, so the second is the one profiled and planned.
    assert "plan source per iteration: profiled, profiled, planned" in out
    assert "weights bit-identical to unmanaged training: True" in out


def _outcome(**changes: object) -> plan_run.Outcome:
    """A managed run of four iterations: profiled, a full replay, two lean replays."""
    full = report([1, 2, 4, 5, 5, 5, 3, 1], [0, 0, 2, 0, 0, 0, 0, 0], "planned", iteration=1)
    full = dataclasses.replace(full, wall_s=0.4, stall_s=0.03, predicted_stall_s=0.01)
    steady = (lean(full, 2, wall_s=0.21, stall_s=0.02), lean(full, 3, wall_s=0.19, stall_s=0.02))
    profiled = report([1, 2, 4, 5, 5, 5, 3, 1], [0] * 8, "profiled", min_budget_bytes=5 * MIB)
    plan = plan_lgm(trace(), 6 * MIB)
    plan = dataclasses.replace(plan, predicted_step_s=0.18, recompute=("blocks.1", "blocks.3"))
    made = plan_run.Outcome(
        unmanaged_peak_bytes=8 * MIB,
        unmanaged=report([1, 2, 4, 6, 7, 5, 3, 1], [0] * 8, "profiled"),
        unmanaged_trace=trace(),
        plain_step_s=0.1,
        budget_bytes=6 * MIB,
        min_budget_bytes=5 * MIB,
        managed=(profiled, full, *steady),
        managed_step_s=(0.9, 0.5, 0.26, 0.24),
        param_bytes_moved=(0, 0, 0, 0),
        trace=trace(),
        plan=plan,
        params_offloaded=False,
        weights_identical=True,
        failure=None,
    )
    return dataclasses.replace(made, **changes)  # type: ignore[arg-type]


def test_cli_summary_states_one_minimum_the_step_against_plain_and_the_prediction(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = cli.build_parser().parse_args(["plan", "m", "--batch-shape", "8,256", "--recompute"])
    s = figures.summary(_outcome())
    figures.print_summary(s, args, "cross-entropy")
    out = capsys.readouterr().out
    # One smallest budget: the manager's stated minimum, not the planner's or a reactive run's.
    assert out.count("smallest") == 1
    assert _figure(out, "smallest feasible budget (the manager's stated minimum)") == 5 * MIB
    assert s["min_budget_bytes"] == 5 * MIB
    # The steady iterations (the lean replays) against the plain step of the same process.
    assert s["managed_step_s"] == pytest.approx(0.25)
    assert s["overhead"] == pytest.approx(2.5)
    assert "managed 0.2500 s, plain 0.1000 s: 2.50x" in out
    # The calibrated model's step beside the manager's own measure of the step it predicts.
    assert "step inside the manager: 0.2000 s measured, 0.1800 s predicted" in out
    assert "waits for transfers: 0.0200 s measured, 0.0100 s predicted" in out
    assert "recomputed in backward (the replayed plan): blocks.1, blocks.3" in out


def test_cli_summary_without_recompute_says_how_to_allow_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = cli.build_parser().parse_args(["plan", "m", "--batch-shape", "8,256"])
    plan = _outcome().plan
    assert plan is not None
    figures.print_summary(
        figures.summary(_outcome(plan=dataclasses.replace(plan, recompute=()))), args, ""
    )
    assert "recomputed in backward: off (--recompute allows it)" in capsys.readouterr().out


def test_plan_run_plain_step_leaves_out_the_cold_first_step() -> None:
    assert plan_run.warm_median([3.5, 0.05, 0.04, 0.06]) == 0.05
    assert plan_run.warm_median([0.7]) == 0.7  # nothing else to take


def test_cli_plan_passes_recompute_offload_params_and_masks_to_the_manager(
    tiny_models: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    made: list[dict[str, object]] = []
    real = plan_run.MemoryManager

    def recording(*args: Any, **kwargs: Any) -> plan_run.MemoryManager:
        made.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(plan_run, "MemoryManager", recording)
    words = ["plan", "tiny_models:make_blocks", "--batch-shape", "1024,256", "--fraction", "0.7"]
    words += ["--chunk-bytes", "64KiB", "--steps", "4", "--recompute"]
    words += ["--offload-params", "off", "--encode-masks", "auto"]
    assert cli.main(words) == 0
    managed = made[-1]
    assert managed["recompute"] is True
    assert managed["offload_params"] is False
    assert managed["encode_masks"] == "auto"
    out = capsys.readouterr().out
    assert re.search(r"^recomputed in backward \(the replayed plan\): \S", out, re.MULTILINE), out
    assert "parameters, gradients and optimizer state: in memory (--offload-params off)" in out


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        (["--budget", "12parsecs"], "KiB/MiB/GiB/TiB"),
        (["--fraction", "1.5"], "not a fraction"),
        (["--chunk-bytes", "-1"], "chunk_bytes='-1'"),
    ],
)
def test_cli_plan_rejects_a_malformed_size_with_the_accepted_forms(
    words: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "cnn", "--batch-shape", "2,3,8,8", *words])
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize(
    ("model", "shape", "expected"),
    [
        ("no_such_module_xyz:make", "4,256", "cannot import 'no_such_module_xyz'"),
        ("tiny_models:missing", "4,256", "has no callable 'missing'"),
        ("tiny_models:not_a_model", "4,256", "returned int, not an nn.Module"),
        ("tiny_models:make_model", "4,3", "the model failed on a batch of shape (4, 3)"),
        ("tiny_models:make_model", "4,x", "is not a shape"),
        ("no_such_zoo_model", "4,256", "is not in the zoo"),
        ("cnn", "4,256", "fits no zoo data"),
    ],
)
def test_cli_plan_rejects_a_bad_model_or_shape_in_one_line(
    tiny_models: Path, model: str, shape: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", model, "--batch-shape", shape])
    assert exit_info.value.code == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert expected in last_line


def test_cli_zoo_builder_makes_the_named_model() -> None:
    model = cli.load_builder("cnn", (2, 3, 16, 16), None)()
    assert isinstance(model, torch.nn.Module)


def test_cli_training_loss_is_cross_entropy_on_logits_else_mean_square() -> None:
    logits, tokens = torch.randn(4, 7, 12), torch.randint(0, 12, (4, 7))
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 12), tokens.reshape(-1))
    assert torch.equal(workload.training_loss(logits, tokens, 12), expected)
    features = torch.randn(4, 3)
    assert torch.equal(
        workload.training_loss(features, torch.zeros(4), 10), features.square().mean()
    )


def test_cli_without_subcommand_runs_the_demo(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(cli.demo, "main", lambda argv: calls.append(list(argv)) or 0)
    assert cli.main([]) == 0
    assert cli.main(["--steps", "1"]) == 0
    assert cli.main(["demo", "--fraction", "0.4"]) == 0
    assert calls == [[], ["--steps", "1"], ["--fraction", "0.4"]]


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        (["--budget", "abc"], "budget='abc' is not a size"),
        (["demo", "--fraction", "2"], "not a fraction"),
        (["--chunk-bytes", "big"], "chunk_bytes='big'"),
    ],
)
def test_cli_demo_rejects_bad_values_before_training(
    words: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(words)
    assert exit_info.value.code == 2
    err = capsys.readouterr()
    assert expected in err.err and "Traceback" not in err.err
    assert "unmanaged peak" not in err.out  # nothing was trained


@pytest.mark.parametrize("words", [["--help"], ["demo", "--help"], ["plan", "--help"]])
def test_cli_help_names_the_command_and_shows_no_markup(
    words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        cli.main(words)
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m vtensor")
    assert "__main__.py" not in out and "``" not in out


def test_cli_demo_and_plan_exit_alike_on_an_infeasible_budget(
    capsys: pytest.CaptureFixture[str],
) -> None:
    demo_code = cli.main(["--budget", "4KiB", "--steps", "1", "--batch-size", "2"])
    plan_code = cli.main(["plan", "cnn", "--batch-shape", "2,1,28,28", "--budget", "4KiB"])
    assert demo_code == plan_code == cli.EXIT_INFEASIBLE == 3
    assert capsys.readouterr().err.count("error: ") == 2
