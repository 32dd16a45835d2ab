"""Which saved tensors become vTensors: plain dense tensors on the device, not the model's own."""

import torch

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


class Admission:
    """Admits a saved tensor to the manager.

    Args:
        device: the managed device; tensors elsewhere are left to autograd.
        protected_storages: storages of the model and optimizer (parameters, buffers, state),
            which the manager never moves.
        min_tensor_bytes: smaller storages are not worth a vTensor.
    """

    def __init__(
        self, device: torch.device, protected_storages: set[int], min_tensor_bytes: int
    ) -> None:
        self.device = device
        self.protected = protected_storages
        self.min_tensor_bytes = min_tensor_bytes

    def plain(self, tensor: torch.Tensor) -> bool:
        """A strided, unquantized, not nested tensor of the device, not a protected storage."""
        if type(tensor) not in _PLAIN_TENSOR_TYPES or tensor.layout != torch.strided:
            return False
        if tensor.device.type != self.device.type or tensor.is_quantized or tensor.is_nested:
            return False
        return tensor.untyped_storage()._cdata not in self.protected

    def big_enough(self, tensor: torch.Tensor) -> bool:
        """Its storage is large enough, and resizable (it can be released in place)."""
        storage = tensor.untyped_storage()
        return storage.nbytes() >= self.min_tensor_bytes and storage.resizable()
