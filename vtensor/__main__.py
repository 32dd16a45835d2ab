"""``python -m vtensor``: the command line (``demo``, ``plan``); no subcommand runs the demo."""

import sys

from vtensor.tools.cli import main

sys.exit(main())
