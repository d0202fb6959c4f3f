"""What each worker builds from the config: its Accelerator's settings, and the runner's own save hook (which
processes write the config, overrides and signature into a checkpoint)."""

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from runner.engine import ParallelismConfig, ProjectConfiguration
from runner.folders import provenance
from runner.folders.layout import CONFIG_FILE, OVERRIDES_FILE
from runner.launch.worker import build_accelerator, pin_threads, record_config_in_checkpoints


def _save_hooks(*, rank: int, local_rank: int, save_on_each_node: bool):
    """The hook that writes the config files, and the one that signs them with the manifest."""
    hooks, commit_hooks = [], []
    accelerator = SimpleNamespace(
        is_main_process=rank == 0,
        is_local_main_process=local_rank == 0,
        project_configuration=ProjectConfiguration(save_on_each_node=save_on_each_node),
        register_save_state_pre_hook=hooks.append,
        register_save_state_commit_hook=commit_hooks.append,
    )
    record_config_in_checkpoints(accelerator, {"recipe": "x"}, ["trainer.max_steps=2"])
    return hooks[0], commit_hooks[0]


@pytest.mark.parametrize(
    ("rank", "local_rank", "save_on_each_node", "writes"),
    [
        (0, 0, False, True),
        (1, 0, False, False),  # another node's local main process: one shared folder, rank 0 wrote it
        (1, 0, True, True),  # its node's own copy needs them for resume= there
        (2, 1, True, False),  # its node's local main process writes them
    ],
)
def test_the_config_is_written_by_rank_0_or_by_each_node_under_save_on_each_node(
    tmp_path, rank, local_rank, save_on_each_node, writes
):
    write, seal = _save_hooks(rank=rank, local_rank=local_rank, save_on_each_node=save_on_each_node)
    write([], [], str(tmp_path))
    written = {path.name for path in tmp_path.iterdir()}
    assert written == ({CONFIG_FILE, OVERRIDES_FILE} if writes else set())
    if writes:  # the commit hook runs where the manifest was written: it signs the files and the manifest
        (tmp_path / "manifest.json").write_text("{}")
        seal(str(tmp_path))
        assert provenance.signed_by_you(tmp_path)
        (tmp_path / "manifest.json").write_text('{"step": 9}')
        assert provenance.signature_of(tmp_path) == "changed"


def _accelerator_arguments(monkeypatch, tmp_path, *overrides: str, drop: tuple[str, ...] = ()) -> dict:
    """The keywords build_accelerator gives Accelerator for a composed config (no Accelerator is built)."""
    from hydra import compose, initialize_config_dir

    import runner.engine
    from runner.config import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, f"project.project_dir={tmp_path}"])
    if drop:  # the config of a run saved before these keys existed, as resume reads it
        from runner.config.resume import resumed_config

        saved = OmegaConf.to_container(cfg)
        saved["parallel"] = {k: v for k, v in saved["parallel"].items() if k not in drop}
        (tmp_path / "checkpoint_0").mkdir()
        OmegaConf.save(OmegaConf.create(saved), tmp_path / "checkpoint_0" / CONFIG_FILE)
        cfg = resumed_config(tmp_path / "checkpoint_0", [])
    monkeypatch.setattr(runner.engine, "Accelerator", lambda **kwargs: kwargs)
    return build_accelerator(cfg)


def test_fsdp_runs_get_the_mesh_of_their_parallel_keys(monkeypatch, tmp_path):
    plan = "parallel.tp_plan={blocks.*.mlp.fc:colwise}"
    arguments = _accelerator_arguments(monkeypatch, tmp_path, "experiment=shakespeare_gpt_hsdp", "parallel.tp=2", plan)
    assert arguments["parallelism_config"] == ParallelismConfig(
        dp_replicate_size=2, dp_shard_size="auto", tp_size=2, cp_size=1, tp_plan={"blocks.*.mlp.fc": "colwise"}
    )
    assert arguments["fsdp_plugin"].transformer_cls_names_to_wrap == ["Block"]
    tp = _accelerator_arguments(monkeypatch, tmp_path, "experiment=shakespeare_gpt_tp")["parallelism_config"]
    assert tp == ParallelismConfig(dp_shard_size="auto", tp_size=2)  # tp_plan None: GPT.tp_plan
    assert _accelerator_arguments(monkeypatch, tmp_path, "experiment=mnist_ddp")["parallelism_config"] is None


def test_an_fsdp_run_saved_before_the_mesh_keys_gets_plain_fsdp(monkeypatch, tmp_path):
    mesh_keys = ("dp_replicate", "dp_shard", "tp", "cp", "tp_plan")
    arguments = _accelerator_arguments(monkeypatch, tmp_path, "experiment=mnist_fsdp", drop=mesh_keys)
    assert arguments["parallelism_config"] == ParallelismConfig(dp_shard_size="auto")


@pytest.mark.parametrize(("threads", "pinned"), [(3, 3), (None, 7)])  # OMP_NUM_THREADS, else torch's count
def test_every_worker_fixes_its_thread_count_which_turns_mkls_dynamic_threading_off(monkeypatch, threads, pinned):
    import torch

    calls = []
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    monkeypatch.setattr(torch, "set_num_threads", calls.append)  # torch's also calls mkl_set_dynamic(false)
    pin_threads(threads)
    assert calls == [pinned]
