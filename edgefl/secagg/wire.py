"""Typed reads of the values a SecAgg+ ConfigRecord carries; a wrong type breaks the protocol."""

from collections.abc import Mapping
from typing import TypeVar

from flwr.app import ConfigRecord

from edgefl.secagg.errors import SecAggProtocolError

T = TypeVar("T")


def integer(config: ConfigRecord, key: str) -> int:
    """``config[key]`` as an int."""
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SecAggProtocolError(f"secagg {key}={value!r} must be an int")
    return value


def integers(config: ConfigRecord, key: str) -> list[int]:
    """``config[key]`` as a list of ints (node ids)."""
    value = config.get(key)
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise SecAggProtocolError(f"secagg {key} must be a list of ints, got {type(value)}")
    return [int(v) for v in value]


def blob(config: ConfigRecord, key: str) -> bytes:
    """``config[key]`` as bytes."""
    value = config.get(key)
    if not isinstance(value, bytes):
        raise SecAggProtocolError(f"secagg {key} must be bytes, got {type(value)}")
    return value


def blobs(config: ConfigRecord, key: str) -> list[bytes]:
    """``config[key]`` as a list of bytes (keys, ciphertexts, shares)."""
    value = config.get(key)
    if not isinstance(value, list):
        raise SecAggProtocolError(f"secagg {key} must be a list of bytes, got {type(value)}")
    out = [v for v in value if isinstance(v, bytes)]
    if len(out) != len(value):
        raise SecAggProtocolError(f"secagg {key} must be a list of bytes, not of other values")
    return out


def text(config: ConfigRecord, key: str) -> str:
    """``config[key]`` as a str."""
    value = config.get(key)
    if not isinstance(value, str):
        raise SecAggProtocolError(f"secagg {key}={value!r} must be a str")
    return value


def only(records: Mapping[str, T], what: str) -> T:
    """The one record of a message's records of one kind."""
    if len(records) != 1:
        raise SecAggProtocolError(f"expected one {what}, got {len(records)}: {list(records)}")
    return next(iter(records.values()))
