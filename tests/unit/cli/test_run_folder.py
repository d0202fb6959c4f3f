import threading
from datetime import datetime
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from runner.cli.command_line import parse_arguments
from runner.cli.run_folder import (
    check_run_folders,
    claim_default_run_folder,
    claim_run_folder,
    default_run_dir_pattern,
    release_run_folder,
)
from runner.config import CONF_DIR, ConfigError, register_configs
from runner.folders.layout import check_no_links

PATTERN = "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"
TEN = datetime(2026, 11, 29, 10, 0, 0)
register_configs()  # as runner.cli.main does before it composes


def _sentence(link: Path, target: Path) -> str:
    return (
        f"{link} is a symbolic link (to {target}); a run folder holds no links, so remove it or copy the run with "
        "links resolved (cp -rL)."
    )


def test_runs_started_in_the_same_second_claim_folders_of_their_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    claimed = [claim_run_folder(PATTERN, now=TEN) for _ in range(3)]
    assert [str(folder) for folder in claimed] == [
        "outputs/2026-11-29/10-00-00",
        "outputs/2026-11-29/10-00-00-1",
        "outputs/2026-11-29/10-00-00-2",
    ]
    assert all(folder.is_dir() and not any(folder.iterdir()) for folder in claimed)


def test_a_claim_the_checks_refused_is_released_with_the_parents_it_made(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    created = []
    folder = claim_run_folder(PATTERN, now=TEN, created=created)
    assert [path.relative_to(tmp_path) for path in created] == [Path("outputs/2026-11-29"), Path("outputs")]
    release_run_folder(folder, created)
    assert list(tmp_path.iterdir()) == []  # as if the command had never run
    (tmp_path / "outputs" / "mine.txt").parent.mkdir()
    (tmp_path / "outputs" / "mine.txt").write_text("kept")
    created = []
    release_run_folder(claim_run_folder(PATTERN, now=TEN, created=created), created)
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["mine.txt"]  # a folder it did not make stays


def test_claims_made_at_the_same_moment_never_share_a_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    claimed, start = [], threading.Barrier(8)

    def claim() -> None:
        start.wait()
        claimed.append(claim_run_folder(PATTERN, now=TEN))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(claimed)) == 8 and len(list((tmp_path / "outputs" / "2026-11-29").iterdir())) == 8


def test_a_pattern_with_other_interpolations_is_left_to_hydra(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert claim_run_folder("runs/${hydra.job.name}/${now:%H}", now=TEN) is None
    assert not (tmp_path / "runs").exists()


def test_a_folder_that_cannot_be_created_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").write_text("a file where the folder goes")
    with pytest.raises(ConfigError, match=r"^The run folder outputs/2026-11-29/10-00-00 cannot be created "):
        claim_run_folder(PATTERN, now=TEN)


def test_the_default_pattern_is_conf_config_yaml_s_and_no_other_built_in_config_changes_it():
    assert default_run_dir_pattern(CONF_DIR) == PATTERN
    # claim_default_run_folder composes nothing for the built-in configs: it relies on this.
    for path in CONF_DIR.rglob("*.yaml"):
        if path != CONF_DIR / "config.yaml":
            assert OmegaConf.select(OmegaConf.load(path), "hydra.run") is None, path


@pytest.mark.parametrize(
    "argv",
    [
        ["hydra.run.dir=mine"],  # named, or added by resume, torchrun and Slurm
        ["-m", "optimizer.lr=1e-3,3e-3"],
        ["--cfg", "job"],
        ["--info"],
    ],
)
def test_only_a_single_run_in_the_default_folder_gets_one_claimed(tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    assert claim_default_run_folder(parse_arguments(argv)) is None
    assert list(tmp_path.iterdir()) == []


def test_a_run_in_the_default_folder_gets_a_new_one_named_as_conf_config_yaml_says(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = datetime.now().replace(microsecond=0)
    claimed = claim_default_run_folder(parse_arguments(["trainer.max_steps=2", "project.project_dir=elsewhere"]))
    assert claimed.is_dir() and claimed.parent.parent == Path("outputs")
    assert before <= datetime.strptime(f"{claimed.parent.name}/{claimed.name}", "%Y-%m-%d/%H-%M-%S") <= datetime.now()


def test_a_users_own_configs_keep_their_own_run_folder_pattern(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    conf = tmp_path / "conf"
    (conf / "experiment").mkdir(parents=True)
    (conf / "experiment" / "theirs.yaml").write_text("# @package _global_\nhydra:\n  run:\n    dir: runs/${now:%H}\n")
    (conf / "experiment" / "plain.yaml").write_text("# @package _global_\nseed: 7\n")
    assert claim_default_run_folder(parse_arguments(["--config-dir", str(conf), "experiment=theirs"])) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conf"]
    claimed = claim_default_run_folder(parse_arguments(["--config-dir", str(conf), "experiment=plain"]))
    assert claimed is not None and claimed.parent.parent == Path("outputs")


def test_a_link_anywhere_in_a_run_folder_is_named_with_where_it_points(tmp_path):
    run = tmp_path / "run"
    deep = run / "checkpoints" / "checkpoint_0"
    deep.mkdir(parents=True)
    (run / "metrics.json").write_text("{}")
    check_no_links(run)
    (deep / "model.safetensors").symlink_to("../../../weights.bin")  # relative: shown where it lands
    with pytest.raises(ConfigError) as refused:
        check_no_links(run)
    assert str(refused.value) == _sentence(deep / "model.safetensors", tmp_path / "weights.bin")


def test_the_run_folder_itself_may_be_a_link_and_a_missing_one_has_nothing_to_check(tmp_path):
    (tmp_path / "scratch").mkdir()
    (tmp_path / "scratch" / "run.log").write_text("")
    (tmp_path / "run").symlink_to(tmp_path / "scratch")  # e.g. outputs -> /scratch/outputs
    check_no_links(tmp_path / "run")
    check_no_links(tmp_path / "not-yet")


def test_resume_is_checked_as_written_so_a_linked_checkpoints_folder_cannot_move_the_run(tmp_path):
    run, theirs = tmp_path / "run", tmp_path / "your-project" / "checkpoints"
    (theirs / "checkpoint_3").mkdir(parents=True)
    run.mkdir()
    (run / "checkpoints").symlink_to(theirs)
    for resume in (run, run / "checkpoints" / "checkpoint_3"):
        with pytest.raises(ConfigError) as refused:
            check_run_folders([f"resume={resume}", "trainer.max_steps=8"])
        assert str(refused.value) == _sentence(run / "checkpoints", theirs)


def test_every_folder_the_command_line_names_is_checked(tmp_path):
    for key in ("hydra.run.dir", "project.project_dir", "hydra.sweep.dir"):
        folder = tmp_path / key
        folder.mkdir()
        (folder / "run.log").symlink_to(tmp_path / "yours.log")
        with pytest.raises(ConfigError, match="run.log is a symbolic link"):
            check_run_folders([f"{key}={folder}"])
    check_run_folders(["hydra.run.dir=outputs/${now:%H}", "resume=null"])  # Hydra's to resolve; nothing to resume


def test_what_wandb_writes_in_its_own_folder_is_not_walked_but_the_folder_may_not_be_a_link(tmp_path):
    run = tmp_path / "run"
    offline = run / "wandb" / "offline-run-1-abc"
    (offline / "logs").mkdir(parents=True)
    (run / "wandb" / "latest-run").symlink_to(offline)  # what W&B writes itself
    (offline / "logs" / "debug-core.log").symlink_to(tmp_path / "cache.log")  # W&B links its core's log out
    check_no_links(run)
    (run / "logs").mkdir()
    (run / "logs" / "metrics.csv").symlink_to(tmp_path / "elsewhere.csv")  # anywhere else: refused
    with pytest.raises(ConfigError) as refused:
        check_no_links(run)
    assert str(refused.value) == _sentence(run / "logs" / "metrics.csv", tmp_path / "elsewhere.csv")
    (run / "logs" / "metrics.csv").unlink()
    moved = tmp_path / "moved"
    (run / "wandb").rename(moved)
    (run / "wandb").symlink_to(moved)  # the folder itself a link: refused
    with pytest.raises(ConfigError) as refused:
        check_no_links(run)
    assert str(refused.value) == _sentence(run / "wandb", moved)


def test_what_submitit_writes_in_a_sweep_folder_is_not_walked_but_the_folder_may_not_be_a_link(tmp_path):
    sweep = tmp_path / "sweep"
    (sweep / ".submitit" / "17").mkdir(parents=True)
    script = sweep / ".submitit" / "17" / "17_submission.sh"
    script.write_text("#!/bin/bash\n")
    (sweep / ".submitit" / ".submission_file_0a1b.sh").symlink_to(script)  # what submitit writes itself
    check_no_links(sweep)
    (sweep / "0" / ".submitit").mkdir(parents=True)  # only the sweep folder's own .submitit is submitit's
    (sweep / "0" / ".submitit" / "x.sh").symlink_to(script)
    with pytest.raises(ConfigError) as refused:
        check_no_links(sweep)
    assert str(refused.value) == _sentence(sweep / "0" / ".submitit" / "x.sh", script)
    (sweep / "0" / ".submitit" / "x.sh").unlink()
    (sweep / ".submitit").rename(tmp_path / "moved")
    (sweep / ".submitit").symlink_to(tmp_path / "moved")
    with pytest.raises(ConfigError) as refused:
        check_no_links(sweep)
    assert str(refused.value) == _sentence(sweep / ".submitit", tmp_path / "moved")
