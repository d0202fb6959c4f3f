"""The run folder as a user meets it: a link in it is refused before a byte is written; each new run gets its own."""

import hashlib
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

from omegaconf import OmegaConf

from tests.e2e.conftest import metrics, mnist_args, run_cli, run_cli_refusals

TINY = [*mnist_args("test[:256]", "test[9900:]"), "trainer.max_steps=2"]


def _tree(folder) -> dict[str, str]:
    """Every entry under ``folder`` (links not followed): a file's sha256, a link's target, or "folder"."""
    found = {}
    for entry in os.scandir(folder):
        if entry.is_symlink():
            found[entry.name] = "-> " + os.readlink(entry.path)
        elif entry.is_dir():
            found[entry.name] = "folder"
            found |= {f"{entry.name}/{name}": kind for name, kind in _tree(entry.path).items()}
        else:
            found[entry.name] = hashlib.sha256(Path(entry.path).read_bytes()).hexdigest()
    return found


def test_a_run_folder_with_a_link_in_it_is_refused_in_one_sentence_and_nothing_anywhere_changes(tmp_path):
    trained, yours = tmp_path / "trained", tmp_path / "yours"
    result = run_cli(*TINY, f"hydra.run.dir={trained}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (yours / "weights").mkdir(parents=True)
    (yours / "notes.txt").write_text("a file of yours\n")
    (yours / "train.log").write_text("a log of yours\n")
    (yours / "weights" / "pytorch_model.bin").write_bytes(b"weights of yours")
    (yours / "weights" / "model-00001-of-00002.safetensors").write_bytes(b"a shard of yours")
    (yours / "record").mkdir()
    (yours / "record" / "config.yaml").write_text("lr: 0.1\n")
    shutil.copytree(trained / "checkpoints", yours / "checkpoints")
    checkpoint = next((trained / "checkpoints").iterdir()).name
    resume = ["trainer.max_steps=4"]
    cases = {  # a copy of the trained run with this entry replaced by a link to that target: the command
        (".runner.lock", yours / "notes.txt"): lambda run: [f"resume={run}", *resume],
        ("model", yours / "weights"): lambda run: [f"resume={run}", *resume],
        ("run.log", yours / "train.log"): lambda run: [f"resume={run}", *resume],
        ("checkpoints", yours / "checkpoints"): lambda run: [f"resume={run}/checkpoints/{checkpoint}", *resume],
        (".hydra", yours / "record"): lambda run: [*TINY, f"hydra.run.dir={run}"],  # a new run, an existing folder
    }
    runs = [tmp_path / f"run-{index}" for index in range(len(cases))]
    for run, (name, target) in zip(runs, cases, strict=True):
        shutil.copytree(trained, run)
        if (run / name).is_dir():
            shutil.rmtree(run / name)
        else:
            (run / name).unlink()
        (run / name).symlink_to(target)
    before = [_tree(folder) for folder in (*runs, yours)]
    refused = run_cli_refusals([command(run) for run, command in zip(runs, cases.values(), strict=True)], cwd=tmp_path)
    for run, (name, target), result in zip(runs, cases, refused, strict=True):
        assert result["returncode"] == 2, (name, result["stderr"][-3000:])
        assert result["stderr"].strip() == (
            f"runner: error: {run / name} is a symbolic link (to {target}); a run folder holds no links, so remove it "
            "or copy the run with links resolved (cp -rL)."
        ), name
    assert [_tree(folder) for folder in (*runs, yours)] == before  # no record, no log line, nothing of yours touched


def test_two_runs_started_in_the_same_second_each_write_a_folder_of_their_own(tmp_path):
    def start(seed: int):
        return run_cli(*TINY, f"seed={seed}", cwd=tmp_path)

    with ThreadPoolExecutor(2) as pool:
        finished = list(pool.map(start, (1, 2)))  # both start at once; the default folder names the second
    for result in finished:
        assert result.returncode == 0, result.stderr[-3000:]
    folders = sorted((tmp_path / "outputs").glob("*/*"))
    assert len(folders) == 2, folders
    seeds = set()
    for folder in folders:
        datetime.strptime(f"{folder.parent.name}/{folder.name.removesuffix('-1')}", "%Y-%m-%d/%H-%M-%S")
        overrides = OmegaConf.load(folder / ".hydra" / "overrides.yaml")
        seeds |= {o for o in overrides if o.startswith("seed=")}
        assert list(overrides[: len(TINY)]) == TINY and len(overrides) == len(TINY) + 1  # its own run's, only
        assert (folder / "run.log").read_text().count("Running recipe supervised") == 1
        assert metrics(folder)["step"] == 2
    assert seeds == {"seed=1", "seed=2"}
    if folders[0].name != folders[1].name.removesuffix("-1"):  # they claimed in different seconds
        assert not folders[1].name.endswith("-1")
