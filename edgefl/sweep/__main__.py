"""Rewrite a sweep folder's summary: ``python -m edgefl.sweep SWEEP_DIR`` (e.g. after Ctrl-C)."""

import sys
from collections.abc import Sequence
from pathlib import Path

from edgefl.sweep.multirun import write_sweep_summary


def main(argv: Sequence[str] | None = None) -> int:
    """Summarise the job folders under the one folder named in ``argv``; 2 on bad input."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or not (Path(args[0]) / "multirun.yaml").is_file():
        print(
            f"usage: python -m edgefl.sweep SWEEP_DIR (got {args}); SWEEP_DIR is the folder "
            "of a multirun, the one holding Hydra's multirun.yaml",
            file=sys.stderr,
        )
        return 2
    for path in write_sweep_summary(Path(args[0]).resolve()):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
