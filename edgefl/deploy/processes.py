"""Start, watch and stop Flower's processes: addresses, port checks, readiness, output, shutdown."""

import collections
import errno
import ipaddress
import logging
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Protocol, TextIO

from edgefl.deploy.errors import DeployError

logger = logging.getLogger(__name__)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TAIL_LINES = 200
# The flwr CLI's report of a failed connection (a wrong CA, TLS against an insecure SuperLink).
UNAVAILABLE = "Connection to the SuperLink is unavailable"
EXIT_REPORT = "Exit Code: "  # the first line of the report a Flower process exits with
RETRYING = "Connection attempt failed, retrying in"  # Flower's warning on each retry
# Lines below WARNING that Flower's FLWR_LOG_LEVEL does not reach: the default log format of
# the SuperNode's own HTTP server (uvicorn), and the note each ClientApp process prints when
# it unpacks the app.
_UVICORN_INFO = re.compile(r"^(DEBUG|INFO):\s")
_APP_INSTALLED = "Successfully installed "


def parse_address(address: str, what: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) -> (host, port); a malformed one raises."""
    host, sep, port_text = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise DeployError(
            f"{what} {address!r} is not host:port; write it as e.g. 192.168.1.20:9092 or [::1]:9092"
        )
    return host, int(port_text)


def format_address(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 host."""
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


def check_port_free(host: str, port: int, fix: str) -> None:
    """Raise if something already listens on ``host:port`` (``fix`` says how to choose another)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise DeployError(f"host {host!r} does not resolve ({exc.strerror}); {fix}") from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        # As the servers themselves bind: connections in TIME_WAIT do not block the port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise DeployError(
                    f"port {port} on {host} is in use (another SuperLink or SuperNode?); "
                    f"stop that process or {fix}"
                ) from None
            raise DeployError(f"cannot listen on {host}:{port} ({exc.strerror}); {fix}") from None


def is_listening(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether a TCP connection to ``host:port`` is accepted now."""
    connect_host = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    try:
        with socket.create_connection((connect_host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def check_reachable(superlink: str) -> None:
    """Raise unless a SuperLink (anything, in fact) accepts connections at ``superlink``."""
    host, port = parse_address(superlink, "--superlink")
    if not is_listening(host, port, timeout_s=3.0):
        raise DeployError(
            f"no SuperLink answers at {superlink}; start it with: edgefl server (or pass "
            "--superlink HOST:PORT)"
        )


def below_level(flower_log_level: str) -> Callable[[str], bool]:
    """A test of a Flower process's output line: is it below ``flower_log_level``?

    Only for the lines Flower prints whatever its level (``_UVICORN_INFO``, ``_APP_INSTALLED``);
    Flower's own logger follows FLWR_LOG_LEVEL (``flower_env``).
    """
    if logging.getLevelName(flower_log_level.upper()) <= logging.INFO:
        return lambda _line: False
    return lambda line: bool(_UVICORN_INFO.match(line)) or line.startswith(_APP_INSTALLED)


def announce_superlink(superlink: str, poll_s: float = 2.0) -> threading.Thread | None:
    """Say when nothing answers at ``superlink`` yet, and (from a daemon thread) when it does.

    Flower's SuperNode warns at each retry without saying what it waits for; this says it once
    (``SuperLinkWatch`` drops those warnings meanwhile). Returns the watching thread, or None
    when the SuperLink answers now.
    """
    host, port = parse_address(superlink, "--superlink")
    if is_listening(host, port, timeout_s=1.0):
        return None
    logger.warning("waiting for the SuperLink at %s: nothing answers there yet", superlink)

    def watch() -> None:
        while not is_listening(host, port, timeout_s=1.0):
            time.sleep(poll_s)
        logger.info("the SuperLink at %s answers; the node connects", superlink)

    thread = threading.Thread(target=watch, name="superlink-watch", daemon=True)
    thread.start()
    return thread


class SuperLinkWatch:
    """A node's own word on a SuperLink it cannot reach, in place of Flower's retry warnings.

    ``waiting()`` is asked at the start and at each of Flower's retry warnings: while nothing
    answers at the SuperLink's address, the node says so once (``announce_superlink``) and once
    more when it answers; Flower's warnings then say nothing more and may be dropped.
    """

    def __init__(self, superlink: str, poll_s: float = 2.0) -> None:
        self._superlink = superlink
        self._poll_s = poll_s
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def waiting(self) -> bool:
        """Whether nothing answers at the SuperLink now (said once per outage)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = announce_superlink(self._superlink, self._poll_s)
            return self._thread is not None


class Sink(Protocol):
    """Where a Flower process's output lines are echoed (a text stream, or a filter of one)."""

    def write(self, text: str, /) -> object:
        """Write one line (with its newline)."""

    def flush(self) -> object:
        """Flush what was written."""


class FilteredEcho:
    """Echo a Flower process's lines to ``stream``, less those ``drop`` rejects.

    From a line holding Flower's ``EXIT_REPORT`` on, lines are held until ``release()`` (echo
    them) or ``discard()`` (edgefl says what went wrong instead, in one line of its own).
    ``drop`` sees each line without colour codes.
    """

    def __init__(self, stream: TextIO, drop: Callable[[str], bool] = lambda _line: False) -> None:
        self._stream = stream
        self._drop = drop
        self._held: list[str] | None = None
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        """Echo, drop or hold one line."""
        plain = _ANSI.sub("", text)
        with self._lock:
            if self._held is None and EXIT_REPORT in plain:
                self._held = []
            if self._held is not None:
                self._held.append(text)
            elif not self._drop(plain):
                self._stream.write(text)

    def flush(self) -> None:
        """Flush the stream."""
        self._stream.flush()

    def release(self) -> None:
        """Echo the held lines (Flower's exit report, and what followed it)."""
        with self._lock:
            self._stream.writelines(self._held or [])
            self._held = None
        self._stream.flush()

    def discard(self) -> None:
        """Drop the held lines."""
        with self._lock:
            self._held = None


def connection_failed(superlink: str) -> DeployError:
    """The error for a SuperLink that listens but refuses the flwr CLI (a TLS mismatch)."""
    return DeployError(
        f"the SuperLink at {superlink} listens but refused the connection; pass --ca with the "
        "server's ca.crt (and --insecure only when the server runs with --insecure)"
    )


class FlowerProcess:
    """A child process whose merged output is echoed to ``echo``, watched for ``watch`` strings.

    Only the last lines are kept (a SuperLink logs for days); the first line holding each
    watched string is kept for good.
    """

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        echo: Sink | None = None,
        *,
        watch: Sequence[str] = (),
        new_session: bool = False,
    ) -> None:
        self.argv = list(argv)
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._watch = tuple(watch)
        self._found: dict[str, str] = {}
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            self.argv,
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            start_new_session=new_session,
        )
        self._echo = echo
        self._new_session = new_session
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._lock:
                self._tail.append(line.rstrip("\n"))
                for text in self._watch:
                    if text in line:
                        self._found.setdefault(text, line.rstrip("\n"))
            if self._echo is not None:
                self._echo.write(line)
                self._echo.flush()

    def seen(self, text: str) -> str | None:
        """The first output line holding the watched string ``text``, or None (not yet)."""
        with self._lock:
            return self._found.get(text)

    def tail(self) -> str:
        """The last lines of output."""
        with self._lock:
            return "\n".join(self._tail)

    def last_line(self) -> str:
        """The last line of output with words in it, without colour codes and box borders."""
        with self._lock:
            lines = [_ANSI.sub("", line).strip(" │\t") for line in self._tail]
            lines = [line for line in lines if any(c.isalnum() for c in line)]
        return lines[-1] if lines else "(no output)"

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait for the process and its output; SIGTERM and Ctrl-C reach it, then it is awaited.

        The child shares this process's group, so a terminal's Ctrl-C reaches it directly:
        here it only interrupts the wait, which then resumes until the child has shut down.
        """

        def forward(signum: int, _frame: FrameType | None) -> None:
            self.proc.send_signal(signum)

        main = threading.current_thread() is threading.main_thread()  # signals: main only
        previous = signal.signal(signal.SIGTERM, forward) if main else None
        try:
            while True:
                try:
                    rc = self.proc.wait(timeout_s)  # raises subprocess.TimeoutExpired
                    self._pump.join()
                    return rc
                except KeyboardInterrupt:
                    continue
        finally:
            if main:
                signal.signal(signal.SIGTERM, previous)

    def wait_listening(self, host: str, port: int, timeout_s: float, what: str) -> None:
        """Return once ``host:port`` accepts connections; raise if the process exits first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._pump.join(timeout=5)
                raise DeployError(
                    f"{what} exited with code {self.proc.returncode} before listening on "
                    f"{format_address(host, port)}: {self.last_line()}"
                )
            if is_listening(host, port):
                return
            time.sleep(0.2)
        raise DeployError(
            f"{what} is not listening on {format_address(host, port)} after {timeout_s:.0f} s; "
            f"its last output: {self.last_line()}"
        )

    def stop(self, timeout_s: float = 10.0) -> int:
        """Stop the process (its whole group if it leads one): SIGTERM, then SIGKILL."""
        if self._new_session:
            return stop_process_group(self.proc, timeout_s)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def stop_process_group(proc: "subprocess.Popen[str]", timeout_s: float = 10.0) -> int:
    """SIGTERM the process group led by ``proc`` (it and every helper it started), then SIGKILL.

    The group is signalled even when its leader has exited: Flower's helpers may outlive it.
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break  # the whole group is gone
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and _group_alive(proc):
            time.sleep(0.1)
        if not _group_alive(proc):
            break
    return proc.wait()


def _group_alive(proc: "subprocess.Popen[str]") -> bool:
    """Whether a live (non-zombie) process is left in ``proc``'s group.

    Zombies count as dead: a container's PID 1 may never reap orphaned helpers.
    """
    proc.poll()  # reap the leader itself
    if not Path("/proc/self/stat").exists():  # no procfs: ask the kernel about the group
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # the process ended while the folder was listed
        if int(fields[2]) == proc.pid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            return True
    return False
