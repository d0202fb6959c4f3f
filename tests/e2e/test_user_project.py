"""A researcher's own project outside this repository: their package, their config folder, our runner.

The test writes a small project (a model, two datasets, configs) into a temporary folder and runs
it from there, as a user would: 1 and 2 processes, an exact resume, a sweep, and the mistakes that
must be refused before anything starts.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.conftest import REPO, metrics

FILES = {
    "mylab/__init__.py": "",
    "mylab/models.py": '''
        import torch
        from torch import nn


        class TinyMLP(nn.Module):
            def __init__(self, in_features: int = 2, hidden: int = 32, classes: int = 3) -> None:
                super().__init__()
                self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, classes))

            def forward(self, x):
                return self.net(x)


        class DictMLP(TinyMLP):
            """Hugging Face style: model(**batch) returns logits and, given labels, its own loss."""

            def forward(self, features, labels=None):
                logits = self.net(features)
                outputs = {"logits": logits}
                if labels is not None:
                    outputs["loss"] = nn.functional.cross_entropy(logits, labels)
                return outputs
    ''',
    "mylab/data.py": '''
        import os

        import torch
        from torch.utils.data import Dataset

        CENTERS = torch.tensor([[0.0, 3.0], [3.0, -2.0], [-3.0, -2.0]])


        def _note(event, split):  # which process prepared or built which split
            with open(os.environ["MYLAB_LOG"], "a") as log:
                log.write(f"{event} {split} {os.getpid()}\\n")


        class Blobs(Dataset):
            """Three Gaussian blobs in 2-D, labelled 0, 1, 2."""

            def __init__(self, n: int, seed: int, split: str, spread: float = 0.6) -> None:
                _note("build", split)
                labels = torch.arange(n) % 3
                noise = torch.randn(n, 2, generator=torch.Generator().manual_seed(seed))
                self.points, self.labels = CENTERS[labels] + spread * noise, labels

            @classmethod
            def prepare_data(cls, n: int, seed: int, split: str, spread: float = 0.6) -> None:
                _note("prepare", split)

            def __len__(self):
                return len(self.labels)

            def __getitem__(self, index):
                return self.points[index], self.labels[index]


        class DictBlobs(Blobs):
            def __getitem__(self, index):
                return {"features": self.points[index], "labels": self.labels[index]}
    ''',
    "mylab/noisy.py": '''
        import random

        from mylab.data import Blobs


        class NoisyBlobs(Blobs):
            """Blobs jittered by a generator of the dataset's own, which no checkpoint saves: a resume drifts."""

            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, **kwargs)
                self.rng = random.Random(0)

            def __getitem__(self, index):
                point, label = super().__getitem__(index)
                return point + self.rng.gauss(0.0, 0.1), label
    ''',
    "conf/model/tiny_mlp.yaml": """
        # A small MLP for 2-D points.
        _target_: mylab.models.TinyMLP
        in_features: 2
        hidden: 32
        classes: 3
    """,
    "conf/data/blobs.yaml": """
        # Three Gaussian blobs: 600 train points, 150 eval points.
        train: {_target_: mylab.data.Blobs, n: 600, seed: 0, split: train}
        eval: {_target_: mylab.data.Blobs, n: 150, seed: 1, split: eval}
        batch_size: 32
        eval_batch_size: 64
    """,
    "conf/experiment/blobs.yaml": """
        # @package _global_
        # Blobs with a small MLP:
        #   runner --config-dir ./conf experiment=blobs
        defaults:
          - override /model: tiny_mlp
          - override /data: blobs
          - override /scheduler: constant
        loss: {_target_: torch.nn.CrossEntropyLoss}
        metrics:
          accuracy: {_target_: torchmetrics.classification.MulticlassAccuracy, num_classes: 3, average: micro}
        objective: {metric: eval/accuracy, direction: maximize}
        optimizer: {lr: 0.01}
        trainer: {max_steps: 30, log_every_n_steps: 10}
    """,
    "conf/experiment/noisy_blobs.yaml": """
        # @package _global_
        defaults:
          - blobs
        data:
          train: {_target_: mylab.noisy.NoisyBlobs}
    """,
}


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lab")
    assert REPO not in root.parents  # outside this repository: nothing of ours is on its path
    for name, text in FILES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return root


def runner(project: Path, *args: str, script: bool = False, log: str = "prepared.log") -> subprocess.CompletedProcess:
    """``python -m runner --config-dir conf ...`` (or the ``runner`` console script) from the project folder."""
    command = [shutil.which("runner")] if script else [sys.executable, "-m", "runner"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MYLAB_LOG": str(project / log)}
    env.pop("PYTHONPATH", None)  # only what the runner itself puts on the path
    return subprocess.run(
        [*command, "--config-dir", "conf", *args], cwd=project, env=env, capture_output=True, text=True, timeout=600
    )


def events(project: Path, log: str) -> list[tuple[str, str, int]]:
    lines = (project / log).read_text().split()
    return [(lines[i], lines[i + 1], int(lines[i + 2])) for i in range(0, len(lines), 3)]


@pytest.fixture(scope="module")
def full_run(project) -> Path:
    """The shared reference: 30 steps on one process, through the ``runner`` console script."""
    assert shutil.which("runner"), "the runner console script is not installed (pip install -e .)"
    result = runner(project, "experiment=blobs", "hydra.run.dir=runs/full", script=True, log="full.log")
    assert result.returncode == 0, result.stderr[-3000:]
    return project / "runs" / "full"


def test_one_process_from_its_own_folder_learns_and_prepares_data_once(project, full_run):
    summary = metrics(full_run)
    assert summary["step"] == 30 and summary["eval/accuracy"] >= 0.95, summary
    assert set(summary) == {"eval/accuracy", "eval/loss", "train/loss", "step", "epoch"}
    config = (full_run / ".hydra" / "config.yaml").read_text()
    assert "mylab.models.TinyMLP" in config and "mylab.data.Blobs" in config
    prepared = [(event, split) for event, split, _ in events(project, "full.log")]
    assert prepared == [("prepare", "train"), ("prepare", "eval"), ("build", "train"), ("build", "eval")]


def test_two_processes_with_ddp_learn_and_the_launcher_prepares_data_before_the_workers(project):
    result = runner(
        project, "experiment=blobs", "trainer.num_processes=2", "parallel=ddp", "hydra.run.dir=runs/ddp",
        script=True, log="ddp.log",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = metrics(project / "runs" / "ddp")
    assert summary["step"] == 30 and summary["eval/accuracy"] >= 0.95, summary
    logged = events(project, "ddp.log")
    prepares = [(split, pid) for event, split, pid in logged if event == "prepare"]
    builds = [(split, pid) for event, split, pid in logged if event == "build"]
    assert [split for split, _ in prepares] == ["train", "eval"]  # once each, before any worker built one
    launcher = {pid for _, pid in prepares}
    assert len(launcher) == 1 and logged[:2] == [("prepare", "train", *launcher), ("prepare", "eval", *launcher)]
    assert sorted(split for split, _ in builds) == ["eval", "eval", "train", "train"]
    assert len({pid for _, pid in builds}) == 2 and not launcher & {pid for _, pid in builds}  # the two workers


def test_resume_is_bit_identical_for_a_users_experiment(project, full_run):
    first = runner(project, "experiment=blobs", "trainer.max_steps=20", "hydra.run.dir=runs/cut")
    assert first.returncode == 0, first.stderr[-3000:]
    cut = project / "runs" / "cut"
    # Without --config-dir the run's experiment is not found: the run folder says which folder it came from.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    forgot = subprocess.run([sys.executable, "-m", "runner", f"resume={cut}", "trainer.max_steps=30"], cwd=project,
                            env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert forgot.returncode == 2, forgot.stderr[-3000:]
    last = forgot.stderr.strip().splitlines()[-1]
    assert last.startswith("runner: error: experiment=blobs is not an option; choose one of mnist, ") and last.endswith(
        f"; the run was started with --config-dir {project / 'conf'}, so give it to this command too."
    ), last
    resumed = runner(project, f"resume={cut}", "trainer.max_steps=30")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resumed at step 20" in (cut / "run.log").read_text()
    assert metrics(cut) == metrics(full_run)  # 20 + 10 steps are the 30 steps, to the last bit
    expected, got = load_file(full_run / "model" / "model.safetensors"), load_file(cut / "model" / "model.safetensors")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


def test_a_sweep_summarises_the_declared_objective(project):
    sweep = project / "sweeps" / "lr"
    result = runner(project, "-m", "experiment=blobs", "optimizer.lr=0.01,0.03", "trainer.max_steps=10",
                    f"hydra.sweep.dir={sweep}")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert [(row["optimizer.lr"], row["status"], row["objective"]) for row in rows] == [
        ("0.01", "finished", "eval/accuracy"),
        ("0.03", "finished", "eval/accuracy"),
    ]
    for job in ("0", "1"):
        record = json.loads((sweep / job / "job.json").read_text())
        assert record["objective"]["name"] == "eval/accuracy" and record["objective"]["direction"] == "maximize"
        assert record["objective"]["value"] == metrics(sweep / job)["eval/accuracy"]
    table = (sweep / "summary.md").read_text()
    assert "eval/accuracy" in table and "Best: job" in table


def test_a_dict_batch_model_that_returns_its_own_loss_trains(project):
    result = runner(
        project, "experiment=blobs", "model._target_=mylab.models.DictMLP", "data.train._target_=mylab.data.DictBlobs",
        "data.eval._target_=mylab.data.DictBlobs", "loss=model", "hydra.run.dir=runs/dict",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = metrics(project / "runs" / "dict")
    assert summary["step"] == 30 and summary["eval/accuracy"] >= 0.95, summary
    assert summary["eval/loss"] < 0.5 and summary["train/loss"] < 1.0


@pytest.mark.parametrize(
    ("override", "sentence"),
    [
        (
            "model._target_=mylab.models.TinyMPL",
            "runner: error: model._target_='mylab.models.TinyMPL' does not import: mylab.models has no 'TinyMPL' "
            "(did you mean 'mylab.models.TinyMLP'?); fix the dotted path.",
        ),
        (
            "+model.hiden=16",
            "runner: error: model.hiden is not a parameter of mylab.models.TinyMLP; it takes in_features, hidden, "
            "classes (did you mean 'model.hidden'?).",
        ),
        (
            "+data.train.noise=0.1",
            "runner: error: data.train.noise is not a parameter of mylab.data.Blobs; it takes n, seed, split, spread.",
        ),
    ],
)
def test_a_misspelled_target_or_keyword_is_one_sentence_before_anything_starts(project, override, sentence):
    folder = project / "refused"
    result = runner(project, "experiment=blobs", override, f"hydra.run.dir={folder}", log="refused.log")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip() == sentence
    assert not folder.exists() and not (project / "refused.log").exists()  # nothing started, nothing prepared


def test_help_lists_the_users_options_and_the_search_path_works_too(project):
    helped = runner(project, "--help")
    assert helped.returncode == 0, helped.stderr[-3000:]
    lines = {line.split(":")[0].strip(): line for line in helped.stdout.splitlines() if line.startswith("  ")}
    assert "blobs" in lines["experiment"] and "mnist" in lines["experiment"]
    assert "tiny_mlp" in lines["model"] and "blobs" in lines["data"]
    env = {**os.environ, "PYTHONPATH": ""}
    shown = subprocess.run(
        [sys.executable, "-m", "runner", "hydra.searchpath=[file://./conf]", "experiment=blobs", "--cfg", "job"],
        cwd=project, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "_target_: mylab.models.TinyMLP" in shown.stdout and "num_classes: 3" in shown.stdout


def test_check_resume_names_a_datasets_own_generator_as_why_its_resume_drifts(project):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MYLAB_LOG": str(project / "check.log")}
    command = [sys.executable, "-m", "runner", "check-resume", "--config-dir", "conf", "experiment=noisy_blobs",
               "--steps", "6", "--cut", "3", "--dir", "runs/check"]  # fmt: skip
    done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == (
        "resume is not exact: after the resume, the resumed run read other training data at step 4 (batch 3) than "
        "the straight run"
    )
    assert lines[1] == (
        "why: the resumed run reads other batches than the uninterrupted one from its first step on: data.train "
        "(mylab.noisy.NoisyBlobs) keeps a random.Random of its own at .rng, which no checkpoint saves, so its draws "
        "after the resume start over."
    )
    assert lines[2] == "also different:" and lines[3].startswith("  logged train/loss: step 4: ")
    assert any(line.startswith("  model weights: net.0.weight: ") and line.endswith("(final checkpoints)")
               for line in lines)  # fmt: skip
    kept = project / "runs" / "check"  # kept for runner diff, as the last line says
    assert lines[-1] == f"The runs are kept in {kept}: compare them with runner diff {kept}/straight {kept}/cut"
    records = [json.loads(path.read_text()) for path in sorted((kept / "cut" / "provenance").iterdir())]
    assert [record["data_order"]["first_batch"] for record in records] == [0, 3]  # the cut, and the resume's
    assert records[1]["resume"] == str(kept / "cut" / "checkpoints" / "checkpoint_0")
    assert records[0]["code"]["repositories"][str(project / "mylab")]["packages"] == ["mylab"]  # not a git tree
