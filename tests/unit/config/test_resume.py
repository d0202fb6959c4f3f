"""resume= paths: a checkpoint folder, a run folder (newest intact checkpoint), and every wrong path."""

import logging

import pytest
import torch
from omegaconf import OmegaConf

from runner.config import ConfigError
from runner.config.resume import find_checkpoint, resumed_config
from runner.engine import Accelerator, ProjectConfiguration
from runner.folders.layout import saved_overrides


@pytest.fixture
def run_dir(tmp_path):
    """A run folder with checkpoint_0..2, each holding the run's config and overrides."""
    accelerator = Accelerator(project_config=ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True))
    accelerator.prepare(torch.nn.Linear(2, 2))

    def write_config(models, weights, output_dir):
        OmegaConf.save(OmegaConf.create({"seed": 1, "trainer": {"max_steps": 10}}), f"{output_dir}/config.yaml")
        OmegaConf.save(OmegaConf.create(["trainer.max_steps=10", "seed=1"]), f"{output_dir}/overrides.yaml")

    accelerator.register_save_state_pre_hook(write_config)
    for _ in range(3):
        accelerator.save_state()
    return tmp_path


def test_a_checkpoint_folder_resumes_itself(run_dir):
    folder = run_dir / "checkpoints" / "checkpoint_1"
    assert find_checkpoint(str(folder)) == (run_dir, folder)
    assert saved_overrides(folder) == ["trainer.max_steps=10", "seed=1"]


def test_a_run_folder_resumes_its_newest_intact_checkpoint(run_dir, caplog):
    assert find_checkpoint(str(run_dir)) == (run_dir, run_dir / "checkpoints" / "checkpoint_2")
    (run_dir / "checkpoints" / "checkpoint_2" / "model.safetensors").write_bytes(b"broken")
    (run_dir / "checkpoints" / "checkpoint_3").mkdir()  # never committed
    with caplog.at_level(logging.WARNING, logger="runner"):
        assert find_checkpoint(str(run_dir))[1] == run_dir / "checkpoints" / "checkpoint_1"
    assert "Skipping checkpoint_2" in caplog.text and "model.safetensors has 6 bytes" in caplog.text


@pytest.mark.parametrize("path", ["checkpoints/checkpoint_1", "."])
def test_a_verified_resume_tells_the_workers_not_to_hash_it_again(run_dir, path):
    from runner.config.resume import find_verified_checkpoint
    from runner.engine.checkpoint import VerifiedCheckpoint
    from runner.engine.checkpoint.manifest import read_manifest

    _, checkpoint = find_checkpoint(str(run_dir / path), verify_checksums=False)  # a sweep job's: workers verify
    found_in, verified = find_verified_checkpoint(str(run_dir / path))
    digest = read_manifest(checkpoint, verify_checksums=False)["digest"]
    assert (found_in, verified) == (run_dir, VerifiedCheckpoint(checkpoint.resolve(), digest))
    (checkpoint / "model.safetensors").write_bytes(b"broken")
    with pytest.raises(ConfigError, match="model.safetensors has 6 bytes"):
        find_verified_checkpoint(str(checkpoint))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda root: root / "missing", "does not exist; pass a run folder or one of its checkpoints/checkpoint_N"),
        (lambda root: root / "checkpoints", "is neither a checkpoint folder (checkpoint_N) nor a run folder"),
        (lambda root: root / "checkpoints" / "checkpoint_9", "does not exist"),
    ],
)
def test_wrong_resume_paths_get_one_sentence(run_dir, make, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        find_checkpoint(str(make(run_dir)))


def test_a_run_folder_without_intact_checkpoints_is_refused(run_dir):
    for folder in (run_dir / "checkpoints").iterdir():
        (folder / "manifest.json").unlink()
    with pytest.raises(ConfigError, match="has no complete checkpoint in .*; start a new run instead"):
        find_checkpoint(str(run_dir))


def test_a_checkpoint_without_a_runner_config_points_to_load_state(tmp_path):
    accelerator = Accelerator(project_config=ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True))
    accelerator.save_state()
    with pytest.raises(ConfigError, match="has no config.yaml, so it was not written by `python -m runner`"):
        find_checkpoint(str(tmp_path / "checkpoints" / "checkpoint_0"))


def test_new_overrides_apply_on_top_of_the_saved_config(tmp_path):
    (tmp_path / "config.yaml").write_text(
        "trainer: {max_steps: 10, max_epochs: 1}\nmodel: {_target_: m.M, width: 4}\nparallel: {strategy: none}\n"
        "optimizer: {lr: 0.1}\n"
    )
    cfg = resumed_config(tmp_path, ["trainer.max_steps=2000", 'data.train_split="test[:10]"'])
    assert (cfg.trainer.max_steps, cfg.model.width, cfg.data.train_split) == (2000, 4, "test[:10]")
    with pytest.raises(ConfigError, match=r"Cannot apply model.widht=5 to the resumed run"):
        resumed_config(tmp_path, ["model.widht=5"])
    with pytest.raises(ConfigError, match=r"Cannot apply trainer.max_steps='many' to the resumed run"):
        resumed_config(tmp_path, ["trainer.max_steps=many"])


def test_a_saved_value_taken_from_an_overridden_key_follows_it(tmp_path):
    (tmp_path / "config.yaml").write_text(  # saved resolved: data.eval.split was ${data.eval_split}
        "model: {_target_: m.M, width: 4}\nparallel: {strategy: none}\noptimizer: {lr: 0.1}\n"
        "data: {eval_split: 'test[9000:]', eval: {_target_: d.D, split: 'test[9000:]', size: 4}}\n"
        "metrics: {acc: {_target_: a.A, splits: [all, 'test[9000:]']}}\n"
    )
    composed = OmegaConf.create(
        {
            "data": {"eval_split": "test[:10]", "eval": {"_target_": "d.D", "split": "${data.eval_split}", "size": 4}},
            "note": "${data.eval_split}",
            "metrics": {"acc": {"_target_": "a.A", "splits": ["all", "${data.eval_split}"]}},
        }  # fmt: skip
    )
    cfg = resumed_config(tmp_path, ['data.eval_split="test[:10]"'], composed=composed)
    assert OmegaConf.to_container(cfg.data.eval, resolve=True) == {"_target_": "d.D", "split": "test[:10]", "size": 4}
    assert cfg.metrics.acc.splits == ["all", "test[:10]"]  # in a list too
    assert "note" not in cfg  # only values the saved config has are linked again
    unchanged = resumed_config(tmp_path, ["model.width=8"], composed=composed)
    assert unchanged.data.eval.split == "test[9000:]" and unchanged.model.width == 8
