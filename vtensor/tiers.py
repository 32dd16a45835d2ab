"""Slower tiers that hold evicted chunks: a swap file on storage, and pinned host memory on CUDA."""

import bisect
import ctypes
import errno
import logging
import os
import tempfile
from pathlib import Path

import torch

from vtensor.errors import StorageTierError

logger = logging.getLogger(__name__)

PAGE_BYTES = 4096


def _round_up(nbytes: int, multiple: int) -> int:
    return -(-nbytes // multiple) * multiple


def _buffer_at(address: int, nbytes: int) -> memoryview:
    """A writable byte view of raw memory, for I/O straight into and out of tensor storage."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


class ExtentAllocator:
    """First-fit allocator of page-aligned byte extents in a growing file; frees coalesce."""

    def __init__(self) -> None:
        self._free: list[tuple[int, int]] = []  # sorted (offset, length)
        self.end_bytes = 0  # file size high-water mark
        self.used_bytes = 0

    def alloc(self, nbytes: int) -> int:
        """Return the offset of a free extent of at least ``nbytes`` (page-rounded)."""
        size = _round_up(nbytes, PAGE_BYTES)
        for i, (offset, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, length - size)
                self.used_bytes += size
                return offset
        offset = self.end_bytes
        self.end_bytes += size
        self.used_bytes += size
        return offset

    def free(self, offset: int, nbytes: int) -> None:
        """Return an extent given by :meth:`alloc`."""
        size = _round_up(nbytes, PAGE_BYTES)
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


class StorageTier:
    """One swap file per session, read and written with raw ``pwrite``/``preadv``.

    NOTE [anonymous swap file]
    The file is created with ``mkstemp`` in ``directory`` and unlinked at once: it lives only as
    long as this process holds its descriptor, so it is gone after a normal exit, an exception,
    Ctrl-C and even SIGKILL, and no other process can open it by name. After every write the
    pages are flushed (``fdatasync``) and dropped from the page cache (``POSIX_FADV_DONTNEED``):
    without that, "swapped out" bytes would only move from the process into the page cache and
    the machine's RAM would not shrink (measured in docs/vtensor.md).
    """

    def __init__(self, directory: str | os.PathLike[str] | None, drop_page_cache: bool = True):
        root = Path(directory) if directory is not None else Path(tempfile.gettempdir())
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix="vtensor-", suffix=".swap", dir=root)
        except OSError as exc:
            raise StorageTierError(
                exc.errno or errno.EIO,
                f"cannot create a swap file in storage_dir={str(root)!r} ({exc.strerror}); "
                "pass a writable directory as storage_dir",
            ) from exc
        os.unlink(path)
        self.directory = root
        self.drop_page_cache = drop_page_cache
        self._fd: int | None = fd
        self.extents = ExtentAllocator()

    @property
    def fd(self) -> int:
        """The open descriptor of the (unlinked) swap file."""
        if self._fd is None:
            raise StorageTierError(errno.EBADF, "the storage tier is closed")
        return self._fd

    def write(self, offset: int, address: int, nbytes: int) -> None:
        """Write ``nbytes`` from memory at ``address`` to the file at ``offset`` (any thread)."""
        view = _buffer_at(address, nbytes)
        done = 0
        try:
            while done < nbytes:
                done += os.pwrite(self.fd, view[done:], offset + done)
        except OSError as exc:
            raise StorageTierError(
                exc.errno or errno.EIO,
                f"writing {nbytes} bytes to the swap file in {str(self.directory)!r} failed "
                f"({exc.strerror}); free space there or pass another storage_dir",
            ) from exc

    def read(self, offset: int, address: int, nbytes: int) -> None:
        """Read ``nbytes`` at ``offset`` into memory at ``address`` (any thread)."""
        view = _buffer_at(address, nbytes)
        done = 0
        while done < nbytes:
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got == 0:
                raise StorageTierError(
                    errno.EIO, f"swap file ended at {offset + done}, expected {nbytes} bytes"
                )
            done += got

    def release_cache(self, offset: int, nbytes: int, *, dirty: bool) -> None:
        """Drop a range from the page cache so the RAM it used is really free."""
        if not self.drop_page_cache:
            return
        if dirty:
            os.fdatasync(self.fd)
        os.posix_fadvise(self.fd, offset, _round_up(nbytes, PAGE_BYTES), os.POSIX_FADV_DONTNEED)

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
