"""Where the tests read real datasets: ``RUNNER_TEST_DATA`` if set, else ``../shared/data`` beside the checkout.

That folder holds ``mnist/`` (the MNIST IDX files; the test split is enough) and ``tinyshakespeare/input.txt``.
Fill it the way a user does, ``python -m runner data.root=<folder>/mnist trainer.max_steps=1`` with
``data.download=true`` (the default), and tiny-shakespeare with ``experiment=shakespeare_gpt``. A test whose data
is absent skips and says where it looked; under ``CI=true`` tests/test_environment.py fails instead. Nothing is
ever written there by the tests.
"""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("RUNNER_TEST_DATA") or REPO.parent / "shared" / "data").absolute()
MNIST = DATA / "mnist"
SHAKESPEARE = DATA / "tinyshakespeare"

needs_mnist = pytest.mark.skipif(
    not (MNIST / "t10k-images-idx3-ubyte.gz").is_file() and not (MNIST / "t10k-images-idx3-ubyte").is_file(),
    reason=f"the MNIST test split is not in {MNIST} (see tests/shared_data.py)",
)
needs_shakespeare = pytest.mark.skipif(
    not (SHAKESPEARE / "input.txt").is_file(),
    reason=f"tiny-shakespeare is not in {SHAKESPEARE} (see tests/shared_data.py)",
)
