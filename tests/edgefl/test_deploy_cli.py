"""The ``edgefl`` command line without Flower processes: help texts, one-line errors, formats."""

import argparse
import io
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from flwr.cli.flower_config import read_superlink_connection
from flwr.common.config import parse_config_args

from edgefl.deploy import submit
from edgefl.deploy.cli import build_parser, main
from edgefl.deploy.commands import CONNECTION, config_arg, flower_env, superlink_argv
from edgefl.deploy.connection import write_connection
from edgefl.deploy.errors import DeployError
from edgefl.deploy.pki import TlsFiles
from edgefl.deploy.processes import FilteredEcho, announce_superlink, below_level


@pytest.fixture
def deploy_dir(tmp_path: Path) -> Path:
    """A deploy folder made by ``edgefl certs --nodes 1``."""
    assert main(["certs", "--dir", str(tmp_path / "d"), "--nodes", "1"]) == 0
    return tmp_path / "d"


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port something listens on."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock.getsockname()[1]


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``edgefl argv``: it must exit 2 with exactly one ``edgefl: error:`` line."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("edgefl: error: ")
    return err


def _client(deploy_dir: Path, *extra: str) -> list[str]:
    return [
        "client",
        "--dir",
        str(deploy_dir),
        "--plan-cache",
        str(deploy_dir / "cache"),
        "--partition-id",
        "0",
        "--num-partitions",
        "2",
        *extra,
    ]


def test_every_option_of_every_command_has_help() -> None:
    parser = build_parser()
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    commands = subparsers[0].choices
    assert set(commands) == {"certs", "keys", "server", "register", "client", "run"}
    for name, sub in commands.items():
        for action in sub._actions:
            assert action.help and action.help != argparse.SUPPRESS, (name, action.dest)


def test_certs_lists_every_file_it_wrote_private_keys_marked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deploy = tmp_path / "d"
    assert main(["certs", "--dir", str(deploy), "--nodes", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    written = {p for p in deploy.rglob("*") if p.is_file()}
    assert len(lines) == len(written) == 6
    for path in written:
        (line,) = [x for x in lines if x.split()[2] == str(path)]
        private = path.name in ("ca.key", "server.key", "node-1")
        assert ("private key, mode 0600" in line) == private, line
        assert path.stat().st_mode & 0o777 == (0o600 if private else 0o644)


def test_keys_lists_both_files_of_each_pair(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["keys", "--dir", str(tmp_path), "node-7"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [x.split()[2] for x in lines] == [
        str(tmp_path / "nodes" / "node-7.pub"),
        str(tmp_path / "nodes" / "node-7"),
    ]
    assert "register it" in lines[0] and "private key, mode 0600" in lines[1]


def test_certs_then_certs_again_refuses_to_overwrite(
    deploy_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (deploy_dir / "nodes" / "node-1").is_file()
    err = _error(capsys, ["certs", "--dir", str(deploy_dir)])
    assert "--force" in err and "ca.crt" in err


def test_server_without_tls_material_names_certs_and_insecure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _error(capsys, ["server", "--dir", str(tmp_path / "empty")])
    assert "edgefl certs" in err and "--insecure" in err


def test_server_with_a_missing_certificate_names_it(
    deploy_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (deploy_dir / "server.pem").unlink()
    err = _error(capsys, ["server", "--dir", str(deploy_dir)])
    assert "server.pem does not exist" in err and "edgefl certs" in err


def test_server_on_a_port_in_use_says_pick_another(
    deploy_dir: Path, busy_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _error(capsys, ["server", "--dir", str(deploy_dir), "--port", str(busy_port)])
    assert f"port {busy_port} on 127.0.0.1 is in use" in err and "--port" in err


def test_client_with_a_malformed_budget_names_the_value(
    deploy_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = str(deploy_dir / "nodes" / "node-1")
    err = _error(capsys, _client(deploy_dir, "--budget", "64MX", "--key", key))
    assert "'64MX'" in err and "256MiB" in err  # the value, and the forms that work


def test_client_with_an_unreadable_key_says_how_to_make_one(
    deploy_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    garbage = deploy_dir / "garbage"
    garbage.write_text("not a key\n")
    err = _error(capsys, _client(deploy_dir, "--budget", "64MiB", "--key", str(garbage)))
    assert str(garbage) in err and "edgefl keys" in err


def test_client_without_key_asks_for_key_or_insecure(
    deploy_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _error(capsys, _client(deploy_dir, "--budget", "64MiB"))
    assert "--key" in err and "--insecure" in err


def test_client_on_a_local_port_in_use_says_pick_another(
    deploy_dir: Path, busy_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    key = str(deploy_dir / "nodes" / "node-1")
    argv = _client(deploy_dir, "--budget", "64MiB", "--key", key, "--local-port", str(busy_port))
    assert "--local-port" in _error(capsys, argv)


def test_register_without_a_superlink_says_start_one(
    deploy_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        free = sock.getsockname()[1]
    pub = str(deploy_dir / "nodes" / "node-1.pub")
    argv = ["register", "--dir", str(deploy_dir), "--superlink", f"127.0.0.1:{free}", pub]
    assert "edgefl server" in _error(capsys, argv)


def test_run_config_is_typed_like_the_app_defaults(tmp_path: Path) -> None:
    defaults = submit.app_run_config(submit.default_app_dir())
    config = submit.build_run_config(
        defaults, ["experiment=smoke", 'overrides="seed=7 train.lr=0.1"'], 2, tmp_path / "out"
    )
    assert config == {
        "experiment": "smoke",
        "overrides": "seed=7 train.lr=0.1",
        "num-server-rounds": 2,
        "output-dir": str((tmp_path / "out").resolve()),
    }
    with pytest.raises(DeployError, match="experiment"):  # the error lists the valid keys
        submit.build_run_config(defaults, ["no-such-key=1"])
    with pytest.raises(DeployError, match="number"):
        submit.build_run_config(defaults, ["num-server-rounds=two"])


def test_config_arg_survives_flowers_parser() -> None:
    values: dict[str, str | int] = {
        "memory-budget": "64MiB",
        "plan-cache-dir": "/tmp/a folder/with 'quote",
        "data-dir": "C:\\data\\mnist",
        "partition-id": 3,
    }
    assert parse_config_args([config_arg(values)]) == values


def test_connection_is_read_back_by_flower(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ca = tmp_path / "ca.crt"
    write_connection(tmp_path / "home", "10.0.0.5:9092", ca)
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "home"))
    conn = read_superlink_connection(CONNECTION)
    assert conn.address == "10.0.0.5:9092" and conn.root_certificates == str(ca.resolve())
    assert read_superlink_connection(None).name == CONNECTION  # the default connection
    write_connection(tmp_path / "home", "127.0.0.1:9092", None)
    assert read_superlink_connection(CONNECTION).insecure


def test_superlink_has_tls_and_node_auth_unless_insecure(tmp_path: Path) -> None:
    env = flower_env(tmp_path)
    secure = superlink_argv(env, "0.0.0.0", 9092, TlsFiles.in_dir(tmp_path), None)
    assert "--enable-supernode-auth" in secure and "--insecure" not in secure
    assert "--ssl-certfile" in secure and "--disable-runtime-dependency-installation" in secure
    insecure = superlink_argv(env, "0.0.0.0", 9092, None, None)
    assert "--insecure" in insecure and "--enable-supernode-auth" not in insecure
    assert env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] == "1"


def test_a_node_says_it_waits_for_a_missing_superlink_and_when_it_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as probe:  # a port nothing listens on (yet)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        address = f"127.0.0.1:{port}"
        own = logging.getLogger("edgefl")
        if not own.propagate:  # configure_logging gives edgefl its own handler
            own.addHandler(caplog.handler)
        try:
            with caplog.at_level(logging.INFO, logger="edgefl.deploy.processes"):
                watcher = announce_superlink(address, poll_s=0.05)
                assert watcher is not None
                assert f"waiting for the SuperLink at {address}" in caplog.text
                probe.listen()
                watcher.join(timeout=10)
        finally:
            own.removeHandler(caplog.handler)
    assert not watcher.is_alive()
    assert f"the SuperLink at {address} answers" in caplog.text


def test_flower_processes_log_at_the_chosen_level_and_poll_often(tmp_path: Path) -> None:
    env = flower_env(tmp_path)
    assert env["FLWR_LOG_LEVEL"] == "WARNING"  # as a simulation: Flower's INFO lines hidden
    assert float(env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"]) < 1.0  # Flower's default: 1 s
    assert flower_env(tmp_path, flower_log_level="info")["FLWR_LOG_LEVEL"] == "INFO"
    args = build_parser().parse_args(["client", "--budget", "1MiB", "--plan-cache", "p",
                                      "--partition-id", "0", "--num-partitions", "1",
                                      "--flower-log-level", "info"])  # fmt: skip
    assert args.flower_log_level == "INFO"
    quiet, verbose = below_level("WARNING"), below_level("INFO")
    uvicorn = "INFO:     Started server process [14310]"
    installed = "Successfully installed edgefl to /tmp/apps/edgefl.0.1.0."
    assert quiet(uvicorn) and quiet(installed) and not quiet("WARNING :   Option `--insecure`")
    assert not verbose(uvicorn) and not verbose(installed)


def test_flowers_exit_report_is_held_until_edgefl_knows_its_cause() -> None:
    out = io.StringIO()
    echo = FilteredEcho(out, lambda line: "retrying" in line)
    for line in (
        "\x1b[93mWARNING \x1b[0m:   Connection attempt failed, retrying in 0.56 seconds\n",
        "edgefl's own line\n",
        "\x1b[91mERROR \x1b[0m:     Exit Code: 305\n",
        "[code: 2004] Failed to activate SuperNode.\n",
    ):
        echo.write(line)
    assert out.getvalue() == "edgefl's own line\n"
    echo.discard()  # a known cause: edgefl says it in one line instead
    assert out.getvalue() == "edgefl's own line\n"
    echo.write("ERROR :     Exit Code: 1\n")
    echo.release()  # an unknown one: Flower's report is shown
    assert out.getvalue().endswith("Exit Code: 1\n")
