"""``python -m runner.launch [flags] script.py [args]``: the same as ``runner launch`` (runner.launch.commands)."""

import sys

from runner.launch.commands import run_command

if __name__ == "__main__":
    sys.exit(run_command("launch", sys.argv[1:]))
