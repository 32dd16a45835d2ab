"""Releasing the physical pages of a byte range in place, and the whole pages a range holds.

NOTE [release in place]
On CPU a chunk leaves memory without a copy: once its bytes are in the swap tier, the whole
pages inside its range go back to the kernel (``madvise(MADV_DONTNEED)``). The range stays mapped,
RSS drops at once, and a restore reads the bytes back into the same addresses (a use before it
reads zeros, never stale data). Only whole pages strictly inside the storage are released (the
end pages may hold the allocator's headers), so such a storage is chunked on the page grid
(``split_on_pages``). The copy path (``resize_``) stays where pages are not private: on CUDA,
and for shared-memory or file-backed storages.
"""

import ctypes
import ctypes.util
import mmap
import os

# The system's page size (4, 16 or 64 KiB), read by every page computation in vtensor/io where
# it is used, so a test can set it here.
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)

# NOTE [readings hold the GIL] in measure/trackers.py: the compute thread releases pages between
# two ops; giving up the GIL for a call this short would make it wait for any thread running
# Python.
_libc = ctypes.PyDLL(ctypes.util.find_library("c") or None, use_errno=True)
_madvise = _libc.madvise
_madvise.restype = ctypes.c_int
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def whole_pages(address: int, nbytes: int) -> tuple[int, int]:
    """The start and length of the whole pages inside ``[address, address + nbytes)``."""
    start = -(-address // PAGE_BYTES) * PAGE_BYTES
    stop = (address + nbytes) // PAGE_BYTES * PAGE_BYTES
    return start, max(0, stop - start)


def release(address: int, nbytes: int) -> int:
    """Hand the whole pages inside the range back to the kernel; returns the bytes released.

    Raises:
        OSError: the kernel refused (the range is not mapped memory of this process).
    """
    start, length = whole_pages(address, nbytes)
    if length and _madvise(start, length, _MADV_DONTNEED) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"madvise(MADV_DONTNEED) of {length} bytes: {os.strerror(errno)}")
    return length


_MADV_POPULATE_WRITE = 23  # Linux 5.14 and later


def populate(address: int, nbytes: int) -> int:
    """Fault in the whole pages inside the range now, as writable; returns the bytes populated.

    So a restore's pages count from its start, as under the heap counter (NOTE [CPU counter]).
    Without ``MADV_POPULATE_WRITE`` one byte of each page is written (they hold zeros).
    """
    start, length = whole_pages(address, nbytes)
    if not length:
        return 0
    if _madvise(start, length, _MADV_POPULATE_WRITE) != 0:
        pages = (ctypes.c_ubyte * length).from_address(start)
        for offset in range(0, length, PAGE_BYTES):
            pages[offset] = 0
    return length
