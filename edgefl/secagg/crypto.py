"""Key agreement, encrypted share transfer and Shamir sharing: glue over Flower's SecAgg helpers.

Key pairs are ECDH on P-384 (Flower's ``generate_key_pairs``, `cryptography`); a shared key is
HKDF-SHA256 of the ECDH secret (``generate_shared_key``); shares travel under Fernet
(AES-128-CBC + HMAC-SHA256, ``encrypt``/``decrypt``) with sender and receiver ids inside the
authenticated plaintext; Shamir sharing is Flower's (pycryptodome, GF(2^128) per 16-byte block).
"""

import base64

from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
    decrypt,
    encrypt,
    generate_shared_key,
)
from flwr.common.secure_aggregation.secaggplus_utils import (
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)
from flwr.supercore.primitives.asymmetric import (
    bytes_to_private_key,
    bytes_to_public_key,
    generate_key_pairs,
    private_key_to_bytes,
    public_key_to_bytes,
)

from edgefl.secagg.errors import SecAggProtocolError


def new_key_pair() -> tuple[bytes, bytes]:
    """A fresh (private PEM, public PEM) ECDH key pair."""
    private, public = generate_key_pairs()
    return private_key_to_bytes(private), public_key_to_bytes(public)


def public_key_of(private_pem: bytes) -> bytes:
    """The public PEM of a private PEM (checks a reconstructed key against the one published)."""
    return public_key_to_bytes(bytes_to_private_key(private_pem).public_key())


def _shared_key(private_pem: bytes, public_pem: bytes) -> bytes:
    """URL-safe base64 of 32 bytes agreed by ECDH + HKDF (Fernet's key format)."""
    return generate_shared_key(bytes_to_private_key(private_pem), bytes_to_public_key(public_pem))


def mask_seed(private_pem: bytes, public_pem: bytes) -> bytes:
    """The 32-byte seed of the pairwise mask two clients agree on (from their first keys)."""
    return base64.urlsafe_b64decode(_shared_key(private_pem, public_pem))


def seal_shares(
    src: int,
    dst: int,
    seed_share: bytes,
    key_share: bytes,
    private_pem: bytes,
    dst_public_pem: bytes,
) -> bytes:
    """Encrypt ``src``'s shares for ``dst`` under their agreed key (from their second keys)."""
    plaintext = share_keys_plaintext_concat(src, dst, seed_share, key_share)
    return encrypt(_shared_key(private_pem, dst_public_pem), plaintext)


def open_shares(
    ciphertext: bytes, src: int, dst: int, private_pem: bytes, src_public_pem: bytes
) -> tuple[bytes, bytes]:
    """Decrypt the (seed share, key share) ``src`` sealed for ``dst``; check both ids inside."""
    plaintext = decrypt(_shared_key(private_pem, src_public_pem), ciphertext)
    actual_src, actual_dst, seed_share, key_share = share_keys_plaintext_separate(plaintext)
    if (actual_src, actual_dst) != (src, dst):
        raise SecAggProtocolError(
            f"node {dst}: shares forwarded as {src} -> {dst} were sealed as "
            f"{actual_src} -> {actual_dst}"
        )
    return seed_share, key_share


def split_secret(secret: bytes, threshold: int, num_shares: int) -> list[bytes]:
    """Shamir shares of ``secret``: any ``threshold`` of the ``num_shares`` rebuild it."""
    return create_shares(secret, threshold, num_shares)


def join_shares(shares: list[bytes]) -> bytes:
    """The secret behind at least ``threshold`` shares."""
    return combine_shares(shares)
