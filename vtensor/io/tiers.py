"""Slower tiers that hold evicted chunks: a swap file on storage, and pinned host memory on CUDA."""

import bisect
import ctypes
import ctypes.util
import errno
import os
import tempfile
from pathlib import Path

import torch

from vtensor.errors import StorageTierError
from vtensor.io import pages


def round_up(nbytes: int, multiple: int) -> int:
    """``nbytes`` rounded up to a multiple of ``multiple``."""
    return -(-nbytes // multiple) * multiple


def buffer_at(address: int, nbytes: int) -> memoryview:
    """A writable byte view of raw memory, for I/O straight into and out of tensor storage."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def skip_filled(views: list[memoryview], nbytes: int) -> list[memoryview]:
    """The part of ``views`` left after the first ``nbytes`` (after a short vectored transfer)."""
    while views and nbytes >= len(views[0]):
        nbytes -= len(views[0])
        views = views[1:]
    if views and nbytes:
        views = [views[0][nbytes:], *views[1:]]
    return views


def _anonymous_file(directory: Path) -> int:
    """A read-write descriptor of a file in ``directory`` that has no name at any moment.

    ``O_TMPFILE`` leaves no named file even after a crash; elsewhere ``mkstemp`` and unlink.
    """
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    fd, path = tempfile.mkstemp(prefix="vtensor-", suffix=".swap", dir=directory)
    os.unlink(path)
    return fd


class ExtentAllocator:
    """First-fit allocator of page-aligned byte extents in a growing file; frees coalesce.

    The page size is fixed for the allocator's life so that frees round as allocations did.
    """

    def __init__(self) -> None:
        self.page_bytes = pages.PAGE_BYTES
        self._free: list[tuple[int, int]] = []  # sorted (offset, length)
        self.end_bytes = 0  # file size high-water mark
        self.used_bytes = 0

    def alloc(self, nbytes: int) -> int:
        """Return the offset of a free extent of at least ``nbytes`` (page-rounded)."""
        size = round_up(nbytes, self.page_bytes)
        self.used_bytes += size
        for i, (offset, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, length - size)
                return offset
        offset = self.end_bytes
        self.end_bytes += size
        return offset

    def free(self, offset: int, nbytes: int) -> None:
        """Return an extent given by :meth:`alloc`."""
        size = round_up(nbytes, self.page_bytes)
        self.used_bytes -= size
        i = bisect.bisect_left(self._free, (offset, 0))
        self._free.insert(i, (offset, size))
        # Coalesce with the right neighbour, then with the left one.
        if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
            self._free[i] = (offset, size + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]


# NOTE [write-back]
# Dirty pages must be written back before they can leave the page cache. The swap file needs no
# durability, so only the written range is written back and waited for (``sync_file_range``),
# without ``fdatasync``'s journal commit and cache flush; ``fdatasync`` where the call is missing.
#
# NOTE [write behind]
# A transfer of several ranges (``SwapFileIo.write_dropped``) starts each range's write-back
# without waiting and then waits for, and drops, the range before it, so the device writes while
# the I/O thread seals. The cache holds at most two ranges, and a transfer ends only once all its
# bytes are out of the cache, so a failed write-back fails that transfer before the store
# releases the chunk's memory.
_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE_WAIT_ALL = 1 | 2 | 4  # WAIT_BEFORE | WRITE | WAIT_AFTER
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_sync_file_range = getattr(_libc, "sync_file_range", None)
if _sync_file_range is not None:
    _sync_file_range.restype = ctypes.c_int
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


def _sync_range(fd: int, offset: int, nbytes: int, flags: int) -> bool:
    """``sync_file_range`` of the range; False where the libc or the file system lacks it."""
    if _sync_file_range is None:
        return False
    if _sync_file_range(fd, offset, nbytes, flags) != 0:
        code = ctypes.get_errno()
        if code in (errno.ENOSYS, errno.EINVAL, errno.ESPIPE):
            return False
        raise OSError(code, f"sync_file_range: {os.strerror(code)}")
    return True


class StorageTier:
    """One swap file per session, read and written with raw ``pwrite``/``preadv``.

    NOTE [anonymous swap file]
    The file has no name (``_anonymous_file``): it lives only while this process holds its
    descriptor, so it is gone even after SIGKILL, and no other process can open it by name. After
    every write its pages are written back and dropped from the page cache: otherwise "swapped
    out" bytes would only move into the page cache and RAM would not shrink.
    """

    def __init__(self, directory: str | os.PathLike[str] | None, drop_page_cache: bool = True):
        root = Path(directory) if directory is not None else Path(tempfile.gettempdir())
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd = _anonymous_file(root)
        except OSError as exc:
            raise StorageTierError(
                exc.errno or errno.EIO,
                f"cannot create a swap file in storage_dir={str(root)!r} ({exc.strerror}); "
                "pass a writable directory as storage_dir",
            ) from exc
        self.directory = root
        self.drop_page_cache = drop_page_cache
        self._fd: int | None = fd
        self.extents = ExtentAllocator()
        if drop_page_cache:
            # The kernel's read-ahead would pull other swapped-out chunks into the page cache,
            # bytes outside the budget; restores ask for exactly their ranges (``read_ahead``).
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)

    @property
    def fd(self) -> int:
        """The open descriptor of the (unlinked) swap file."""
        if self._fd is None:
            raise StorageTierError(errno.EBADF, "the storage tier is closed")
        return self._fd

    def write(self, offset: int, address: int, nbytes: int) -> None:
        """Write ``nbytes`` from memory at ``address`` to the file at ``offset`` (any thread)."""
        self.writev(offset, [buffer_at(address, nbytes)])

    def writev(self, offset: int, views: list[memoryview]) -> None:
        """Write ``views`` back to back to the file at ``offset``: one ``pwritev`` if it can."""
        nbytes = sum(len(v) for v in views)
        done = 0
        try:
            while views:
                wrote = os.pwritev(self.fd, views, offset + done)
                done += wrote
                views = skip_filled(views, wrote)
        except OSError as exc:
            raise StorageTierError(
                exc.errno or errno.EIO,
                f"writing {nbytes} bytes to the swap file in {str(self.directory)!r} failed "
                f"({exc.strerror}); free space there or pass another storage_dir",
            ) from exc

    def readv(self, offset: int, views: list[memoryview]) -> None:
        """Fill ``views`` back to back from the file at ``offset``: one ``preadv`` if it can."""
        nbytes = sum(len(v) for v in views)
        done = 0
        while views:
            got = os.preadv(self.fd, views, offset + done)
            if got == 0:
                raise StorageTierError(
                    errno.EIO, f"swap file ended at {offset + done}, expected {nbytes} bytes"
                )
            done += got
            views = skip_filled(views, got)

    def read_ahead(self, offset: int, nbytes: int) -> None:
        """Ask the kernel to start reading a range into the page cache (returns at once)."""
        if self.drop_page_cache:
            os.posix_fadvise(self.fd, offset, nbytes, os.POSIX_FADV_WILLNEED)

    def start_write_back(self, offset: int, nbytes: int) -> bool:
        """Start writing the range back without waiting (NOTE [write behind]); False: cannot."""
        return self.drop_page_cache and _sync_range(self.fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)

    def release_cache(self, offset: int, nbytes: int, *, dirty: bool) -> None:
        """Drop a range from the page cache so the RAM it used is really free."""
        if not self.drop_page_cache:
            return
        if dirty and not _sync_range(self.fd, offset, nbytes, _SYNC_FILE_RANGE_WAIT_ALL):
            os.fdatasync(self.fd)  # NOTE [write-back]
        os.posix_fadvise(
            self.fd, offset, round_up(nbytes, self.extents.page_bytes), os.POSIX_FADV_DONTNEED
        )

    def close(self) -> None:
        """Close (and so delete) the swap file."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class HostTier:
    """A bounded pool of pinned host buffers (CUDA only), reused by size to avoid cudaHostAlloc."""

    def __init__(self, capacity_bytes: int | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._pool: dict[int, list[torch.Tensor]] = {}

    def take(self, nbytes: int) -> torch.Tensor:
        """A pinned uint8 buffer of ``nbytes``."""
        if self.capacity_bytes is not None and self.used_bytes + nbytes > self.capacity_bytes:
            raise StorageTierError(
                errno.ENOMEM,
                f"pinned host tier full ({self.used_bytes} of {self.capacity_bytes} bytes used, "
                f"{nbytes} more requested); raise host_capacity_bytes",
            )
        self.used_bytes += nbytes
        free = self._pool.get(nbytes)
        if free:
            return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def give_back(self, buffer: torch.Tensor) -> None:
        """Return a buffer whose transfers have completed."""
        self.used_bytes -= buffer.numel()
        self._pool.setdefault(buffer.numel(), []).append(buffer)

    def close(self) -> None:
        """Release every pooled buffer."""
        self._pool.clear()
