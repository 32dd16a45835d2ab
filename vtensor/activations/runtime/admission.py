"""Which saved tensors become vTensors: plain dense tensors on the device, not the model's own."""

import torch

from vtensor.activations.model_state import on_device_type

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


class Admission:
    """Admits a saved tensor to the manager: on the device, not protected, not too small.

    ``protected_storages``: the model's and optimizer's, which the manager never moves.
    """

    def __init__(
        self, device: torch.device, protected_storages: set[int], min_tensor_bytes: int
    ) -> None:
        self.device = device
        self._on_device = on_device_type(device)
        self.protected = protected_storages
        self.min_tensor_bytes = min_tensor_bytes

    def storage(self, tensor: torch.Tensor) -> torch.UntypedStorage | None:
        """The storage of a plain (strided, dense, on the device, unprotected) tensor, else None."""
        if type(tensor) not in _PLAIN_TENSOR_TYPES or tensor.layout != torch.strided:
            return None
        if not self._on_device(tensor) or tensor.is_quantized or tensor.is_nested:
            return None
        storage = tensor.untyped_storage()
        return None if storage._cdata in self.protected else storage

    def big_enough(self, storage: torch.UntypedStorage) -> bool:
        """``storage`` is large enough, and resizable (it can be released in place)."""
        return storage.nbytes() >= self.min_tensor_bytes and storage.resizable()
