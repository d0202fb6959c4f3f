"""The record each launch of a run leaves: what it holds, what it never holds, and the data-order digest."""

import json
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from runner.folders import launch_record
from runner.folders.launch_record import DataOrder, attempt_files, note_generators, read_attempts


@pytest.fixture
def fresh(monkeypatch):
    """The module's per-process state, as in a process that has written nothing yet."""
    monkeypatch.setattr(launch_record, "_written", None)
    monkeypatch.setattr(launch_record, "_pending", None)
    monkeypatch.setattr(launch_record, "_own_generators", [])


def _git(folder, *args):
    subprocess.run(["git", "-c", "user.name=lab", "-c", "user.email=lab@example.com", "-C", str(folder), *args],
                   check=True, capture_output=True)  # fmt: skip


def test_a_record_holds_the_launch_the_code_and_named_variables_only(tmp_path, monkeypatch, fresh):
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
    monkeypatch.setenv(launch_record.COMMAND_ENV, json.dumps(["/usr/bin/runner", "experiment=mine"]))
    config = {"seed": 7, "model": {"_target_": "mylab.Net"}, "loss": {"_target_": "torch.nn.MSELoss"}}
    run = tmp_path / "run"
    run.mkdir()
    path = launch_record.write(run, config=config, overrides=["experiment=mine"], resume=None,
                               launch={"world_size": 1}, hosts=["node-a"])  # fmt: skip
    launch_record.wait()
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
    second = launch_record.write(run, config=config, overrides=[], resume=str(run), launch={}, hosts=[])
    launch_record.wait()
    changed = json.loads(second.read_text())["code"]["repositories"][str(lab)]
    assert second.name == "attempt_2.json" and changed["dirty"] and len(changed["diff_sha256"]) == 64
    assert [r["attempt"] for r in read_attempts(run)] == [1, 2] and attempt_files(run) == [path, second]


def test_the_data_order_digest_names_what_was_read_in_order(tmp_path, monkeypatch, fresh):
    run = tmp_path / "run"
    run.mkdir()
    path = launch_record.write(run, config={}, overrides=[], resume=None, launch={}, hosts=[])
    batches = [(torch.arange(6.0).reshape(2, 3) + i, {"labels": torch.tensor([i, i + 1])}) for i in range(5)]

    def digests(order_of, first_batch=0):
        order = DataOrder(path, first_batch=first_batch)
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
    retyped = DataOrder(path, first_batch=0)
    retyped.add((batches[0][0].double(), batches[0][1]))  # the same values in another dtype read differently
    assert retyped.digests[0] != same["batches"][0]
    monkeypatch.setenv(launch_record.DIGEST_BATCHES_ENV, "all")
    everything = digests([0, 1, 2, 3, 4], first_batch=8)
    assert everything["first_batch"] == 8 and everything["batches"][:4] == same["batches"] and len(
        everything["batches"]) == 5  # fmt: skip


def test_generators_of_an_objects_own_are_noted_with_where_they_are(fresh):
    class Jitter:
        def __init__(self):
            self.rng, self.inner, self.seed = random.Random(0), type("Holder", (), {})(), 3
            self.inner.numpy = np.random.default_rng(0)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
    model[1].generator = torch.Generator()
    note_generators("data.train", Jitter())
    note_generators("model", model)
    note_generators("loss", torch.nn.MSELoss())  # none of its own
    shown = [(entry["key"], entry["attribute"], entry["type"]) for entry in launch_record._own_generators]
    assert shown == [("data.train", "rng", "random.Random"), ("data.train", "inner.numpy", "numpy.random.Generator"),
                     ("model", "1.generator", "torch.Generator")]  # fmt: skip
    assert launch_record._own_generators[0]["class"].endswith("Jitter")
