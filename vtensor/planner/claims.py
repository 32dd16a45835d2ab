"""Which manager decides a key's plan, among the processes that share a plan cache.

NOTE [one decider]
Managers that share a plan cache and start on the same key together (the main job's clients of
one device class, two at a time) each profiled the model, tried the same recomputations and
raced the same candidates: the decision's cost, about a second on the main job's CNN, paid once
per client that started before the first decision reached the cache, and again in the next round
by a client that started while another took the parked decision up (NOTE [undecided plans]).
Now a manager that finds no plan and no claim claims the key: a file ``<key digest>.claim``
created exclusively (``O_EXCL``) beside the cache's entries, naming its host, process and
manager. It profiles, tries and races as before; it refreshes the claim as it goes, publishes
the best plan it knows (NOTE [provisional plan] in ``activations/shared_plans.py``), and lets go
of the claim once the plan is cached, or once it parks the decision as it closes, or once the
budget proves infeasible. Every other manager of that key follows instead of deciding.

A claim whose process has died (same host, no such process) or that has not been refreshed for
``STALE_S`` is taken over: removed under a lock and claimed again exclusively, so two managers
never both take it over. The holder refreshes it at every iteration of the decision (at most
every ``REFRESH_S``); a minute without one (a holder on another host gone, a manager left open
and idle) hands the key on, since until a plan is published its followers run the reactive
policy, about three times a decided step on the main job's CNN. A holder wrongly judged stale
(an iteration longer than that) only costs a second decision of the same key, which is what
every manager did before: correctness never depends on a claim, since every plan keeps the
budget and trains bit-identically.
"""

import contextlib
import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path

from vtensor.planner.cache import locked
from vtensor.planner.keys import PlanKey

logger = logging.getLogger(__name__)

STALE_S = 60.0  # a claim not refreshed for this long is taken over
REFRESH_S = 5.0  # a holder refreshes its claims at most this often
_LOCK_NAME = ".claims.lock"


class DecisionClaims:
    """This manager's claims on deciding keys' plans in a plan cache directory (NOTE [one decider]).

    Args:
        directory: the plan cache's directory (created by the first claim).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.owner = {"host": socket.gethostname(), "pid": os.getpid(), "id": uuid.uuid4().hex}
        self._held: dict[str, float] = {}  # key digest -> when last refreshed (monotonic)

    def path_for(self, key: PlanKey) -> Path:
        """The claim file of ``key``."""
        return self.directory / f"{key.digest()}.claim"

    def holds(self, key: PlanKey) -> bool:
        """Whether this manager holds ``key``'s claim."""
        return key.digest() in self._held

    def claim(self, key: PlanKey) -> bool:
        """Claim ``key`` (True), or leave it to the live manager that holds it (False).

        A directory where no claim can be made (read-only) claims nothing and decides alone.
        """
        if self.holds(key):
            return True
        path = self.path_for(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if self._create(path):
                return True
            with locked(self.directory / _LOCK_NAME):  # one manager at a time removes a stale claim
                if not self._stale(path):
                    return False
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                logger.info("taking over the stale claim %s", path.name)
            return self._create(path)
        except OSError as exc:
            logger.warning("plan cache: cannot claim %s (%s); deciding alone", path, exc)
            return True

    def refresh(self, key: PlanKey) -> None:
        """Keep ``key``'s claim from going stale (at most every ``REFRESH_S``)."""
        digest = key.digest()
        last = self._held.get(digest)
        if last is None or time.monotonic() - last < REFRESH_S:
            return
        self._held[digest] = time.monotonic()
        with contextlib.suppress(OSError):
            os.utime(self.path_for(key))

    def release(self, key: PlanKey) -> None:
        """Let go of ``key``'s claim, if this manager holds it."""
        if self._held.pop(key.digest(), None) is None:
            return
        _release_files(self.directory, {key.digest(): 0.0}, self.owner)

    def release_all(self) -> None:
        """Let go of every claim this manager holds."""
        _release_files(self.directory, self._held, self.owner)
        self._held.clear()

    def _create(self, path: Path) -> bool:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as handle:
            json.dump(self.owner, handle)
        self._held[path.name.removesuffix(".claim")] = time.monotonic()
        return True

    def _stale(self, path: Path) -> bool:
        """Whether the claim at ``path`` is gone, or its holder dead or silent for ``STALE_S``."""
        try:
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            return True
        if age > STALE_S:
            return True
        owner = _owner_of(path)  # unreadable while young: being written
        if owner is None or owner.get("host") != self.owner["host"]:
            return False
        pid = owner.get("pid")
        if not isinstance(pid, int) or pid <= 0:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False  # alive, another user's
        return False


def _owner_of(path: Path) -> dict[str, object] | None:
    try:
        owner = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _release_files(directory: Path, digests: dict[str, float], owner: dict[str, object]) -> None:
    """Remove the claim files of ``digests`` that ``owner`` still holds (never another's)."""
    for digest in list(digests):
        path = directory / f"{digest}.claim"
        with contextlib.suppress(OSError):
            if _owner_of(path) == owner:
                path.unlink()
