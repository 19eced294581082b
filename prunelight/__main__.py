"""`python -m prunelight ...` (and `torchrun -m prunelight ...`)."""

import sys

from prunelight.cli import main

if __name__ == "__main__":
    sys.exit(main())
