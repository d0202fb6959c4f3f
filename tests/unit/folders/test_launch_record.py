"""The record each launch of a run leaves: what it holds, what it never holds, and the data-order digest."""

import json
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from runner.folders import code_versions, launch_record
from runner.folders.launch_record import DataOrder, attempt_files, note_generators, read_attempts


@pytest.fixture
def run(tmp_path):
    """A run folder; whatever launch a test leaves open is closed after it."""
    folder = tmp_path / "run"
    folder.mkdir()
    yield folder
    launch_record.close()


def _git(folder, *args):
    subprocess.run(["git", "-c", "user.name=lab", "-c", "user.email=lab@example.com", "-C", str(folder), *args],
                   check=True, capture_output=True)  # fmt: skip


def test_a_record_holds_the_launch_the_code_and_named_variables_only(tmp_path, monkeypatch, run):
    lab = tmp_path / "lab"
    (lab / "mylab").mkdir(parents=True)
    (lab / "mylab" / "__init__.py").write_text("")
    _git(lab, "init", "-q")
    _git(lab, "add", ".")
    _git(lab, "commit", "-q", "-m", "first")
    commit = subprocess.run(["git", "-C", str(lab), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    monkeypatch.syspath_prepend(str(lab))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("WANDB_API_KEY", "do-not-record-me")
    config = {"seed": 7, "model": {"_target_": "mylab.Net"}, "loss": {"_target_": "torch.nn.MSELoss"}}
    path = launch_record.write(run, config=config, overrides=["experiment=mine"], resume=None, launch={"world_size": 1},
                               command=["runner", "experiment=mine"], hosts=["node-a"]).path  # fmt: skip
    launch_record.close()
    text = path.read_text()
    record = json.loads(text)
    assert path == run / "provenance" / "attempt_1.json" and record["attempt"] == 1
    assert record["command"] == ["runner", "experiment=mine"] and record["overrides"] == ["experiment=mine"]
    assert record["seed"] == 7 and record["config_sha256"] == launch_record.config_digest(config)
    assert record["launch"] == {"world_size": 1, "hosts": ["node-a"]}
    assert record["environment"]["OMP_NUM_THREADS"] == "3" and "WANDB_API_KEY" not in record["environment"]
    assert "do-not-record-me" not in text  # no other variable is read into it
    assert set(record["environment"]) <= set(launch_record.BEHAVIOUR_ENV)
    (repository,) = record["code"]["repositories"].values()  # torch is an installed package: its version is enough
    assert repository == {"root": str(lab), "commit": commit.strip(), "dirty": False, "diff_sha256": None,
                          "packages": ["mylab"]}  # fmt: skip
    assert record["packages"]["torch"] == torch.__version__
    assert record["platform"]["torch"] == torch.__version__ and record["platform"]["python"] == sys.version.split()[0]

    (lab / "mylab" / "__init__.py").write_text("X = 1\n")  # an uncommitted change: the next launch says so
    second = launch_record.write(run, config=config, overrides=[], command=[], resume=str(run), launch={},
                                 hosts=[]).path  # fmt: skip
    launch_record.close()
    changed = json.loads(second.read_text())["code"]["repositories"][str(lab)]
    assert second.name == "attempt_2.json" and changed["dirty"] and len(changed["diff_sha256"]) == 64
    monkeypatch.setattr(code_versions.shutil, "which", lambda name: None)  # no sha256sum: Python hashes the diff
    again = launch_record.write(run, config=config, overrides=[], command=[], resume=None, launch={}, hosts=[]).path
    launch_record.close()
    assert json.loads(again.read_text())["code"]["repositories"][str(lab)] == changed  # the same digest either way
    again.unlink()
    assert [r["attempt"] for r in read_attempts(run)] == [1, 2] and attempt_files(run) == [path, second]
    path.unlink()  # a gap in the numbers: the next record still comes after the highest, overwriting none
    third = launch_record.write(run, config=config, overrides=[], command=[], resume=None, launch={}, hosts=[]).path
    assert third.name == "attempt_3.json" and attempt_files(run) == [second, third]


def test_the_data_order_digest_names_what_was_read_in_order(monkeypatch, run):
    record = launch_record.write(run, config={}, overrides=[], command=[], resume=None, launch={}, hosts=[])
    path = record.path
    batches = [(torch.arange(6.0).reshape(2, 3) + i, {"labels": torch.tensor([i, i + 1])}) for i in range(5)]

    def digests(order_of, first_batch=0):
        order = DataOrder(record, first_batch=first_batch)
        for index in order_of:
            order.add(batches[index])
            if order.done:
                break
        order.flush()
        return json.loads(path.read_text())["data_order"]

    same, again = digests([0, 1, 2, 3, 4]), digests([0, 1, 2, 3])
    assert same == again and len(same["batches"]) == launch_record.DIGEST_BATCHES == 4  # the first four
    swapped = digests([1, 0, 2, 3])
    assert swapped["digest"] != same["digest"] and swapped["batches"][:2] == same["batches"][1::-1]
    retyped = DataOrder(record, first_batch=0)
    retyped.add((batches[0][0].double(), batches[0][1]))  # the same values in another dtype read differently
    assert retyped.digests[0] != same["batches"][0]
    arrays = DataOrder(record, first_batch=0)
    for value in (np.arange(3), np.arange(3), np.arange(4), object(), object()):  # values, not reprs, count
        arrays.add(value)
    assert arrays.digests[0] == arrays.digests[1] != arrays.digests[2] and arrays.digests[3] == arrays.digests[4]
    monkeypatch.setenv(launch_record.DIGEST_BATCHES_ENV, "all")
    everything = digests([0, 1, 2, 3, 4], first_batch=8)
    assert everything["first_batch"] == 8 and everything["batches"][:4] == same["batches"] and len(
        everything["batches"]) == 5  # fmt: skip


def test_generators_of_an_objects_own_are_noted_with_where_they_are(run):
    note_generators("data.train", random.Random(0))  # before a launch is recorded: nothing to note into
    record = launch_record.write(run, config={}, overrides=[], command=[], resume=None, launch={}, hosts=[])

    class Jitter:
        def __init__(self):
            self.rng, self.inner, self.seed = random.Random(0), type("Holder", (), {})(), 3
            self.inner.numpy = np.random.default_rng(0)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
    model[1].generator = torch.Generator()
    note_generators("data.train", Jitter())
    note_generators("model", model)
    note_generators("loss", torch.nn.MSELoss())  # none of its own
    launch_record.close()
    noted = json.loads(record.path.read_text())["own_generators"]
    shown = [(entry["key"], entry["attribute"], entry["type"]) for entry in noted]
    assert shown == [("data.train", "rng", "random.Random"), ("data.train", "inner.numpy", "numpy.random.Generator"),
                     ("model", "1.generator", "torch.Generator")]  # fmt: skip
    assert noted[0]["class"].endswith("Jitter")
    launch_record.write(run, config={}, overrides=[], command=[], resume=None, launch={}, hosts=[])
    note_generators("loss", torch.nn.MSELoss())  # the next launch of the process (a sweep's next job) starts afresh
    launch_record.close()
    assert json.loads(attempt_files(run)[-1].read_text())["own_generators"] == []
