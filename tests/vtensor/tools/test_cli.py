"""The command line (python -m vtensor plan / demo) and the timeline plot."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vtensor.activations.report import IterationReport, StepStats
from vtensor.planner.belady import plan_lgm
from vtensor.planner.trace import Phase, Trace, TraceStep, TraceTensor
from vtensor.tools import cli, workload
from vtensor.tools.timeline import phase_spans, plot_timeline

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
    assert 0 < _figure(out, "smallest feasible budget (planner)") <= budget
    assert _figure(out, "bytes to move per iteration (plan)") > 0
    assert _figure(out, "predicted peak") <= budget
    assert _figure(out, "measured peak") <= budget + 64 * 1024  # the budget holds to a chunk
    assert "plan source per iteration: profiled, planned" in out
    assert "loss: cross-entropy" in out
    assert "weights bit-identical to unmanaged training: True" in out
    assert re.search(r"\[\s*\d+\.\d+ s\] managed iteration 2/2", done.stderr)
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
    command += ["--steps", "3", "--offload-params"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    found = re.search(r"parameter-side tensors in the plan: (\d+)", out)
    assert found and int(found.group(1)) > 0, out
    # The first step creates the momentum, so the second is the one profiled and planned.
    assert "plan source per iteration: profiled, profiled, planned" in out
    assert "weights bit-identical to unmanaged training: True" in out


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


def _report(peaks_mib: list[float], moved_mib: list[float], source: str) -> IterationReport:
    phases = [Phase.OTHER] + [Phase.FORWARD] * 3 + [Phase.BACKWARD] * 3 + [Phase.OTHER]
    steps = tuple(
        StepStats(i, f"{p.value}:{i}", p, 0.01, int(m * 2**20), int(o * 2**20), 0, 0.0, 0.0)
        for i, (p, m, o) in enumerate(zip(phases, peaks_mib, moved_mib, strict=True))
    )
    top = max(s.peak_device_bytes for s in steps)
    return IterationReport(
        0,
        "planned",
        "chunk",
        source,
        "cpu",
        6 * 2**20,
        2**20,
        top,
        None,
        "rss-vmhwm",
        top,
        sum(s.bytes_out for s in steps),
        0,
        0.0,
        0.0,
        0.1,
        steps,
    )


def _trace() -> Trace:
    unmanaged_mib = [1, 1, 1, 3, 3, 1, 1, 1]
    steps = tuple(
        TraceStep(i, f"s{i}", Phase.FORWARD if i < 4 else Phase.BACKWARD, 0.01, 0, 0, u * 2**20)
        for i, u in enumerate(unmanaged_mib)
    )
    tensors = (TraceTensor(0, 4 * 2**20, ("float32",), 1, 2, (6,)),)
    return Trace(steps, tensors, 0, 2**20, 2**40, 2**20, "cpu")


def test_plot_timeline_writes_a_png_with_runs_budget_and_prediction(tmp_path: Path) -> None:
    runs = {
        "unmanaged": _report([1, 2, 4, 6, 7, 5, 3, 1], [0] * 8, "profiled"),
        "planned": _report([1, 2, 4, 5, 5, 5, 3, 1], [0, 0, 2, 0, 0, 0, 0, 0], "planned"),
    }
    trace = _trace()
    plan = plan_lgm(trace, 6 * 2**20)
    assert plan.moves
    path = plot_timeline(
        runs,
        6 * 2**20,
        tmp_path / "a" / "t.png",
        trace=trace,
        plan=plan,
        title="tiny, budget 6 MiB",
    )
    assert path.read_bytes().startswith(PNG_SIGNATURE)
    with pytest.raises(ValueError, match="at least one run"):
        plot_timeline({}, 1, tmp_path / "empty.png")


def test_phase_spans_groups_consecutive_phases() -> None:
    f, b, o = Phase.FORWARD, Phase.BACKWARD, Phase.OTHER
    assert phase_spans([o, f, f, b, b, b, o]) == [(o, 0, 0), (f, 1, 2), (b, 3, 5), (o, 6, 6)]
    assert phase_spans([]) == []


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
