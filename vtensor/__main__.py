"""``python -m vtensor``: the training demo under a memory budget."""

import sys

from vtensor.demo import main

sys.exit(main())
