"""The ``edgefl`` command line: parse options, call the deploy step, turn mistakes into one line."""

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from edgefl.deploy import actions, submit
from edgefl.deploy.commands import DEFAULT_FLOWER_LOG_LEVEL, FLOWER_LOG_LEVELS
from edgefl.deploy.errors import DeployError
from edgefl.deploy.pki import CA_CERT, MaterialFile, TlsFiles
from edgefl.errors import EdgeFLError
from edgefl.log_setup import configure_logging

logger = logging.getLogger("edgefl.deploy.cli")
DEFAULT_DIR = Path("edgefl-deploy")
DEFAULT_SUPERLINK = "127.0.0.1:9092"
DEFAULT_LOCAL_PORT = 9094
EXIT_USAGE = 2  # argparse's code for a bad command line; edgefl uses it for every input mistake


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``edgefl COMMAND [options]``; return the exit code."""
    args = build_parser().parse_args(argv)
    configure_logging()
    try:
        code: int = args.handler(args)
        return code
    except EdgeFLError as exc:
        print(f"edgefl: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``edgefl`` and its subcommands (every option has a help text)."""
    parser = argparse.ArgumentParser(
        prog="edgefl",
        description="Deploy edgefl: a SuperLink (server) and SuperNodes (devices) with TLS and "
        "node authentication. Typical order: certs, server, register, client (per device), run.",
    )
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")

    certs = _command(commands, "certs", "make the CA, the SuperLink certificate and node keys")
    certs.add_argument(
        "--san",
        action="append",
        default=[],
        metavar="HOST",
        help="another DNS name or IP address devices reach the SuperLink at (repeatable), "
        "e.g. its LAN address 192.168.1.20; localhost, 127.0.0.1 and ::1 are always included",
    )
    certs.add_argument(
        "--nodes", type=int, default=0, metavar="N", help="also make key pairs node-1..node-N"
    )
    _force(certs)
    certs.set_defaults(handler=_certs)

    keys = _command(commands, "keys", "make SuperNode key pairs (ECDSA P-384, OpenSSH format)")
    keys.add_argument("names", nargs="+", metavar="NAME", help="node names, e.g. node-3")
    _force(keys)
    keys.set_defaults(handler=_keys)

    server = _command(commands, "server", "run the SuperLink (TLS + node authentication)")
    server.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; 0.0.0.0 for devices on the network (default: %(default)s)",
    )
    server.add_argument(
        "--port", type=int, default=9092, help="port to listen on (default: %(default)s)"
    )
    server.add_argument(
        "--database",
        type=Path,
        help="SuperLink state file, keeping registered nodes across restarts "
        "(default: DIR/superlink.db)",
    )
    server.add_argument(
        "--ready-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long to wait for the SuperLink to listen (default: %(default)s)",
    )
    _flwr_home(server, "DIR/flwr-home")
    _insecure(server)
    _flower_log_level(server)
    server.set_defaults(handler=_server)

    reg = _command(commands, "register", "allow SuperNode public keys to join the SuperLink")
    reg.add_argument("public_keys", nargs="+", type=Path, metavar="KEY.pub", help="public keys")
    _superlink(reg)
    _ca(reg)
    _flwr_home(reg, "DIR/flwr-home")
    reg.set_defaults(handler=_register)

    client = _command(commands, "client", "run a SuperNode (a device) with its memory budget")
    client.add_argument(
        "--budget",
        required=True,
        help="memory budget for training, e.g. 64MiB, 4000000 (bytes), 80%% of the "
        "model's unmanaged peak, or auto (what the device can give: the cgroup's limit, else "
        "MemAvailable, less a 10%% margin)",
    )
    client.add_argument(
        "--plan-cache", type=Path, required=True, help="folder for vtensor's cached plans"
    )
    client.add_argument(
        "--data", type=Path, help="folder of this device's dataset files (default: installed)"
    )
    client.add_argument(
        "--partition-id", type=int, required=True, help="this device's data partition (0-based)"
    )
    client.add_argument(
        "--num-partitions", type=int, required=True, help="how many partitions the data has"
    )
    client.add_argument("--key", type=Path, help="this node's private key (from edgefl keys)")
    client.add_argument("--device-class", help="a name for this kind of device, in the results")
    client.add_argument(
        "--local-port",
        type=int,
        default=DEFAULT_LOCAL_PORT,
        help="loopback port of this SuperNode's ClientApp API; each client on one machine "
        "needs its own (default: %(default)s)",
    )
    _superlink(client)
    _ca(client)
    _flwr_home(client, "DIR/supernode-LOCAL_PORT")
    _insecure(client)
    _flower_log_level(client)
    client.set_defaults(handler=_client)

    run = _command(commands, "run", "run the edgefl app on the SuperLink and stream its logs")
    run.add_argument(
        "-c",
        "--run-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a [tool.flwr.app.config] value (repeatable), e.g. -c experiment=smoke",
    )
    run.add_argument("--rounds", type=int, help="number of rounds (run config num-server-rounds)")
    run.add_argument("--output-dir", type=Path, help="results folder, on the SuperLink's machine")
    run.add_argument(
        "--app",
        type=Path,
        default=submit.default_app_dir(),
        help="the Flower app folder (default: the edgefl checkout, %(default)s)",
    )
    _superlink(run)
    _ca(run)
    _flwr_home(run, "DIR/flwr-home")
    _insecure(run)
    _flower_log_level(run)
    run.set_defaults(handler=_run)
    return parser


def _command(
    commands: "argparse._SubParsersAction[argparse.ArgumentParser]", name: str, text: str
) -> argparse.ArgumentParser:
    sub = commands.add_parser(name, help=text, description=text)
    sub.add_argument(
        "--dir",
        type=Path,
        default=DEFAULT_DIR,
        help="deploy folder with ca.crt, server.pem/.key and nodes/ (default: %(default)s)",
    )
    return sub


def _force(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true", help="replace existing files")


def _insecure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="no TLS and no node authentication: for local tests only",
    )


def _flower_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--flower-log-level",
        type=str.upper,
        choices=FLOWER_LOG_LEVELS,
        default=DEFAULT_FLOWER_LOG_LEVEL,
        help="level of Flower's own log lines in the processes this command starts "
        "(default: %(default)s, as a simulation's; INFO shows what -c debug=verbose shows "
        "of a simulation)",
    )


def _superlink(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--superlink",
        default=DEFAULT_SUPERLINK,
        metavar="HOST:PORT",
        help="the SuperLink's address, as named in its certificate (default: %(default)s)",
    )


def _ca(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ca", type=Path, help=f"the CA certificate (default: DIR/{CA_CERT})")


def _flwr_home(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--flwr-home", type=Path, help=f"Flower's state folder (FLWR_HOME; default: {default})"
    )


def _ca_cert(args: argparse.Namespace) -> Path | None:
    if getattr(args, "insecure", False):
        return None
    return Path(args.ca or args.dir / CA_CERT)


def _home(args: argparse.Namespace, name: str) -> Path:
    return Path(args.flwr_home or args.dir / name)


def _certs(args: argparse.Namespace) -> int:
    _list_written(actions.make_certs(args.dir, args.san, args.nodes, args.force))
    return 0


def _keys(args: argparse.Namespace) -> int:
    _list_written(actions.make_keys(args.dir, args.names, args.force))
    return 0


def _list_written(files: list[MaterialFile]) -> None:
    """One line per file written; a private key says so, with its mode as it is on disk."""
    for f in files:
        mode = f"private key, mode {f.path.stat().st_mode & 0o777:04o}; " if f.private else ""
        print(f"edgefl: wrote {f.path} ({mode}{f.purpose})")


def _server(args: argparse.Namespace) -> int:
    if not args.insecure and not (args.dir / CA_CERT).exists():
        raise DeployError(
            f"no TLS material in {args.dir}: create it with: edgefl certs --dir {args.dir} "
            "(or pass --insecure for a local test without TLS)"
        )
    opts = actions.ServerOptions(
        host=args.host,
        port=args.port,
        tls=None if args.insecure else TlsFiles.in_dir(args.dir),
        database=args.database or args.dir / "superlink.db",
        flwr_home=_home(args, "flwr-home"),
        ready_timeout_s=args.ready_timeout,
        flower_log_level=args.flower_log_level,
    )
    if opts.database is not None:
        opts.database.parent.mkdir(parents=True, exist_ok=True)
    return actions.serve(opts)


def _register(args: argparse.Namespace) -> int:
    ca = _ca_cert(args)
    assert ca is not None  # register has no --insecure: node authentication needs TLS
    return actions.register(args.public_keys, args.superlink, ca, _home(args, "flwr-home"))


def _client(args: argparse.Namespace) -> int:
    if not args.insecure and args.key is None:
        raise DeployError(
            "pass --key with this device's private key (edgefl keys NAME writes DIR/nodes/NAME), "
            "or --insecure for a local test without TLS"
        )
    opts = actions.ClientOptions(
        superlink=args.superlink,
        budget=args.budget,
        plan_cache=args.plan_cache,
        partition_id=args.partition_id,
        num_partitions=args.num_partitions,
        ca_cert=_ca_cert(args),
        private_key=None if args.insecure else args.key,
        local_port=args.local_port,
        flwr_home=_home(args, f"supernode-{args.local_port}"),
        data=args.data,
        device_class=args.device_class,
        flower_log_level=args.flower_log_level,
    )
    return actions.client(opts)


def _run(args: argparse.Namespace) -> int:
    config = submit.build_run_config(
        submit.app_run_config(args.app), args.run_config, args.rounds, args.output_dir
    )
    home = _home(args, "flwr-home")
    return submit.submit(
        args.app, args.superlink, _ca_cert(args), home, config, args.flower_log_level
    )


if __name__ == "__main__":
    sys.exit(main())
