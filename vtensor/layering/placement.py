"""Where demand layering holds each call's bytes: pure placement of calls in one read buffer.

Calls at most ``lookahead`` apart are held together, so they must not overlap in the buffer.
"""


def enclosing_calls(events: list[tuple[bool, int]]) -> set[int]:
    """Calls whose use encloses a later call's: they cannot be released in order.

    ``events`` are (is_load, call index) in the order the forward made them.
    """
    queue: list[int] = []
    enclosing: set[int] = set()
    for is_load, call in events:
        if is_load:
            queue.append(call)
        elif call in queue:
            at = queue.index(call)
            enclosing.update(queue[:at])
            queue = queue[at + 1 :]
    return enclosing


def ring_positions(sizes: list[int], capacity: int) -> list[int]:
    """Where each ring call lands: after the previous one, or at 0 when it would pass the end."""
    positions, tail = [], 0
    for size in sizes:
        at = tail if tail + size <= capacity else 0
        positions.append(at)
        tail = at + size
    return positions


def place_calls(sizes: list[int], lookahead: int) -> tuple[dict[int, int], int]:
    """Offsets in one buffer for the calls of nonzero size, and the buffer's size.

    Greedy by size, each at the lowest offset clear of the conflicting calls placed before it
    (offline dynamic storage allocation); then the reader never waits for room.
    """
    at: dict[int, int] = {}
    for j in sorted((j for j, size in enumerate(sizes) if size), key=lambda j: (-sizes[j], j)):
        offset = 0
        for begin, end in sorted((at[i], at[i] + sizes[i]) for i in at if abs(i - j) <= lookahead):
            if offset + sizes[j] <= begin:
                break
            offset = max(offset, end)
        at[j] = offset
    return at, max((at[j] + sizes[j] for j in at), default=0)
