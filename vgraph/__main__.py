"""``python -m vgraph …``: the command line (see :mod:`vgraph.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
