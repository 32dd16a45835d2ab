"""Plain-data report of demand layering: bytes held (exact), read, and seconds waited for."""

from dataclasses import dataclass


@dataclass(frozen=True)
class LayeringReport:
    """What demand layering held and waited for, since it started or since ``reset_stats``.

    Attributes:
        model_bytes: bytes of every parameter and persistent buffer (the resident model's).
        buffer_bytes: bytes allocated for streamed tensors: the ring, enclosing calls' own
            buffers and ``resident`` modules (fixed once the first forward is planned).
        peak_live_bytes: most bytes of layers read (or being read) and not yet released at one
            moment, plus resident modules; counted exactly by the manager, 4 KiB-rounded.
        lookahead: calls read ahead of the running one (None: as far as the ring allows).
        layers, calls: modules with tensors, and layer calls per forward.
        forwards, bytes_read, read_s, stall_s: forwards run, bytes read, seconds the reader
            spent in reads and checksums, seconds forwards waited for reads.
    """

    model_bytes: int
    buffer_bytes: int
    peak_live_bytes: int
    lookahead: int | None
    layers: int
    calls: int
    forwards: int
    bytes_read: int
    read_s: float
    stall_s: float
