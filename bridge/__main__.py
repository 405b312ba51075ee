"""Entry point: ``python -m bridge --help``."""

import sys

from bridge.cli import main

if __name__ == "__main__":
    sys.exit(main())
