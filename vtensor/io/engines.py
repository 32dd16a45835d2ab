"""Which transfer engine serves a device: pinned host RAM for CUDA, the swap file on CPU."""

from os import PathLike

import torch

from vtensor.errors import VTensorError
from vtensor.io.tiers import HostTier, StorageTier
from vtensor.io.transfer import CudaTransferEngine, FileTransferEngine, TransferEngine


def engine_for(
    device: torch.device,
    *,
    host_capacity_bytes: int | None,
    storage_dir: str | PathLike[str] | None,
    drop_page_cache: bool,
    encrypt: bool,
) -> TransferEngine:
    """The engine that moves ``device``'s chunks to its slower tier.

    Raises:
        VTensorError: ``device`` is neither a CPU nor a CUDA device.
    """
    if device.type == "cuda":
        return CudaTransferEngine(device, HostTier(host_capacity_bytes))
    if device.type == "cpu":
        return FileTransferEngine(StorageTier(storage_dir, drop_page_cache), encrypt=encrypt)
    raise VTensorError(f"device {device} is not supported; use a cpu or cuda device")
