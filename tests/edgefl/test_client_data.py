"""A deployed node's split kept across its processes (NOTE [split cache])."""

from pathlib import Path

import numpy as np

from edgefl.client_data import client_split, node_split
from edgefl.settings import RunSettings


def test_node_split_reads_back_what_client_split_cut(
    smoke_settings: RunSettings, tmp_path: Path
) -> None:
    data = smoke_settings.client.data
    cut = client_split(data, None, 1, 3, 7)
    first = node_split(data, None, 1, 3, 7, tmp_path)
    (path,) = tmp_path.glob("split-*.npz")
    again = node_split(data, None, 1, 3, 7, tmp_path)  # read from the file
    for split in (first, again):
        assert split[0] == cut[0]
        for part, expected in zip(split[1:], cut[1:], strict=True):
            assert np.array_equal(part.x, expected.x) and np.array_equal(part.y, expected.y)
    node_split(data, None, 2, 3, 7, tmp_path)  # another partition: a file of its own
    assert len(list(tmp_path.glob("split-*.npz"))) == 2
    path.write_bytes(b"torn")  # an unreadable file is made anew
    assert np.array_equal(node_split(data, None, 1, 3, 7, tmp_path)[1].x, cut[1].x)
