"""Write and read paths to the swap file, side by side: speed, and whether RAM is really freed.

A chunk leaving memory is only gone once the kernel holds no copy of it either: a write that
leaves dirty or cached pages behind moves the bytes from the process into the page cache,
which is the same RAM. Each variant writes the same payload (``--mib`` MiB, in ``--chunk-mib``
pieces, as the swap engine does) to a fresh file and reads it back, interleaved round-robin
over ``--repeats`` rounds; per variant the median write and read bandwidth and the bytes of the
file still in the page cache after the write (``mincore`` on a mapping of the file, with
``/proc/meminfo``'s Dirty for the writeback still pending):

- ``pwrite+fdatasync+fadvise``: the swap tier's first path: write, flush, then drop the pages
  from the cache (``POSIX_FADV_DONTNEED``);
- ``pwrite+sync_file_range(wait)+fadvise``: per chunk, write back exactly its range and wait
  (``sync_file_range``), without the device cache flush ``fdatasync`` adds, then drop;
- ``pwrite+sync_file_range(start; wait for the one before)+fadvise``: per chunk, start its
  write-back, then wait for the one before and drop it: at most two chunks in the cache;
- ``pwrite+fadvise``: the same without the flush: dirty pages cannot be dropped until written back;
- ``pwrite+sync_file_range+fadvise``: start writeback per chunk (``SYNC_FILE_RANGE_WRITE``),
  wait for it once at the end, then drop;
- ``O_DIRECT``: bypass the page cache (page-aligned buffers and offsets).

Run from the repository root::

    python -m benchmarks.swap_paths                   # 256 MiB, 1 MiB chunks, 5 rounds
    python -m benchmarks.swap_paths --quick           # CI-sized
"""

import argparse
import ctypes
import ctypes.util
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import add_out, add_quick, describe, environment, tagged, write_json_lines
from vtensor.measure.residency import absent_bytes

MIB = 1 << 20
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE_WAIT_ALL = 1 | 2 | 4


def _sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> None:
    if _libc.sync_file_range(fd, ctypes.c_int64(offset), ctypes.c_int64(nbytes), flags) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def _write_sync_fadvise(fd: int, chunks: list[mmap.mmap]) -> None:
    for i, chunk in enumerate(chunks):
        os.pwrite(fd, chunk, i * len(chunk))
        os.fdatasync(fd)
        os.posix_fadvise(fd, i * len(chunk), len(chunk), os.POSIX_FADV_DONTNEED)


def _write_fadvise(fd: int, chunks: list[mmap.mmap]) -> None:
    for i, chunk in enumerate(chunks):
        os.pwrite(fd, chunk, i * len(chunk))
        os.posix_fadvise(fd, i * len(chunk), len(chunk), os.POSIX_FADV_DONTNEED)


def _write_sync_file_range(fd: int, chunks: list[mmap.mmap]) -> None:
    size = len(chunks[0])
    for i, chunk in enumerate(chunks):
        os.pwrite(fd, chunk, i * size)
        _sync_file_range(fd, i * size, size, _SYNC_FILE_RANGE_WRITE)
    _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WAIT_ALL)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _write_range_wait_fadvise(fd: int, chunks: list[mmap.mmap]) -> None:
    for i, chunk in enumerate(chunks):
        os.pwrite(fd, chunk, i * len(chunk))
        _sync_file_range(fd, i * len(chunk), len(chunk), _SYNC_FILE_RANGE_WAIT_ALL)
        os.posix_fadvise(fd, i * len(chunk), len(chunk), os.POSIX_FADV_DONTNEED)


def _write_behind(fd: int, chunks: list[mmap.mmap]) -> None:
    # Each piece's write-back starts at once; the one before is waited for and dropped then.
    size = len(chunks[0])
    behind = -1
    for i, chunk in enumerate(chunks):
        os.pwrite(fd, chunk, i * size)
        _sync_file_range(fd, i * size, size, _SYNC_FILE_RANGE_WRITE)
        if behind >= 0:
            _sync_file_range(fd, behind, size, _SYNC_FILE_RANGE_WAIT_ALL)
            os.posix_fadvise(fd, behind, size, os.POSIX_FADV_DONTNEED)
        behind = i * size
    if behind >= 0:
        _sync_file_range(fd, behind, size, _SYNC_FILE_RANGE_WAIT_ALL)
        os.posix_fadvise(fd, behind, size, os.POSIX_FADV_DONTNEED)


WRITES: dict[str, tuple[int, Callable[[int, list[mmap.mmap]], None]]] = {
    "pwrite+fdatasync+fadvise": (0, _write_sync_fadvise),
    "pwrite+sync_file_range(wait)+fadvise": (0, _write_range_wait_fadvise),
    "pwrite+fadvise": (0, _write_fadvise),
    "pwrite+sync_file_range+fadvise": (0, _write_sync_file_range),
    "pwrite+sync_file_range(start; wait for the one before)+fadvise": (0, _write_behind),
    "O_DIRECT": (os.O_DIRECT, _write_fadvise),
}


def _cached_bytes(path: Path, nbytes: int) -> int:
    """Bytes of the file's first ``nbytes`` in the page cache now (``mincore`` of a mapping)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), nbytes, prot=mmap.PROT_READ) as view:
        pages = np.frombuffer(view, dtype=np.uint8)
        cached = nbytes - absent_bytes(pages.ctypes.data, nbytes)
        del pages
    return cached


def _dirty_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Dirty:"):
            return int(line.split()[1]) * 1024
    return 0


def _one(name: str, directory: Path, chunks: list[mmap.mmap]) -> dict[str, Any]:
    flags, write = WRITES[name]
    path = directory / f"swap-{name.replace('+', '-')}"
    nbytes = sum(len(c) for c in chunks)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | flags, 0o600)
    try:
        begin = time.perf_counter()
        write(fd, chunks)
        write_s = time.perf_counter() - begin
        dirty = _dirty_bytes()
        cached = _cached_bytes(path, nbytes)
        target = mmap.mmap(-1, len(chunks[0]))
        begin = time.perf_counter()
        for i in range(len(chunks)):
            os.preadv(fd, [target], i * len(target))
        read_s = time.perf_counter() - begin
        target.close()
    finally:
        os.close(fd)
        path.unlink()
    return {
        "variant": name,
        "write_mib_s": nbytes / MIB / write_s,
        "read_mib_s": nbytes / MIB / read_s,
        "cached_after_write_mib": cached / MIB,
        "dirty_after_write_mib": dirty / MIB,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_quick(p, "32 MiB, 2 rounds")
    p.add_argument("--mib", type=int, default=None, help="payload per variant (default 256)")
    p.add_argument("--chunk-mib", type=int, default=1)
    p.add_argument("--repeats", type=int, default=None, help="rounds (default 5; quick: 2)")
    p.add_argument("--storage-dir", default=None, help="directory of the swap files")
    add_out(p)
    args = p.parse_args(argv)
    mib = args.mib or (32 if args.quick else 256)
    rounds = args.repeats or (2 if args.quick else 5)
    env = environment()
    print(describe(env))
    # Anonymous mappings are page-aligned, as O_DIRECT needs; random bytes, as sealed chunks are.
    chunks = []
    for _ in range(mib // args.chunk_mib):
        chunk = mmap.mmap(-1, args.chunk_mib * MIB)
        chunk.write(os.urandom(args.chunk_mib * MIB))
        chunks.append(chunk)
    directory = Path(args.storage_dir or tempfile.gettempdir())
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in WRITES}
    for _ in range(rounds):
        for name in WRITES:
            runs[name].append(_one(name, directory, chunks))
    rows = []
    print(f"\n{mib} MiB in {args.chunk_mib} MiB chunks to {directory}, medians of {rounds}\n")
    print("| variant | write MiB/s | read MiB/s | in page cache after write, MiB | Dirty, MiB |")
    print("|---|---|---|---|---|")
    for name, results in runs.items():
        row = {
            "variant": name,
            **{
                key: statistics.median(r[key] for r in results)
                for key in results[0]
                if key != "variant"
            },
            "runs": results,
        }
        rows.append(row)
        print(
            f"| {name} | {row['write_mib_s']:.0f} | {row['read_mib_s']:.0f} | "
            f"{row['cached_after_write_mib']:.1f} | {row['dirty_after_write_mib']:.1f} |"
        )
    end = {"kind": "end", "load_avg": os.getloadavg()}
    print(f"\n# load average at end {end['load_avg'][0]:.2f}")
    write_json_lines(args.out, env, [*tagged("variant", rows), end])


if __name__ == "__main__":
    main()
