"""Which bytes of a range are physically resident, asked of the kernel (``mincore``).

The dispatch tracker is an independent check, so it reads the page tables, not the manager's books.
"""

import ctypes
import ctypes.util
import os

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_mincore = _libc.mincore
_mincore.restype = ctypes.c_int
_mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_LOW_BIT = bytes(b & 1 for b in range(256))


def absent_bytes(address: int, nbytes: int) -> int:
    """Bytes of the whole pages inside ``[address, address + nbytes)`` that are not resident.

    A page the range shares with its neighbours is taken as resident.

    Raises:
        OSError: the range is not mapped memory of this process.
    """
    start = -(-address // PAGE_BYTES) * PAGE_BYTES
    pages = max(0, (address + nbytes) // PAGE_BYTES * PAGE_BYTES - start) // PAGE_BYTES
    if pages == 0:
        return 0
    vector = (ctypes.c_ubyte * pages)()
    if _mincore(start, pages * PAGE_BYTES, vector) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mincore of {pages} pages: {os.strerror(errno)}")
    # Bit 0 of each byte says "resident"; the other bits are reserved.
    return bytes(vector).translate(_LOW_BIT).count(0) * PAGE_BYTES
