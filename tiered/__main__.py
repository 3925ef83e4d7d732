"""``python -m tiered``: the ``tiered`` command (see :mod:`tiered.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
