"""The command line read once into a CommandLine: what Hydra composes, the resume decision and the run folder."""

import dataclasses
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from runner.cli.command_line import parse_arguments, read
from runner.config import ConfigError, register_configs
from runner.engine import Accelerator, ProjectConfiguration
from runner.engine.launch_environment import LaunchEnvironment
from runner.folders import provenance
from tests.shared_data import MNIST, needs_mnist

register_configs()  # as runner.cli.main does before it composes
ALONE = LaunchEnvironment()
# The checks prepare the datasets a command names: the real MNIST test split, as the other unit tests use it.
DATA = [f"data.root={MNIST}", 'data.train_split="test[:100]"', 'data.eval_split="test[9900:]"']


def _read(argv: list[str], environment: LaunchEnvironment = ALONE):
    return read(parse_arguments(argv), argv, environment)


@needs_mnist
def test_a_plain_command_is_checked_and_names_its_run_folder(tmp_path):
    argv = [*DATA, f"hydra.run.dir={tmp_path / 'run'}"]
    command = _read(argv)
    assert command.overrides == tuple(argv) and command.flags == ()
    assert command.composed is not None and command.starts_run and command.resume is None and not command.multirun
    assert (command.run_folder, command.run_folder_key) == (tmp_path / "run", "hydra.run.dir")
    assert command.argv == argv


@needs_mnist
def test_project_dir_names_the_folder_over_hydra_run_dir_and_other_ranks_take_none(tmp_path):
    argv = [*DATA, f"project.project_dir={tmp_path / 'a'}", f"hydra.run.dir={tmp_path / 'b'}"]
    assert (_read(argv).run_folder, _read(argv).run_folder_key) == (tmp_path / "a", "project.project_dir")
    assert _read(argv, LaunchEnvironment(rank=1, world_size=2)).run_folder is None
    node1 = [*argv, "parallel=ddp", "trainer.node_rank=1", "trainer.num_nodes=2", "trainer.rdzv_endpoint=gpu01:29400"]
    assert _read(node1).run_folder is None  # node 0 takes it
    assert _read([*DATA, "hydra.run.dir=outputs/${now:%H}"]).run_folder is None  # only Hydra can resolve it


def test_help_and_info_are_passed_to_hydra_unchecked():
    for argv in (["--info"], ["--hydra-help"]):
        command = _read(argv)
        assert command.composed is None and not command.starts_run and command.argv == argv


def test_cfg_is_composed_and_checked_but_starts_no_run():
    command = _read(["--cfg", "job", "trainer.max_steps=3"])
    assert command.flags == ("--cfg", "job") and not command.starts_run and command.composed is None
    with pytest.raises(ConfigError, match="trainer.max_stepz is not a key of 'trainer'"):
        _read(["--cfg", "job", "trainer.max_stepz=3"])


@needs_mnist
def test_torchrun_ranks_agree_on_one_folder_through_the_rendezvous_id():
    rank0 = _read(DATA, LaunchEnvironment(rank=0, world_size=2, run_id="job7"))
    rank1 = _read(DATA, LaunchEnvironment(rank=1, world_size=2, run_id="job7"))
    assert rank0.overrides == (*DATA, "hydra.run.dir=outputs/torchrun-job7")
    assert rank1.overrides == (
        *DATA, "hydra.run.dir=outputs/torchrun-job7", "hydra.output_subdir=null", "hydra/job_logging=disabled"
    )  # fmt: skip
    assert rank0.run_folder == Path("outputs/torchrun-job7").resolve() and rank1.run_folder is None
    # Composed once, with the agreed folder, and run as composed: Hydra does not compose the ranks' configs again.
    assert rank0.composed.config.hydra.run.dir == rank1.composed.config.hydra.run.dir == "outputs/torchrun-job7"
    assert (rank0.composed.config.hydra.output_subdir, rank1.composed.config.hydra.output_subdir) == (".hydra", None)
    with pytest.raises(ConfigError, match="the ranks cannot agree on a run folder; pass hydra.run.dir="):
        _read(DATA, LaunchEnvironment(rank=0, world_size=2, run_id="none"))


def test_resume_in_a_sweep_is_refused_before_anything_is_read(tmp_path):
    with pytest.raises(ConfigError, match=r"resume= continues one run; drop -m/--multirun\."):
        _read(["-m", f"resume={tmp_path / 'missing'}", "seed=1,2"])


@pytest.fixture
def signed_run(tmp_path, monkeypatch):
    """A run folder with one checkpoint written by this user (signed), composed with trainer.max_steps=10."""
    monkeypatch.setenv("RUNNER_HOME", str(tmp_path / "home"))
    run = tmp_path / "run"
    accelerator = Accelerator(project_config=ProjectConfiguration(str(run), automatic_checkpoint_naming=True))
    accelerator.prepare(torch.nn.Linear(2, 2))

    def record(models, weights, output_dir):
        OmegaConf.save(OmegaConf.create({"seed": 1, "trainer": {"max_steps": 10}}), f"{output_dir}/config.yaml")
        OmegaConf.save(OmegaConf.create(["trainer.max_steps=10", "tracker=none"]), f"{output_dir}/overrides.yaml")

    accelerator.register_save_state_pre_hook(record)
    accelerator.register_save_state_commit_hook(provenance.sign)  # once the manifest is written, as runs sign
    accelerator.save_state()
    return run


def test_resume_replays_the_runs_own_overrides_and_names_its_checkpoint_and_folder(signed_run):
    command = _read([f"resume={signed_run}", "trainer.max_steps=20"])
    checkpoint = signed_run / "checkpoints" / "checkpoint_0"
    assert (command.resume.run_dir, command.resume.checkpoint) == (signed_run, checkpoint)
    assert command.resume.replayed == ("trainer.max_steps=10", "tracker=none")
    assert command.overrides == (
        "trainer.max_steps=10", "tracker=none", f"resume={checkpoint}", "trainer.max_steps=20",
        f"hydra.run.dir={signed_run}", "hydra.output_subdir=null",
    )  # fmt: skip
    assert command.run_folder == signed_run and command.composed is not None


def test_resume_refuses_to_switch_a_config_group(signed_run):
    with pytest.raises(ConfigError, match=r"resume= keeps the resumed run's config groups, but model=gpt switches"):
        _read([f"resume={signed_run}", "model=gpt"])


@needs_mnist
def test_a_single_run_is_composed_once_into_exactly_what_hydras_command_line_runs(tmp_path, monkeypatch):
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from runner.cli import app

    user = tmp_path / "conf" / "experiment"
    user.mkdir(parents=True)
    (user / "mine.yaml").write_text("# @package _global_\ntrainer:\n  max_steps: 7\n")
    argv = ["--config-dir", str(tmp_path / "conf"), *DATA, "experiment=mine", "optimizer.lr=0.25",
            f"hydra.run.dir={tmp_path / 'run'}", "hydra.job.chdir=false"]  # fmt: skip
    seen = []
    monkeypatch.setattr(app, "main", lambda cfg, command: seen.append((cfg, HydraConfig.get())))
    command = _read(argv)
    assert command.composed is not None
    for run in (command, dataclasses.replace(command, composed=None)):  # once, then as Hydra's command line does
        GlobalHydra.instance().clear()
        app.run_hydra(run)
    GlobalHydra.instance().clear()
    (once, once_hydra), (hydras, hydras_hydra) = seen
    assert once.trainer.max_steps == 7 and once.optimizer.lr == 0.25
    assert OmegaConf.to_yaml(once) == OmegaConf.to_yaml(hydras)
    assert OmegaConf.to_yaml(once_hydra) == OmegaConf.to_yaml(hydras_hydra)
    assert list(once_hydra.overrides.hydra)[-1] == "hydra.mode=RUN"
    # In the folder claimed for it (Hydra's default pattern), still composed once, into the same run and record.
    monkeypatch.chdir(tmp_path)
    claimed = _read(argv[:-2])
    assert claimed.composed is not None and claimed.composed.config.hydra.run.dir.startswith("outputs/")
    seen.clear()
    for run in (claimed, dataclasses.replace(claimed, composed=None)):
        GlobalHydra.instance().clear()
        app.run_hydra(run)
    GlobalHydra.instance().clear()
    (once, once_hydra), (hydras, hydras_hydra) = seen
    assert OmegaConf.to_yaml(once) == OmegaConf.to_yaml(hydras)
    assert OmegaConf.to_yaml(once_hydra) == OmegaConf.to_yaml(hydras_hydra)
    assert list(once_hydra.overrides.hydra)[-2:] == [f"hydra.run.dir={claimed.composed.config.hydra.run.dir}",
                                                      "hydra.mode=RUN"]  # fmt: skip
    # What Hydra's command line runs its own way, and a typo, which the first composition already names.
    assert _read([*DATA, "trainer.max_steps=1,2"]).composed is None  # a sweep without -m: Hydra says so
    with pytest.raises(ConfigError, match=r"^trainer.max_stepz is not a key of 'trainer' \(did you mean"):
        _read([*DATA, "trainer.max_stepz=3"])
