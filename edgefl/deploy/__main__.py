"""``python -m edgefl.deploy``: the ``edgefl`` command line without its console script."""

import sys

from edgefl.deploy.cli import main

sys.exit(main())
