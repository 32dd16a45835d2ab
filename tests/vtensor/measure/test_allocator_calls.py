"""The allocator's collect call, and functions of a loaded library read from its symbol table."""

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vtensor.measure import allocator_calls

LIBC10 = Path(torch.__file__).parent / "lib" / "libc10.so"


def test_a_function_address_from_the_symbol_table_is_where_the_loader_put_it() -> None:
    exported = b"_ZN3c1015GetCPUAllocatorEv"  # exported too, so the loader can say where it is
    loaded = ctypes.cast(getattr(ctypes.CDLL(str(LIBC10)), exported.decode()), ctypes.c_void_p)
    image = LIBC10.read_bytes()
    assert exported in allocator_calls._functions(image, b"_ZN3c1015GetCPU")
    found = allocator_calls._functions(image, b"_ZN3c1015GetCPU")[exported]
    base = next(s for s, _, offset, _ in allocator_calls._mappings(LIBC10) if offset == 0)
    first = allocator_calls._first_load_vaddr(LIBC10)
    assert first is not None and base - first + found == loaded.value


def test_a_name_the_library_lacks_has_no_address() -> None:
    assert allocator_calls._local_function(LIBC10, b"mi_no_such_function") == 0
    assert allocator_calls._local_function(Path("/nonexistent/lib.so"), b"mi_collect") == 0


def test_the_user_s_purge_delay_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    allocator_calls.purge_at_once.cache_clear()
    monkeypatch.setenv("MIMALLOC_PURGE_DELAY", "25")
    try:
        assert allocator_calls.purge_at_once() is False
    finally:
        allocator_calls.purge_at_once.cache_clear()


@pytest.mark.parametrize(
    ("preload", "env"),
    [
        ("libmimalloc.so.2", {"MIMALLOC_RESET_DELAY": "0"}),
        ("libjemalloc.so.2", {"MALLOC_CONF": "dirty_decay_ms:0,muzzy_decay_ms:0"}),
    ],
)
def test_collect_hands_back_what_the_allocator_keeps(preload: str, env: dict[str, str]) -> None:
    lib = Path("/usr/lib/x86_64-linux-gnu") / preload
    if not lib.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{lib} is missing: .ci/run installs libmimalloc2.0 and libjemalloc2")
        pytest.skip(f"{lib} is missing (apt-get install libmimalloc2.0 libjemalloc2)")
    code = (
        "from vtensor.measure.allocator_calls import allocator_collect\n"
        "collect = allocator_collect(); assert collect is not None; collect(); print('ok')"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MIMALLOC_", "MALLOC_"))}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, "LD_PRELOAD": str(lib), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
