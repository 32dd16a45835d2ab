"""Weight files: write any state_dict with 4 KiB-aligned tensor data, and open and check one.

NOTE [weight file format v1] (docs/demand-layering.md describes it in full): a 24-byte preamble
(magic, version, header CRC-32 and length), a JSON header (per tensor: name, dtype, shape,
offset, nbytes, crc32; the file's size), then each tensor's bytes at a 4096-aligned offset, as
``O_DIRECT`` needs. The size check catches truncation on open, the per-tensor CRC-32 corruption
on read. safetensors files are read as well (no checksums, no alignment).
"""

import json
import math
import os
import struct
import zlib
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vtensor.errors import (
    WeightFileChecksumError,
    WeightFileError,
    WeightFileFormatError,
    WeightFileMismatchError,
    WeightFileTruncatedError,
    WeightFileVersionError,
)
from vtensor.io.tiers import buffer_at, round_up, skip_filled

MAGIC = b"VTWEIGHT"
FORMAT_VERSION = 1
ALIGN_BYTES = 4096
_IOV_MAX = 1024  # Linux's limit of buffers per preadv
_PREAMBLE = struct.Struct("<8sIIQ")  # magic, version, header crc32, header length
_FIX_REWRITE = "rewrite it from the model's state_dict with vtensor.write_weights(state_dict, path)"
# safetensors dtype codes that are not F/I/U + bits (F32 -> float32, U8 -> uint8).
_SAFETENSORS_NAMES = {"BOOL": "bool", "BF16": "bfloat16", "C64": "complex64"}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie in a weight file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the file
    nbytes: int
    crc32: int | None  # None for safetensors files, which carry no checksums


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    # Through the address, not .numpy(): that would mark a model's storage non-resizable.
    return buffer_at(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def _parse_dtype(path: Path, name: str, text: object) -> torch.dtype:
    dtype = getattr(torch, str(text), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightFileFormatError(path, f"tensor {name!r} has unknown dtype {text!r}")
    return dtype


def write_weights(
    state_dict: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write ``state_dict`` as a weight file at ``path``, atomically; returns the path."""
    target = Path(path)
    tensors: list[torch.Tensor] = []
    entries: list[dict[str, Any]] = []  # "offset": from the data start
    data_bytes = 0
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor) or value.device.type == "meta":
            raise WeightFileMismatchError(
                target,
                f"state_dict entry {name!r} is not a tensor with data; pass a "
                "state_dict of materialised tensors (extra_state objects are not supported)",
            )
        tensor = value.detach().cpu().contiguous()
        tensors.append(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        crc = zlib.crc32(_tensor_bytes(tensor)) if nbytes else 0
        dtype = str(tensor.dtype).removeprefix("torch.")
        shape = list(tensor.shape)
        entries.append(
            dict(name=name, dtype=dtype, shape=shape, offset=data_bytes, nbytes=nbytes, crc32=crc)
        )
        data_bytes += round_up(nbytes, ALIGN_BYTES)
    # The header holds absolute offsets, whose digits depend on where the data starts, which
    # depends on the header's length: grow the data start until the header fits before it.
    data_start = ALIGN_BYTES
    while True:
        header = _header_json(entries, data_start, data_bytes, metadata)
        if _PREAMBLE.size + len(header) <= data_start:
            break
        data_start = round_up(_PREAMBLE.size + len(header), ALIGN_BYTES)
    preamble = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, zlib.crc32(header), len(header))
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.pwrite(fd, preamble + header, 0)
        for entry, tensor in zip(entries, tensors, strict=True):
            if entry["nbytes"]:
                _write_all(fd, _tensor_bytes(tensor), data_start + entry["offset"])
        os.ftruncate(fd, data_start + data_bytes)  # zero padding up to the last boundary
        os.fsync(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    os.replace(tmp, target)
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    return target


def _header_json(
    entries: list[dict[str, Any]], data_start: int, data_bytes: int, meta: Mapping[str, str] | None
) -> bytes:
    header = {
        "alignment": ALIGN_BYTES,
        "data_start": data_start,
        "file_bytes": data_start + data_bytes,
        "metadata": dict(meta or {}),
        "tensors": [{**entry, "offset": data_start + entry["offset"]} for entry in entries],
    }
    return json.dumps(header, separators=(",", ":")).encode()


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


def evict_page_cache(path: str | os.PathLike[str]) -> None:
    """Drop a file's clean pages from the page cache, so the next read comes from storage."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class WeightFile(AbstractContextManager["WeightFile"]):
    """An open, checked weight file (this project's format, or safetensors).

    Opening checks the magic, the version, the header's checksum and that the file is as long
    as the header says; tensor checksums are checked when tensors are read (``check_crc``).

    Attributes:
        path: the file. entries: tensor name -> where its bytes lie, in file order.
        version: the format version (0 for safetensors). aligned: offsets are 4 KiB-aligned.
        metadata: the strings written with the file (``write_weights(metadata=...)``).
    """

    def __init__(self, path: str | os.PathLike[str], *, direct_io: bool = False) -> None:
        self.path = Path(path)
        self.metadata: dict[str, str] = {}
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise WeightFileError(self.path, f"cannot open ({exc.strerror})") from exc
        try:
            self.file_bytes = os.fstat(self.fd).st_size
            head = os.pread(self.fd, _PREAMBLE.size, 0)
            if head[:8] == MAGIC:
                self.version, self.entries = self._parse_vtensor(head)
            else:
                self.version, self.entries = 0, self._parse_safetensors(head)
            self.aligned = self.version > 0
            self.direct_fd = self._open_direct() if direct_io else None
        except BaseException:
            os.close(self.fd)
            raise

    def _parse_vtensor(self, head: bytes) -> tuple[int, dict[str, TensorEntry]]:
        if len(head) < _PREAMBLE.size:
            raise WeightFileTruncatedError(self.path, f"only {len(head)} bytes; {_FIX_REWRITE}")
        _, version, header_crc, header_bytes = _PREAMBLE.unpack(head)
        if version > FORMAT_VERSION:
            raise WeightFileVersionError(
                self.path,
                f"format version {version} is newer than this vtensor reads "
                f"(up to {FORMAT_VERSION}); upgrade vtensor, or {_FIX_REWRITE}",
            )
        raw = os.pread(self.fd, header_bytes, _PREAMBLE.size)
        if len(raw) < header_bytes:
            raise WeightFileTruncatedError(self.path, f"header cut short; {_FIX_REWRITE}")
        if zlib.crc32(raw) != header_crc:
            raise WeightFileChecksumError(self.path, f"header is corrupt; {_FIX_REWRITE}")
        try:
            header = json.loads(raw)
            file_bytes, items = int(header["file_bytes"]), list(header["tensors"])
            self.metadata = {str(k): str(v) for k, v in header["metadata"].items()}
            entries = {
                item["name"]: TensorEntry(
                    item["name"],
                    _parse_dtype(self.path, item["name"], item["dtype"]),
                    tuple(int(size) for size in item["shape"]),
                    int(item["offset"]),
                    int(item["nbytes"]),
                    int(item["crc32"]),
                )
                for item in items
            }
        except (ValueError, KeyError, TypeError) as exc:
            raise WeightFileFormatError(self.path, f"malformed header ({exc!r})") from exc
        if version < 1 or any(e.offset % ALIGN_BYTES for e in entries.values()):
            raise WeightFileFormatError(self.path, f"malformed header; {_FIX_REWRITE}")
        if file_bytes > self.file_bytes:
            raise WeightFileTruncatedError(
                self.path,
                f"{self.file_bytes} bytes on disk, the header says "
                f"{file_bytes}: an interrupted copy or write; copy it again or {_FIX_REWRITE}",
            )
        return version, self._checked(entries, file_bytes)

    def _parse_safetensors(self, head: bytes) -> dict[str, TensorEntry]:
        if len(head) < 8:
            raise WeightFileFormatError(
                self.path, f"not a weight file (too short for any format); {_FIX_REWRITE}"
            )
        (header_bytes,) = struct.unpack("<Q", head[:8])
        raw = os.pread(self.fd, min(header_bytes, 100 << 20), 8)
        if not raw.startswith(b"{"):
            raise WeightFileFormatError(
                self.path,
                f"not a vtensor weight file (magic {head[:8]!r}, expected "
                f"{MAGIC!r}) nor a safetensors file; {_FIX_REWRITE}",
            )
        if len(raw) < header_bytes:
            raise WeightFileTruncatedError(self.path, "safetensors header cut short")
        try:
            header = json.loads(raw)
            self.metadata = {str(k): str(v) for k, v in header.pop("__metadata__", {}).items()}
            data_start = 8 + header_bytes
            entries = {}
            for name, item in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                code = str(item["dtype"])
                kind = {"F": "float", "I": "int", "U": "uint"}.get(code[0], "?")
                dtype = _parse_dtype(self.path, name, _SAFETENSORS_NAMES.get(code, kind + code[1:]))
                begin, end = (int(offset) for offset in item["data_offsets"])
                shape = tuple(int(size) for size in item["shape"])
                entries[name] = TensorEntry(
                    name, dtype, shape, data_start + begin, end - begin, None
                )
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise WeightFileFormatError(
                self.path, f"malformed safetensors header ({exc!r})"
            ) from exc
        return self._checked(entries, self.file_bytes)

    def _checked(self, entries: dict[str, TensorEntry], file_bytes: int) -> dict[str, TensorEntry]:
        for entry in entries.values():
            if entry.nbytes != math.prod(entry.shape) * entry.dtype.itemsize:
                raise WeightFileFormatError(
                    self.path,
                    f"tensor {entry.name!r} has {entry.nbytes} bytes for shape "
                    f"{entry.shape} of {entry.dtype}; {_FIX_REWRITE}",
                )
            if entry.offset + entry.nbytes > file_bytes:  # file_bytes: at most the size on disk
                raise WeightFileTruncatedError(
                    self.path,
                    f"tensor {entry.name!r} ends at byte {entry.offset + entry.nbytes}"
                    f", past the end of the file ({self.file_bytes} bytes); {_FIX_REWRITE}",
                )
        return entries

    def _open_direct(self) -> int:
        if not self.aligned:
            raise WeightFileFormatError(self.path, "direct_io needs this project's aligned format")
        try:
            return os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        except OSError as exc:
            raise WeightFileError(
                self.path, f"O_DIRECT is not supported here ({exc.strerror}); pass direct_io=False"
            ) from exc

    def check_matches(self, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Raise ``WeightFileMismatchError`` unless names, shapes and dtypes equal ``expected``."""
        missing = [name for name in expected if name not in self.entries]
        extra = [name for name in self.entries if name not in expected]
        fix = "write the file from this model's state_dict, or build the model it came from"
        if missing or extra:
            raise WeightFileMismatchError(
                self.path,
                f"missing tensors {missing[:5]} (of {len(missing)}), extra tensors "
                f"{extra[:5]} (of {len(extra)}) against the model; {fix}",
            )
        for name, (shape, dtype) in expected.items():
            entry = self.entries[name]
            if (entry.shape, entry.dtype) != (tuple(shape), dtype):
                raise WeightFileMismatchError(
                    self.path,
                    f"tensor {name!r} is {entry.dtype} {list(entry.shape)} in the "
                    f"file but {dtype} {list(shape)} in the model; {fix}",
                )

    def read(self, offset: int, views: list[memoryview], *, direct: bool = False) -> None:
        """Fill ``views`` back to back from ``offset``: ``preadv``, which releases the GIL."""
        fd = self.direct_fd if direct and self.direct_fd is not None else self.fd
        views = [view for view in views if len(view)]
        while views:
            got = os.preadv(fd, views[:_IOV_MAX], offset)
            if got == 0:
                raise WeightFileTruncatedError(
                    self.path, f"ended at byte {offset} while reading; {_FIX_REWRITE}"
                )
            offset += got
            views = skip_filled(views, got)

    def check_crc(self, entry: TensorEntry, view: memoryview) -> None:
        """Raise ``WeightFileChecksumError`` unless ``view`` holds ``entry``'s bytes."""
        if entry.crc32 is not None and zlib.crc32(view) != entry.crc32:
            raise WeightFileChecksumError(
                self.path,
                f"tensor {entry.name!r} does not match its checksum (corrupt or "
                f"modified on storage); {_FIX_REWRITE}",
            )

    def read_tensor(self, name: str) -> torch.Tensor:
        """A new tensor holding ``name``'s bytes, checksum checked."""
        entry = self.entries[name]
        tensor = torch.empty(entry.shape, dtype=entry.dtype)
        if entry.nbytes:
            view = _tensor_bytes(tensor)
            self.read(entry.offset, [view])
            self.check_crc(entry, view)
        return tensor

    def read_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of the file, read and checked (for a resident model)."""
        return {name: self.read_tensor(name) for name in self.entries}

    def drop_cache(self, offset: int, nbytes: int) -> None:
        """Drop a byte range from the page cache (it was read into memory already)."""
        os.posix_fadvise(self.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Close the file's descriptors."""
        for fd in (self.fd, self.direct_fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.fd, self.direct_fd = -1, None

    def __exit__(self, *exc_info: object) -> None:
        self.close()
