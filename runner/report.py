"""``python -m runner.report SWEEP_FOLDER``: rebuild a sweep's summary (see runner.sweeps.report)."""

import sys

from runner.sweeps.report import main

if __name__ == "__main__":
    sys.exit(main())
