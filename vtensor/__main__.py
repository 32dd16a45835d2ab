"""``python -m vtensor``: the command line (``demo``, ``plan``); no subcommand runs the demo."""

import sys

from vtensor.cli import main

sys.exit(main())
