"""What ``edgefl certs/keys/server/register/client`` do, checked before any process starts."""

import ipaddress
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509

from edgefl.deploy import pki
from edgefl.deploy.commands import (
    DEFAULT_FLOWER_LOG_LEVEL,
    ConfigValue,
    flower_env,
    register_argv,
    superlink_argv,
    supernode_argv,
)
from edgefl.deploy.connection import write_connection
from edgefl.deploy.errors import DeployError
from edgefl.deploy.processes import (
    RETRYING,
    UNAVAILABLE,
    FilteredEcho,
    FlowerProcess,
    SuperLinkWatch,
    below_level,
    check_port_free,
    check_reachable,
    connection_failed,
    format_address,
    parse_address,
)
from edgefl.errors import ConfigError

logger = logging.getLogger(__name__)
# How Flower 1.42 reports a SuperNode whose key the SuperLink does not know ([code: 2004]), or
# one that brought no key to a SuperLink with node authentication ([code: 2001]).
REFUSED_MARKERS = ("Failed to activate SuperNode", "All SuperNodes must be registered")
TLS_FAILED = "CERTIFICATE_VERIFY_FAILED"  # the SuperLink's certificate did not verify


@dataclass(frozen=True)
class ServerOptions:
    """Where the SuperLink listens, its TLS material (None: --insecure) and its state."""

    host: str
    port: int
    tls: pki.TlsFiles | None
    database: Path | None
    flwr_home: Path
    ready_timeout_s: float = 60.0
    flower_log_level: str = DEFAULT_FLOWER_LOG_LEVEL


@dataclass(frozen=True)
class ClientOptions:
    """A device's SuperNode: how it reaches the SuperLink and what its node config says."""

    superlink: str
    budget: str
    plan_cache: Path
    partition_id: int
    num_partitions: int
    ca_cert: Path | None  # None with private_key None: --insecure
    private_key: Path | None
    local_port: int
    flwr_home: Path
    data: Path | None = None
    device_class: str | None = None
    flower_log_level: str = DEFAULT_FLOWER_LOG_LEVEL


def make_certs(
    directory: Path, hosts: list[str], nodes: int, force: bool
) -> list[pki.MaterialFile]:
    """TLS material for a SuperLink reached at ``hosts`` (plus loopback) and node-1..N key pairs.

    Returns every file written, private keys included.
    """
    pki.subject_alt_names(hosts)  # a bad --san fails before anything is written
    tls = pki.write_tls(directory, hosts, force=force)
    return [*tls.listing(), *make_keys(directory, _node_names(nodes), force)]


def make_keys(directory: Path, names: list[str], force: bool) -> list[pki.MaterialFile]:
    """Key pairs of the SuperNodes ``names``; return both files of each pair."""
    return [f for name in names for f in pki.write_node_key(directory, name, force=force).listing()]


def serve(opts: ServerOptions) -> int:
    """Run a SuperLink in the foreground until it stops; return its exit code."""
    if opts.tls is not None:
        pki.check_tls_files(opts.tls)
        _warn_unnamed_host(opts.tls.server_cert, opts.host)
    check_port_free(opts.host, opts.port, "pick another port with --port")
    env = flower_env(opts.flwr_home, flower_log_level=opts.flower_log_level)
    argv = superlink_argv(env, opts.host, opts.port, opts.tls, opts.database)
    echo = FilteredEcho(sys.stdout, below_level(opts.flower_log_level))
    proc = FlowerProcess(argv, env, echo)
    try:
        proc.wait_listening(opts.host, opts.port, opts.ready_timeout_s, "the SuperLink")
    except DeployError:
        proc.stop()
        echo.release()
        raise
    address = format_address(opts.host, opts.port)
    mode = "TLS, registered SuperNodes only" if opts.tls else "INSECURE: no TLS, any SuperNode"
    print(f"edgefl: SuperLink ready at {address} ({mode})", file=sys.stderr, flush=True)
    rc = proc.wait()
    echo.release()
    return rc


def register(public_keys: list[Path], superlink: str, ca_cert: Path, flwr_home: Path) -> int:
    """Allow the SuperNodes holding ``public_keys`` to join the SuperLink at ``superlink``."""
    for key in public_keys:
        pki.load_node_public_key(key)
    pki.load_certificate(ca_cert, "CA certificate")
    check_reachable(superlink)
    write_connection(flwr_home, superlink, ca_cert)
    env = flower_env(flwr_home)
    for key in public_keys:
        name = key.name.removesuffix(".pub")
        argv = register_argv(env, key, name)
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        reply = _json_reply(done.stdout)
        if done.returncode != 0 or not reply.get("success"):
            why = str(reply.get("error-message") or done.stderr or "(no output)").strip()
            if UNAVAILABLE in why:
                raise connection_failed(superlink)
            raise DeployError(
                f"the SuperLink did not register {key}: {why.splitlines()[-1]} (a key can be "
                "registered once; flwr supernode ls lists the nodes)"
            )
        print(f"edgefl: registered {name} as node {reply.get('node-id')} ({key})", flush=True)
    return 0


def client(opts: ClientOptions) -> int:
    """Run a SuperNode with the edgefl node config in the foreground; return its exit code."""
    from edgefl.budget import parse_budget  # imports torch: only this command pays for it

    try:
        parse_budget(opts.budget, "--budget")
    except ConfigError as exc:
        raise DeployError(str(exc)) from None
    if not 0 <= opts.partition_id < opts.num_partitions:
        raise DeployError(
            f"--partition-id {opts.partition_id} is outside 0..{opts.num_partitions - 1}; give "
            f"each of the --num-partitions {opts.num_partitions} clients its own id"
        )
    if opts.ca_cert is not None:
        pki.load_certificate(
            opts.ca_cert,
            "CA certificate",
            "copy ca.crt from the server's deploy folder to this device and pass --ca PATH",
        )
    if opts.private_key is not None:
        pki.load_node_private_key(opts.private_key)
    parse_address(opts.superlink, "--superlink")
    node_config = _node_config(opts)
    check_port_free(
        "127.0.0.1", opts.local_port, "give each client on this machine its own --local-port"
    )
    env = flower_env(opts.flwr_home, flower_log_level=opts.flower_log_level)
    argv = supernode_argv(
        env, opts.superlink, opts.local_port, node_config, opts.ca_cert, opts.private_key
    )
    superlink = SuperLinkWatch(opts.superlink)
    superlink.waiting()  # says so when nothing answers there yet
    quiet = below_level(opts.flower_log_level)
    echo = FilteredEcho(
        sys.stdout, lambda line: quiet(line) or (RETRYING in line and superlink.waiting())
    )
    proc = FlowerProcess(argv, env, echo, watch=[*REFUSED_MARKERS, TLS_FAILED])
    rc = proc.wait()
    known = rc != 0 and any(proc.seen(m) for m in (*REFUSED_MARKERS, TLS_FAILED))
    if known:
        echo.discard()  # Flower's exit report: edgefl's one line below says what to do
    else:
        echo.release()
    if rc != 0 and proc.seen(TLS_FAILED):
        raise DeployError(
            f"the SuperLink's certificate did not verify with {opts.ca_cert}: pass --ca with the "
            "server's ca.crt, and a --superlink name or address the certificate lists "
            "(edgefl certs --san on the server)"
        )
    if rc != 0 and any(proc.seen(marker) for marker in REFUSED_MARKERS):
        public = f"{opts.private_key}.pub" if opts.private_key else "NODE.pub"
        raise DeployError(
            f"the SuperLink at {opts.superlink} refused this node: its key is not registered; "
            f"on the server run: edgefl register {public}"
        )
    return rc


def _node_config(opts: ClientOptions) -> dict[str, ConfigValue]:
    """The SuperNode's node config (keys of edgefl.node); folders made absolute and checked."""
    from edgefl import node  # imports torch, as client() does anyway

    cache = opts.plan_cache.expanduser().resolve()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DeployError(
            f"--plan-cache {cache} cannot be created ({exc.strerror}); pass a writable folder"
        ) from None
    if not os.access(cache, os.W_OK):
        raise DeployError(f"--plan-cache {cache} is not writable; pass a writable folder")
    config: dict[str, ConfigValue] = {
        node.PARTITION_ID: opts.partition_id,
        node.NUM_PARTITIONS: opts.num_partitions,
        node.MEMORY_BUDGET: opts.budget,
        node.PLAN_CACHE_DIR: str(cache),
    }
    if opts.data is not None:
        data = opts.data.expanduser().resolve()
        if not data.is_dir():
            raise DeployError(
                f"--data {data} is not a folder; pass the folder holding this device's "
                "dataset files (e.g. mnist.pkl.gz), or leave --data out to use the installed one"
            )
        config[node.DATA_DIR] = str(data)
    if opts.device_class:
        config[node.DEVICE_CLASS] = opts.device_class
    return config


def _json_reply(text: str) -> dict[str, Any]:
    try:
        reply = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return reply if isinstance(reply, dict) else {}


def _warn_unnamed_host(server_cert: Path, host: str) -> None:
    """Warn when the SuperLink binds a specific address its certificate does not name."""
    if host in ("0.0.0.0", "::"):
        return
    cert = pki.load_certificate(server_cert, "SuperLink certificate")
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    try:
        named = ipaddress.ip_address(host) in sans.get_values_for_type(x509.IPAddress)
    except ValueError:
        named = host.lower() in sans.get_values_for_type(x509.DNSName)
    if not named:
        logger.warning(
            "the SuperLink certificate does not name %s: devices dialing it will fail TLS; "
            "recreate it with: edgefl certs --san %s --force",
            host,
            host,
        )


def _node_names(count: int) -> list[str]:
    if count < 0:
        raise DeployError(f"--nodes {count} is negative; pass how many SuperNode key pairs to make")
    return [f"node-{i}" for i in range(1, count + 1)]
