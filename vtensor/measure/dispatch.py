"""An independent check of device bytes: a dispatch mode that counts distinct live storages.

It depends on nothing the manager does; like any dispatch mode it costs every op: tests only.
"""

import functools
import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Self

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from vtensor.errors import VTensorError
from vtensor.measure.residency import absent_bytes

logger = logging.getLogger(__name__)


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

    Each storage an op outputs counts once until freed; older tensors count once passed to
    ``track``. ``UntypedStorage.resize_`` from Python is seen, so shrunk storages leave the count.
    On CPU a storage counts only its resident pages (``mincore``), asked only when the count
    could make a new peak. Ops on other threads are not seen; their resizes and frees are.

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
        # Device memory has no pages to release in place: only CPU storages are asked.
        self._pages = self.device.type == "cpu"
        # Keyed by StorageImpl address; see NOTE [storage keys].
        self._live: dict[int, _LiveStorage] = {}
        # Reentrant: a storage may die (and run _forget) in the middle of our own bookkeeping.
        self._lock = threading.RLock()
        self._current_bytes = 0
        self._peak_bytes = 0
        self._window_peak_bytes = 0
        self._marks: list[tuple[str, int]] = []
        # Set while tracking: undoes the patch of UntypedStorage.resize_.
        self._restore_resize: Callable[[], None] | None = None

    @property
    def current_bytes(self) -> int:
        """Bytes of the live storages counted now (resident bytes on CPU)."""
        with self._lock:
            return self._resident_bytes()

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
            self._peak_bytes = self._window_peak_bytes = self._resident_bytes()

    def mark(self, name: str) -> None:
        """Records the peak since the previous mark (or start) as ``name``; starts a new window."""
        with self._lock:
            self._marks.append((name, self._window_peak_bytes))
            self._window_peak_bytes = self._resident_bytes()

    def track(self, *tensors: torch.Tensor) -> None:
        """Counts the storages of tensors made before tracking (parameters, inputs, ...)."""
        for t in tensors:
            self._see_tensor(t)

    def __enter__(self) -> Self:
        if self._restore_resize is not None:
            raise VTensorError("LiveStorageTracker is already active; it cannot nest in itself.")
        self._restore_resize = self._install_resize_hook()
        try:
            entered: Self = super().__enter__()  # type: ignore[no-untyped-call]
            return entered
        except BaseException:
            self._uninstall_resize_hook()
            raise

    def __exit__(self, *exc_info: object) -> None:
        try:
            super().__exit__(*exc_info)  # type: ignore[no-untyped-call]
        finally:
            self._uninstall_resize_hook()

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
                weak = StorageWeakRef(st)  # type: ignore[no-untyped-call]
                self._live[key] = _LiveStorage(weak, alive, nbytes)
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
        # The resident bytes never exceed the counted ones: only a count above a peak can
        # make a new one, so only then are the page tables asked.
        if self._current_bytes > min(self._peak_bytes, self._window_peak_bytes):
            now = self._resident_bytes()
            self._peak_bytes = max(self._peak_bytes, now)
            self._window_peak_bytes = max(self._window_peak_bytes, now)

    def _resident_bytes(self) -> int:
        """The counted bytes less the whole pages of live storages that are not resident."""
        if not self._pages:
            return self._current_bytes
        absent = 0
        for record in list(self._live.values()):
            storage = record.alive()
            if storage is not None and record.nbytes:
                absent += absent_bytes(storage.data_ptr(), record.nbytes)
        return self._current_bytes - absent

    def _install_resize_hook(self) -> Callable[[], None]:
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
        return restore

    def _uninstall_resize_hook(self) -> None:
        if self._restore_resize is not None:
            self._restore_resize()
            self._restore_resize = None
