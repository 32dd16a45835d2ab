"""Authenticated encryption of swapped chunks under a per-run key that never leaves memory.

NOTE [sealed swap]
Each chunk written to the swap file is sealed with an AEAD cipher in segments of at most
``SEGMENT_BYTES``, so the staging buffer stays small at any chunk size.

- Key: 32 bytes from ``os.urandom`` per ``Sealer``, held only by the cipher object; never written.
- Nonce: a 96-bit counter, one value per sealed segment, never reused under one key.
- Tag: kept in memory by the segment's file offset, with the nonce and generation; the file holds
  ciphertext only, at plaintext's offsets, so extents and page alignment are unchanged.
- Associated data: the chunk's identity (storage, index, segment place and length) and the
  write generation, recomputed at restore: a modified, stale or another chunk's extent fails
  authentication (``SwapAuthenticationError``) and its destination is zeroed.

One ``pwritev``/``preadv`` moves a whole staging buffer of ``[ciphertext | tag]`` segments.
"""

import ctypes
import itertools
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NoReturn

import cryptography
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from vtensor.errors import SwapAuthenticationError, VTensorError
from vtensor.io.tiers import buffer_at

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
SEGMENT_BYTES = 1 << 20  # most plaintext under one nonce and tag
STAGING_SEGMENTS = 4  # full segments per staging buffer, so per pwritev / preadv
MAX_IOVECS = 512  # buffers per vectored call, below Linux's IOV_MAX of 1024
_NONCE_LIMIT = 1 << (8 * NONCE_BYTES)
# domain, owner (vTensor storage), chunk index, segment offset in chunk, segment bytes, generation
_AAD = struct.Struct("<8sQQQQQ")
_DOMAIN = b"vtswap-1"

Io = Callable[[int, list[memoryview]], None]  # (file offset, buffers back to back) -> all moved


class Cipher(StrEnum):
    """AEAD ciphers the storage tier can seal with."""

    AES_256_GCM = "aes-256-gcm"
    CHACHA20_POLY1305 = "chacha20-poly1305"


# Several times ChaCha20-Poly1305's throughput on CPUs with AES instructions (AES-NI, VAES).
DEFAULT_CIPHER = Cipher.AES_256_GCM


@dataclass(frozen=True)
class Piece:
    """One chunk to seal or open: its place in the file and in memory, and whose it is.

    Attributes:
        owner: identity of its vTensor (the storage's address), fixed while it is swapped.
        index: its position within its vTensor.
        part_offset: where it starts within its chunk, when sealed in parts (``io/staged.py``).
    """

    file_offset: int
    address: int
    nbytes: int
    owner: int
    index: int
    part_offset: int = 0


@dataclass(frozen=True)
class _Seal:
    nonce: int
    tag: bytes
    generation: int
    nbytes: int


class Sealer:
    """Seals pieces on their way to storage and opens them on their way back.

    ``seal`` and ``open`` run on the engine's one I/O thread; the AEAD calls release the GIL.
    """

    def __init__(self, cipher: Cipher | str = DEFAULT_CIPHER) -> None:
        try:
            self.cipher = Cipher(cipher)
        except ValueError:
            raise VTensorError(
                f"cipher={cipher!r} is not one of {[c.value for c in Cipher]}"
            ) from None
        if not hasattr(AESGCM, "encrypt_into"):
            raise VTensorError(
                f"sealing the swap file needs cryptography>=47 (AEAD encrypt_into); "
                f"{cryptography.__version__} is installed: pip install 'cryptography>=47'"
            )
        key = bytearray(os.urandom(KEY_BYTES))
        aead = AESGCM if self.cipher is Cipher.AES_256_GCM else ChaCha20Poly1305
        self._aead: AESGCM | ChaCha20Poly1305 | None = aead(key)
        key[:] = bytes(KEY_BYTES)  # the cipher keeps its own copy; drop ours at once
        self._nonces = itertools.count()
        self._generations = itertools.count(1)
        self._seals: dict[int, _Seal] = {}  # file offset of a segment -> how it was sealed
        self._staging = bytearray(STAGING_SEGMENTS * (SEGMENT_BYTES + TAG_BYTES))

    @property
    def sealed_segments(self) -> int:
        """Segments whose tags are held (sealed and not yet forgotten)."""
        return len(self._seals)

    def _cipher(self) -> AESGCM | ChaCha20Poly1305:
        if self._aead is None:
            raise VTensorError("the sealer is closed: its key is gone")
        return self._aead

    @staticmethod
    def _aad(piece: Piece, offset: int, nbytes: int, generation: int) -> bytes:
        where = piece.part_offset + offset
        return _AAD.pack(_DOMAIN, piece.owner, piece.index, where, nbytes, generation)

    def _batches(self, pieces: Sequence[Piece]) -> Iterator[list[tuple[Piece, int, int, int]]]:
        """(piece, offset, bytes, staging position) groups, each one staging buffer of file."""
        batch: list[tuple[Piece, int, int, int]] = []
        position = 0
        file_end = -1
        for piece in pieces:
            for offset in range(0, piece.nbytes, SEGMENT_BYTES):
                nbytes = min(SEGMENT_BYTES, piece.nbytes - offset)
                full = position + nbytes + TAG_BYTES > len(self._staging)
                apart = piece.file_offset + offset != file_end
                if batch and (full or apart or len(batch) == MAX_IOVECS):
                    yield batch
                    batch, position = [], 0
                batch.append((piece, offset, nbytes, position))
                position += nbytes + TAG_BYTES
                file_end = piece.file_offset + offset + nbytes
        if batch:
            yield batch

    def seal(self, pieces: Sequence[Piece], write: Io) -> None:
        """Encrypt ``pieces`` (one eviction run, one new generation) and ``write`` them."""
        aead = self._cipher()
        generation = next(self._generations)
        staging = memoryview(self._staging)
        for batch in self._batches(pieces):
            parts = []
            for piece, offset, nbytes, position in batch:
                nonce = next(self._nonces)
                assert nonce < _NONCE_LIMIT, "nonce counter exhausted"
                out = staging[position : position + nbytes + TAG_BYTES]
                aead.encrypt_into(
                    nonce.to_bytes(NONCE_BYTES, "little"),
                    buffer_at(piece.address + offset, nbytes),
                    self._aad(piece, offset, nbytes, generation),
                    out,
                )
                tag = bytes(out[nbytes:])
                self._seals[piece.file_offset + offset] = _Seal(nonce, tag, generation, nbytes)
                parts.append(out[:nbytes])
            write(batch[0][0].file_offset + batch[0][1], parts)

    def open(self, pieces: Sequence[Piece], read: Io) -> None:
        """``read`` sealed ``pieces`` and decrypt them into memory, authenticating every byte.

        Raises:
            SwapAuthenticationError: a segment's bytes or identity do not match what was
                sealed; its memory is zeroed.
        """
        aead = self._cipher()
        staging = memoryview(self._staging)
        for batch in self._batches(pieces):
            read(
                batch[0][0].file_offset + batch[0][1],
                [staging[pos : pos + nbytes] for _, _, nbytes, pos in batch],
            )
            for piece, offset, nbytes, position in batch:
                where = piece.file_offset + offset
                seal = self._seals.get(where)
                if seal is None or seal.nbytes != nbytes:
                    self._reject(piece, offset, nbytes, "nothing of that size was sealed there")
                staging[position + nbytes : position + nbytes + TAG_BYTES] = seal.tag
                try:
                    aead.decrypt_into(
                        seal.nonce.to_bytes(NONCE_BYTES, "little"),
                        staging[position : position + nbytes + TAG_BYTES],
                        self._aad(piece, offset, nbytes, seal.generation),
                        buffer_at(piece.address + offset, nbytes),
                    )
                except InvalidTag:
                    self._reject(piece, offset, nbytes, "the tag does not match")

    @staticmethod
    def _reject(piece: Piece, offset: int, nbytes: int, why: str) -> NoReturn:
        ctypes.memset(piece.address + offset, 0, nbytes)
        raise SwapAuthenticationError(
            f"swap-file extent at offset {piece.file_offset + offset} ({nbytes} bytes of chunk "
            f"{piece.index}, at {piece.part_offset + offset} in the chunk) failed authentication: "
            f"{why}. It was modified, replaced by a stale or another chunk's extent, or corrupted "
            "after vtensor wrote it; its bytes are not used. Check the storage device and rerun "
            "the step."
        )

    def forget(self, file_offset: int, nbytes: int) -> None:
        """Drop the tags of a piece whose slot was released (its extent may be reused)."""
        for offset in range(0, nbytes, SEGMENT_BYTES):
            self._seals.pop(file_offset + offset, None)

    def close(self) -> None:
        """Drop the key and every tag: what the file holds can no longer be opened."""
        self._aead = None
        self._seals.clear()
