"""Which tier takes a device's evicted bytes, and the transfer engine that moves them there.

NOTE [tier choice]
On CPU evicted bytes go to the swap file; on a CUDA device with its own memory, to pinned host
memory. On an integrated GPU pinned host memory is the very memory being freed, so ``AUTO`` sends
the bytes to the sealed swap file through staging slots (NOTE [staged swap]).
"""

from enum import StrEnum
from os import PathLike

import torch

from vtensor.errors import VTensorError
from vtensor.io.chunk import DEFAULT_CHUNK_BYTES
from vtensor.io.staged import StagedTransferEngine
from vtensor.io.staging import CudaCopier
from vtensor.io.tiers import HostTier, StorageTier
from vtensor.io.transfer import CudaTransferEngine, FileTransferEngine, TransferEngine


class Tier(StrEnum):
    """Where evicted bytes go (NOTE [tier choice])."""

    AUTO = "auto"  # the swap file on CPU and integrated GPUs, pinned host memory on other GPUs
    HOST = "host"  # pinned host memory (CUDA only)
    STORAGE = "storage"  # the sealed swap file (on CUDA through pinned staging slots)


def resolve_tier(device: torch.device, tier: Tier | str = Tier.AUTO) -> Tier:
    """The tier that takes ``device``'s evicted bytes: ``HOST`` or ``STORAGE``, never ``AUTO``.

    Raises:
        VTensorError: ``tier`` is not a tier, ``HOST`` was asked for off CUDA, or ``device``
            is neither a CPU nor a CUDA device.
    """
    try:
        chosen = Tier(tier)
    except ValueError:
        raise VTensorError(
            f"tier={tier!r} is not a tier; pass one of {[t.value for t in Tier]} "
            "or a vtensor.io.engines.Tier"
        ) from None
    if device.type not in ("cpu", "cuda"):
        raise VTensorError(f"device {device} is not supported; use a cpu or cuda device")
    if device.type == "cpu":
        if chosen is Tier.HOST:
            raise VTensorError(
                f"tier={chosen.value!r} needs a CUDA device (pinned host memory); on {device} "
                f"pass {Tier.AUTO.value!r} or {Tier.STORAGE.value!r} (the swap file)"
            )
        return Tier.STORAGE
    if chosen is Tier.AUTO:
        integrated = bool(torch.cuda.get_device_properties(device).is_integrated)
        return Tier.STORAGE if integrated else Tier.HOST
    return chosen


def engine_for(
    device: torch.device,
    *,
    tier: Tier | str = Tier.AUTO,
    host_capacity_bytes: int | None,
    storage_dir: str | PathLike[str] | None,
    drop_page_cache: bool,
    encrypt: bool,
    staging_bytes: int | None = None,
) -> TransferEngine:
    """The engine that moves ``device``'s chunks to the tier ``resolve_tier`` picks.

    ``staging_bytes``: one staging slot of the CUDA storage tier (None: the default chunk).
    """
    if resolve_tier(device, tier) is Tier.HOST:  # only ever on CUDA
        return CudaTransferEngine(device, HostTier(host_capacity_bytes))
    if device.type == "cpu":
        return FileTransferEngine(StorageTier(storage_dir, drop_page_cache), encrypt=encrypt)
    copier = CudaCopier(device)
    return StagedTransferEngine(
        StorageTier(storage_dir, drop_page_cache),
        copier,
        slot_bytes=staging_bytes or DEFAULT_CHUNK_BYTES,
        encrypt=encrypt,
    )
