"""Copies between device memory and pinned staging buffers, behind an injectable interface.

``CudaCopier`` runs the copies on a side stream; a test can pass one of plain CPU tensors.
"""

from typing import Protocol

import torch


class Fence(Protocol):
    """The end of a copy (or of the compute work a copy must follow)."""

    def synchronize(self) -> None:
        """Block the calling thread until it is reached."""
        ...


class DeviceCopier(Protocol):
    """Allocates staging buffers and copies between them and device memory."""

    def staging(self, nbytes: int) -> torch.Tensor:
        """A host uint8 buffer of ``nbytes`` the copier can copy to and from (pinned on CUDA)."""
        ...

    def mark(self) -> Fence:
        """On the compute thread: the compute work queued so far, which a later copy follows."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Fence) -> Fence:
        """Start copying ``src`` into ``dst`` once ``after`` is reached; returns its end."""
        ...

    def close(self) -> None:
        """Wait for every copy started."""
        ...


class CudaCopier:
    """Copies on one side stream of ``device``, each after the compute work it must follow.

    A restore's copy follows the compute work queued when it was asked for (the allocator may
    have handed that memory out under running kernels); an eviction's follows the work that made
    the bytes. The staged engine waits on each copy's event before touching the staging buffer.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def staging(self, nbytes: int) -> torch.Tensor:  # noqa: D102
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def mark(self) -> Fence:  # noqa: D102
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Fence) -> Fence:  # noqa: D102
        assert isinstance(after, torch.cuda.Event), "a fence from another copier"
        self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(self.stream)
        return done

    def close(self) -> None:  # noqa: D102
        self.stream.synchronize()
