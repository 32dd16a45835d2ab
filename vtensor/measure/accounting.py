"""Measuring device-tier memory: cheap allocator counters, an independent live-storage check, RSS.

Three views of "how many device bytes are in use", from cheapest to most independent:

- ``MallocTracker`` / ``CudaTracker`` (via ``make_device_tracker``): the manager's own counters,
  cheap enough to call on every chunk move. On CPU this is glibc ``mallinfo2()`` (in-use heap chunks
  plus mmapped blocks, ~0.3-0.4 us per call); it counts every malloc user, not only tensors.
- ``LiveStorageTracker``: a ``TorchDispatchMode`` that counts the distinct live storages of one
  device. It does not depend on anything the manager does, so tests use it to check that the
  manager keeps its budget. It adds tens of us per op (measured: a 47-op conv training step went
  from 24 to 28 ms, most of it the cost of any Python dispatch mode): profiling and tests only.
- ``vtensor.measure.rss.RssMeter``: what the operating system charges the process.
"""

import ctypes
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, Self, runtime_checkable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from vtensor.errors import VTensorError

logger = logging.getLogger(__name__)


@runtime_checkable
class DeviceTracker(Protocol):
    """Anything that reports the bytes currently allocated on one device."""

    def current_bytes(self) -> int:
        """Returns the bytes currently allocated on the device."""
        ...


class _MallInfo2(ctypes.Structure):
    # Field order of glibc's `struct mallinfo2` (malloc.h, glibc >= 2.33); every field is a size_t.
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


class MallocTracker:
    """Live heap bytes of this process from glibc ``mallinfo2()`` (in-use chunks + mmapped blocks).

    Counts every malloc user, not only tensors; use differences between two calls. Meaningless if
    another allocator (jemalloc, tcmalloc) was preloaded, since glibc's heap is then unused.
    """

    def __init__(self) -> None:
        try:
            mallinfo2 = ctypes.CDLL(None).mallinfo2
        except (AttributeError, OSError) as exc:
            raise VTensorError(
                "MallocTracker needs glibc's mallinfo2() (glibc >= 2.33), which this process does "
                "not provide. On another C library, measure with LiveStorageTracker or "
                "vtensor.measure.rss.RssMeter."
            ) from exc
        mallinfo2.restype = _MallInfo2
        mallinfo2.argtypes = []
        self._mallinfo2: Callable[[], _MallInfo2] = mallinfo2

    def current_bytes(self) -> int:
        """Returns the bytes in allocated heap chunks plus mmapped blocks, over all arenas."""
        info = self._mallinfo2()
        return int(info.uordblks + info.hblkhd)


class CudaTracker:
    """Bytes held by tensors on one CUDA device, from the caching allocator's own statistics.

    Counts tensor bytes (rounded up to the allocator's 512 B blocks), not reserved segments.
    """

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise VTensorError(f"CudaTracker needs a cuda device, got {device}; use MallocTracker.")
        if not torch.cuda.is_available():
            raise VTensorError(
                f"CudaTracker for {device}: CUDA is not available in this process (CPU-only torch "
                "build or no visible GPU). Use a cpu device."
            )
        # Pin the index now: a bare "cuda" would follow whatever device is current at call time.
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)

    def current_bytes(self) -> int:
        """Returns the bytes currently allocated to tensors on the device."""
        return torch.cuda.memory_allocated(self.device)

    def peak_bytes(self) -> int:
        """Returns the most bytes allocated to tensors on the device since the last reset."""
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        """Starts a new peak window at the current allocation (resets all the device's peaks)."""
        torch.cuda.reset_peak_memory_stats(self.device)


def make_device_tracker(device: torch.device) -> DeviceTracker:
    """Returns the cheap allocation counter for ``device``.

    Raises:
        VTensorError: the device type has no tracker, or its backend is unavailable.
    """
    if device.type == "cpu":
        return MallocTracker()
    if device.type == "cuda":
        return CudaTracker(device)
    raise VTensorError(f"no device tracker for {device}: use a cpu or cuda device.")


@dataclass(slots=True)
class _LiveStorage:
    # NOTE [storage keys]: StorageImpl addresses are reused as soon as a storage is freed, but
    # `weak` (a weak count on the StorageImpl) keeps the address taken while this record exists,
    # which makes the address a safe dict key; `alive` carries the callback that drops the record.
    weak: StorageWeakRef
    alive: "weakref.ref[torch.UntypedStorage]"
    nbytes: int


def _on_device(device: torch.device, wanted: torch.device) -> bool:
    return device.type == wanted.type and (wanted.index is None or device.index == wanted.index)


class LiveStorageTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the bytes of distinct live storages on one device, independently of the manager.

    Every tensor output by an op while the mode is active is counted once per storage (views share
    their base's storage); tensors that already exist are counted once passed to ``track`` (or once
    an op returns them). A storage leaves the count when it is freed. ``UntypedStorage.resize_``
    calls made from Python while the mode is active are seen, so bytes the manager swaps out by
    shrinking a storage leave the count too. Tensors made without an op (``torch.from_numpy``) are
    not seen until an op returns them. Dispatch modes are per thread: ops run on other Python
    threads (a transfer worker) are not seen, while their ``resize_`` calls and frees are.

    Usage::

        tracker = LiveStorageTracker()
        tracker.track(*model.parameters())
        with tracker:
            loss = model(x).sum()
            tracker.mark("forward")
            loss.backward()
            tracker.mark("backward")
        tracker.marks  # [("forward", peak_bytes), ("backward", peak_bytes)]
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.device = torch.device(device)
        # Keyed by StorageImpl address; see NOTE [storage keys].
        self._live: dict[int, _LiveStorage] = {}
        # Reentrant: a storage may die (and run _forget) in the middle of our own bookkeeping.
        self._lock = threading.RLock()
        self._current_bytes = 0
        self._peak_bytes = 0
        self._window_peak_bytes = 0
        self._marks: list[tuple[str, int]] = []
        self._active = False
        self._restore_resize: Callable[[], None] | None = None

    @property
    def current_bytes(self) -> int:
        """Bytes of the live storages counted now."""
        return self._current_bytes

    @property
    def peak_bytes(self) -> int:
        """Most bytes counted at once since tracking began or ``reset_peak``."""
        return self._peak_bytes

    @property
    def marks(self) -> list[tuple[str, int]]:
        """``(name, peak_bytes since the previous mark)`` for each ``mark`` call, oldest first."""
        return list(self._marks)

    def reset_peak(self) -> None:
        """Starts new peak windows (overall and per mark) at the current count."""
        with self._lock:
            self._peak_bytes = self._current_bytes
            self._window_peak_bytes = self._current_bytes

    def mark(self, name: str) -> None:
        """Records the peak since the previous mark (or start) as ``name``; starts a new window."""
        with self._lock:
            self._marks.append((name, self._window_peak_bytes))
            self._window_peak_bytes = self._current_bytes

    def track(self, *tensors: torch.Tensor) -> None:
        """Counts the storages of tensors made before tracking (parameters, inputs, ...)."""
        for t in tensors:
            self._see_tensor(t)

    def __enter__(self) -> Self:
        if self._active:
            raise VTensorError("LiveStorageTracker is already active; it cannot nest in itself.")
        self._install_resize_hook()
        self._active = True
        try:
            entered: Self = super().__enter__()  # type: ignore[no-untyped-call]
            return entered
        except BaseException:
            self._uninstall_resize_hook()
            self._active = False
            raise

    def __exit__(self, *exc_info: object) -> None:
        try:
            super().__exit__(*exc_info)  # type: ignore[no-untyped-call]
        finally:
            self._uninstall_resize_hook()
            self._active = False

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._see_tensor(leaf)
        return out

    def _see_tensor(self, t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):
            inner_names, _ = t.__tensor_flatten__()
            for name in inner_names:
                self._see_tensor(getattr(t, name))
            return
        # Sparse, nested and meta tensors have no untyped storage of this device to count.
        if t.layout != torch.strided or not _on_device(t.device, self.device):
            return
        self._see_storage(t.untyped_storage())

    def _see_storage(self, st: torch.UntypedStorage) -> None:
        key = st._cdata
        nbytes = st.nbytes()
        with self._lock:
            record = self._live.get(key)
            if record is None:
                # Storage Python objects are preserved while the StorageImpl lives, so this
                # callback runs exactly when the storage is freed.
                alive = weakref.ref(st, functools.partial(self._forget, key))
                self._live[key] = _LiveStorage(_storage_weak_ref(st), alive, nbytes)
                self._add(nbytes)
            elif record.nbytes != nbytes:
                # aten resize_/set_ change a known storage's size in place.
                self._add(nbytes - record.nbytes)
                record.nbytes = nbytes

    def _forget(self, key: int, alive: "weakref.ref[torch.UntypedStorage]") -> None:
        with self._lock:
            record = self._live.get(key)
            if record is not None and record.alive is alive:
                del self._live[key]
                self._add(-record.nbytes)

    def _add(self, delta_bytes: int) -> None:
        self._current_bytes += delta_bytes
        if self._current_bytes > self._peak_bytes:
            self._peak_bytes = self._current_bytes
        if self._current_bytes > self._window_peak_bytes:
            self._window_peak_bytes = self._current_bytes

    def _install_resize_hook(self) -> None:
        # UntypedStorage.resize_ does not go through the dispatcher, so the mode never sees it;
        # torch's own mem_tracker patches it the same way (_track_resize).
        cls = torch.UntypedStorage
        had_own = "resize_" in cls.__dict__
        original = cls.resize_

        @functools.wraps(original)
        def resize_(st: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
            result: torch.UntypedStorage = original(st, size)
            if _on_device(st.device, self.device):
                self._see_storage(st)
            return result

        def restore() -> None:
            if cls.__dict__.get("resize_") is not resize_:
                logger.warning("UntypedStorage.resize_ was patched again while tracking; undoing")
            if had_own:
                cls.resize_ = original  # type: ignore[method-assign]
            else:
                del cls.resize_

        cls.resize_ = resize_  # type: ignore[method-assign,assignment]
        self._restore_resize = restore

    def _uninstall_resize_hook(self) -> None:
        if self._restore_resize is not None:
            self._restore_resize()
            self._restore_resize = None


def _storage_weak_ref(st: torch.UntypedStorage) -> StorageWeakRef:
    return StorageWeakRef(st)  # type: ignore[no-untyped-call]
