"""Integer arithmetic of SecAgg+: encode an update, mask it, and decode the unmasked sum (pure).

Vectors are uint64 and wrap mod 2**64; every modulus is a power of two that divides 2**64, so
sums mod 2**64 reduce correctly mod the modulus.
"""

from collections.abc import Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from flwr.common.secure_aggregation.quantization import dequantize, quantize
from numpy.typing import NDArray

from edgefl.secagg.protocol import MaskingParams

Vector = NDArray[np.uint64]
# NOTE [mask PRG]: masks are ChaCha20 keystream (the `cryptography` package) under a 32-byte
# seed. Flower's pseudo_rand_gen folds its seed into 32 bits for NumPy's Mersenne Twister (a
# 2**32 seed space, not a cryptographic generator) and draws from [0, modulus - 2]. Each seed
# keys one stream only (key pairs and private seeds are fresh every round), so a fixed nonce is
# safe.
_NONCE = b"\x00" * 16


def prg_mask(seed: bytes, length: int, modulus: int) -> Vector:
    """``length`` integers uniform on [0, modulus) from ChaCha20 keyed by a 32-byte ``seed``."""
    width = 4 if modulus <= 2**32 else 8
    stream = Cipher(algorithms.ChaCha20(seed, _NONCE), mode=None).encryptor()
    words = np.frombuffer(stream.update(bytes(length * width)), dtype=f"<u{width}")
    return words.astype(np.uint64) & np.uint64(modulus - 1)


def encode_update(
    delta: NDArray[np.float64], weight: int, params: MaskingParams
) -> tuple[Vector, int]:
    """``[weight, SR((clip(r * delta) + c) * T / 2c)...]`` with ``r = weight / max_weight``.

    Returns the vector and how many coordinates were clipped.
    """
    scaled = delta * (weight / params.max_weight)
    clipped = int(np.count_nonzero(np.abs(scaled) > params.clipping_range))
    (levels,) = quantize([scaled], params.clipping_range, params.quantization_range)
    vector = np.empty(delta.size + 1, dtype=np.uint64)
    vector[0] = weight
    vector[1:] = levels
    return vector, clipped


def apply_masks(
    vector: Vector,
    private_seed: bytes,
    pairwise: Sequence[tuple[bytes, int]],
    modulus: int,
) -> Vector:
    """``vector + PRG(private) + sum(sign * PRG(pairwise))`` mod ``modulus``; sign is +1 or -1."""
    out = vector + prg_mask(private_seed, vector.size, modulus)
    for seed, sign in pairwise:
        mask = prg_mask(seed, vector.size, modulus)
        out = out + mask if sign > 0 else out - mask
    return out & np.uint64(modulus - 1)


def decode_sum(
    total: Vector, num_clients: int, params: MaskingParams
) -> tuple[NDArray[np.float64], int]:
    """The weighted mean update and the total weight, from the sum of ``num_clients`` vectors."""
    total_weight = int(total[0])
    if total_weight <= 0:
        raise ValueError(f"the clients' total weight is {total_weight}; nothing to average")
    (shifted,) = dequantize(
        [total[1:].astype(np.float64)], params.clipping_range, params.quantization_range
    )
    # dequantize removes one client's offset c; the other num_clients - 1 remain.
    summed = shifted - (num_clients - 1) * params.clipping_range
    return summed * (params.max_weight / total_weight), total_weight
