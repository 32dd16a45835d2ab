"""The call that makes the allocator serving torch hand back the freed memory it still keeps.

Under the resident counter (NOTE [CPU counter]) a step could grow into pages the allocator keeps
without the reading moving, so before a step's entry reading the allocator hands them back:

- mimalloc: ``mi_collect(true)``, exported when preloaded; PyTorch's aarch64 wheels link it into
  ``libc10`` with hidden symbols, so its address is read from the static symbol table and checked
  to lie in libc10's code. ``purge_at_once`` sets its purge delay to 0 there.
- jemalloc: ``mallctl("arena.4096.purge")`` (4096: every arena).
- glibc: none is needed, the heap counter reads live bytes.
"""

import ctypes
import functools
import logging
import os
import struct
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# mimalloc's option number of purge_delay (mimalloc.h, 2.1 and later) and its default in ms.
_MI_PURGE_DELAY = 15
_MI_PURGE_DELAY_DEFAULT_MS = 10
_SHT_SYMTAB = 2
_STT_FUNC = 2
_JEMALLOC_PURGE_ALL = b"arena.4096.purge"
_LIBC10 = Path(torch.__file__).parent / "lib" / "libc10.so"


@functools.cache
def allocator_collect() -> Callable[[], None] | None:
    """The call that hands back the freed memory the allocator keeps; None where none is known."""
    process = ctypes.PyDLL(None)
    exported = getattr(process, "mi_collect", None)
    if exported is not None:
        return _bool_call(ctypes.cast(exported, ctypes.c_void_p).value or 0)
    mallctl = getattr(process, "mallctl", None)
    if mallctl is not None:
        mallctl.restype = ctypes.c_int
        mallctl.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p]
        mallctl.argtypes += [ctypes.c_void_p, ctypes.c_size_t]
        return functools.partial(mallctl, _JEMALLOC_PURGE_ALL, None, None, None, 0)
    return _bool_call(_local_function(_LIBC10, b"mi_collect"))


@functools.cache
def purge_at_once() -> bool:
    """Have the mimalloc inside libc10 hand freed pages back at once; whether it now does.

    Left alone where the user set ``MIMALLOC_PURGE_DELAY`` or the option is not at its default.
    """
    if "MIMALLOC_PURGE_DELAY" in os.environ:
        return os.environ["MIMALLOC_PURGE_DELAY"].strip() == "0"
    getter = _local_function(_LIBC10, b"mi_option_get")
    setter = _local_function(_LIBC10, b"mi_option_set")
    if not getter or not setter:
        return False
    get = ctypes.CFUNCTYPE(ctypes.c_long, ctypes.c_int)(getter)
    if int(get(_MI_PURGE_DELAY)) != _MI_PURGE_DELAY_DEFAULT_MS:
        return False
    ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_long)(setter)(_MI_PURGE_DELAY, 0)
    logger.info("torch's mimalloc now hands freed pages back at once (its purge delay set to 0)")
    return int(get(_MI_PURGE_DELAY)) == 0


def _bool_call(address: int) -> Callable[[], None] | None:
    if not address:
        return None
    return functools.partial(ctypes.CFUNCTYPE(None, ctypes.c_bool)(address), True)


def _local_function(library: Path, name: bytes) -> int:
    """The address of function ``name`` of the loaded ``library`` from its symbol table; 0: none."""
    mappings = _mappings(library)
    if not mappings:
        return 0
    try:
        value = _symbols(library).get(name)
        first_vaddr = _first_load_vaddr(library)
    except (OSError, struct.error, ValueError):
        return 0
    starts = [start for start, _, offset, _ in mappings if offset == 0]
    if value is None or first_vaddr is None or not starts:
        return 0
    # The segment at file offset 0 is mapped at the load base plus its own virtual address.
    address = starts[0] - first_vaddr + value
    inside = any(start <= address < end and "x" in perms for start, end, _, perms in mappings)
    return address if inside else 0


def _mappings(library: Path) -> list[tuple[int, int, int, str]]:
    """(start, end, file offset, permissions) of each mapping of ``library`` in this process."""
    found = []
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    target = str(library.resolve())
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found.append((start, end, int(fields[2], 16), fields[1]))
    return found


@functools.cache
def _first_load_vaddr(library: Path) -> int | None:
    """The virtual address of ``library``'s loadable segment at file offset 0."""
    with library.open("rb") as f:
        header = f.read(64)
        (phoff,) = struct.unpack_from("<Q", header, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", header, 0x36)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr = struct.unpack_from("<IIQQ", table, i * phentsize)
        if p_type == 1 and p_offset == 0:  # PT_LOAD
            return int(p_vaddr)
    return None


@functools.cache
def _symbols(library: Path) -> dict[bytes, int]:
    """Every sized function of ``library``'s ``.symtab`` whose name begins with ``mi_``."""
    return _functions(library.read_bytes(), b"mi_")


def _functions(image: bytes, prefix: bytes) -> dict[bytes, int]:
    """``st_value`` of each sized function named ``prefix...`` in an ELF64 LE ``.symtab``."""
    if image[:4] != b"\x7fELF" or image[4] != 2 or image[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    (shoff,) = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", image, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize) for i in range(shnum)
    ]
    found: dict[bytes, int] = {}
    for section in sections:
        if section[1] != _SHT_SYMTAB:
            continue
        offset, size, link, entsize = section[4], section[5], section[6], section[9]
        strings = sections[link][4]
        for at in range(offset, offset + size, entsize):
            st_name, st_info, _, _, st_value, st_size = struct.unpack_from("<IBBHQQ", image, at)
            if st_info & 0xF != _STT_FUNC or not st_size:
                continue
            start = strings + st_name
            if image.startswith(prefix, start):
                found[image[start : image.index(b"\0", start)]] = int(st_value)
    return found
