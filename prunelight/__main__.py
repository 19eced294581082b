"""`python -m prunelight ...` (and `torchrun -m prunelight ...`)."""

from prunelight.cli import cli_main

if __name__ == "__main__":
    cli_main()
