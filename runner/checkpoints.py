"""``python -m runner.checkpoints RUN``: list a run's checkpoints and their integrity (see runner.cli.checkpoints)."""

import sys

from runner.cli.checkpoints import main

if __name__ == "__main__":
    sys.exit(main())
