"""Under CI (CI=true) everything the suite's data and extras tests need is there: a missing dataset or extra
fails here, rather than only skipping the tests that need it."""

import importlib.util
import os

import pytest

from tests.shared_data import DATA

NEEDED = {
    "mnist/t10k-images-idx3-ubyte.gz": "the MNIST test split",
    "mnist/t10k-labels-idx1-ubyte.gz": "its labels",
    "tinyshakespeare/input.txt": "the tiny-shakespeare corpus",
}
DEV_EXTRAS = ("transformers", "datasets")  # the hf extra, which dev includes


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="outside CI a test whose data is absent skips")
def test_ci_has_the_shared_data_and_the_dev_extras():
    missing = [f"{DATA / name} ({what})" for name, what in NEEDED.items() if not (DATA / name).is_file()]
    missing += [f"the {name} package" for name in DEV_EXTRAS if importlib.util.find_spec(name) is None]
    assert missing == []
