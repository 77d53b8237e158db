"""`python -m fsdplab ...` is the `fsdplab` command (for when the script is not on PATH)."""

import sys

from .runner.cli import command

sys.exit(command())
