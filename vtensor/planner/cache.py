"""Versioned on-disk cache of plans by PlanKey: atomic writes, checksums, LRU bound, multi-process.

NOTE [plan cache on disk]: one JSON file per key, ``<key digest>.json``, holding the cache schema
version, the key's fields, the plan's JSON text and its SHA-256. Writers fsync a private temp file
and ``os.replace`` it over the entry, so readers see the old or the new file whole, and concurrent
puts of one key leave the last. Recency is the mtime, bumped by ``get``; only eviction (deleting)
is serialised across processes, by ``flock`` on ``.lock``. A bad entry is a miss with a warning,
replaced by the next put of its key or aged out.
"""

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from vtensor.errors import VTensorError
from vtensor.planner.keys import PlanKey
from vtensor.planner.plan import Plan

logger = logging.getLogger(__name__)

CACHE_SCHEMA_VERSION = 1
_ENTRY_NAME = re.compile(r"^[0-9a-f]{64}\.json$")
_TEMP_PREFIX = ".tmp-"
_LOCK_NAME = ".lock"
# A temp file this old belongs to a writer that died between write and rename.
_STALE_TEMP_NS = 600 * 10**9


class _BadEntryError(Exception):
    """An entry that must be treated as a miss; the message is the reason."""


def _decode_entry(raw: bytes, key: PlanKey) -> Plan:
    """Parse and verify one entry's bytes against ``key``; raises ``_BadEntryError``."""
    try:
        entry = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise _BadEntryError(f"not valid JSON, corrupt or truncated ({exc})") from exc
    if not isinstance(entry, dict):
        raise _BadEntryError(f"top level is {type(entry).__name__}, not an object")
    version = entry.get("cache_schema_version")
    if version != CACHE_SCHEMA_VERSION:
        raise _BadEntryError(f"cache schema version {version!r}, expected {CACHE_SCHEMA_VERSION}")
    if entry.get("key") != dataclasses.asdict(key):
        raise _BadEntryError(f"stored key does not match the requested key {key.digest()}")
    text = entry.get("plan")
    if not isinstance(text, str) or entry.get("plan_sha256") != _sha256(text):
        raise _BadEntryError("plan checksum mismatch")
    try:
        return Plan.from_json(text)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise _BadEntryError(f"plan does not parse ({exc})") from exc


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _set_mtime_now(path: Path) -> None:
    # The kernel's coarse file clock would tie entries used in quick succession; an explicit ns
    # time keeps the LRU order exact. It needs ownership: elsewhere, the coarse "now".
    now_ns = time.time_ns()
    try:
        os.utime(path, ns=(now_ns, now_ns))
    except PermissionError:
        os.utime(path)


def _encode_entry(key: PlanKey, plan: Plan) -> bytes:
    text = plan.to_json()
    entry = {
        "cache_schema_version": CACHE_SCHEMA_VERSION,
        "key": dataclasses.asdict(key),
        "plan": text,
        "plan_sha256": _sha256(text),
    }
    return json.dumps(entry, sort_keys=True).encode()


class PlanCache:
    """Plans on disk by :class:`~vtensor.planner.keys.PlanKey`, shared safely between processes.

    Attributes:
        directory: where entries live; created by the first put.
        max_entries: entries kept; the least recently used beyond it are deleted on put.
        last_load_s: seconds the last :meth:`get` took, hit or miss (0.0 before the first).
    """

    def __init__(self, directory: str | os.PathLike[str], max_entries: int = 64) -> None:
        if max_entries < 1:
            raise VTensorError(f"PlanCache max_entries={max_entries} must be at least 1")
        self.directory = Path(directory)
        self.max_entries = max_entries
        self.last_load_s = 0.0
        self._warned_utime = False

    def path_for(self, key: PlanKey) -> Path:
        """The entry file of ``key`` (which may not exist)."""
        return self.directory / f"{key.digest()}.json"

    def get(self, key: PlanKey) -> Plan | None:
        """The cached plan of ``key``, or None on a miss (bad entries warn and miss)."""
        start = time.perf_counter()
        try:
            return self._load(key)
        finally:
            self.last_load_s = time.perf_counter() - start

    def put(self, key: PlanKey, plan: Plan) -> None:
        """Store ``plan`` under ``key`` atomically, then evict beyond ``max_entries``.

        Raises:
            VTensorError: the directory cannot be created or written.
        """
        data = _encode_entry(key, plan)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._write_atomic(self.path_for(key), data)
            self._evict()
        except OSError as exc:
            raise VTensorError(
                f"cannot write the plan cache at {self.directory} ({exc}); make the directory "
                "writable, or point the plan cache at a writable directory"
            ) from exc
        logger.debug("plan cache: stored %s (%d bytes)", self.path_for(key).name, len(data))

    def lean_path(self, key: PlanKey) -> Path:
        """The file saying a full replay of ``key``'s plan needed no guard (NOTE [lean replay])."""
        return self.directory / f"{key.digest()}.lean"

    def mark_lean(self, key: PlanKey, plan: Plan) -> None:
        """Note that a full replay of ``plan`` needed nothing from the guard.

        The note holds the plan's digest, so it covers no plan stored since; a failed write
        costs the next manager only a full replay.
        """
        try:
            self._write_atomic(self.lean_path(key), plan.digest().encode())
        except OSError as exc:
            logger.warning("plan cache: cannot note %s as lean (%s)", self.lean_path(key), exc)

    def replays_lean(self, key: PlanKey, plan: Plan) -> bool:
        """Whether ``mark_lean`` noted ``plan`` under ``key``."""
        try:
            return self.lean_path(key).read_bytes() == plan.digest().encode()
        except OSError:
            return False

    def _load(self, key: PlanKey) -> Plan | None:
        path = self.path_for(key)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            logger.debug("plan cache: miss %s", path.name)
            return None
        except OSError as exc:
            logger.warning("plan cache: cannot read %s (%s); treating it as a miss", path, exc)
            return None
        try:
            plan = _decode_entry(raw, key)
        except _BadEntryError as exc:
            logger.warning("plan cache: ignoring %s: %s; it will be replaced", path, exc)
            return None
        self._touch(path)
        return plan

    def _touch(self, path: Path) -> None:
        """Mark ``path`` recently used; failure only degrades the LRU order."""
        try:
            _set_mtime_now(path)
        except FileNotFoundError:
            pass  # evicted or replaced by another process since we read it
        except OSError as exc:
            if not self._warned_utime:
                self._warned_utime = True
                logger.warning("plan cache: cannot update %s (%s); LRU order is stale", path, exc)

    def _write_atomic(self, path: Path, data: bytes) -> None:
        """Write ``data`` to ``path`` whole or not at all, through a crash too."""
        fd, temp = tempfile.mkstemp(prefix=_TEMP_PREFIX, suffix=".json", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            _set_mtime_now(Path(temp))
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        # Makes the rename itself durable; some file systems refuse, which costs only durability.
        with contextlib.suppress(OSError):
            dir_fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def _evict(self) -> None:
        """Delete the least recently used entries beyond ``max_entries`` and stale temp files.

        Serialised across processes by ``flock`` on the lock file.
        """
        with open(self.directory / _LOCK_NAME, "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            entries = sorted(self._scan())
            for _, path in entries[: max(0, len(entries) - self.max_entries)]:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    logger.debug("plan cache: evicted %s", path.name)
                with contextlib.suppress(FileNotFoundError):
                    path.with_suffix(".lean").unlink()

    def _scan(self) -> Iterator[tuple[int, Path]]:
        """(mtime_ns, path) of every entry; removes stale temp files on the way."""
        now_ns = time.time_ns()
        with os.scandir(self.directory) as items:
            for item in items:
                try:
                    mtime_ns = item.stat().st_mtime_ns
                except FileNotFoundError:
                    continue
                if _ENTRY_NAME.match(item.name):
                    yield mtime_ns, Path(item.path)
                elif item.name.startswith(_TEMP_PREFIX) and now_ns - mtime_ns > _STALE_TEMP_NS:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(item.path)
