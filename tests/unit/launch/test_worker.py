"""The runner's own save hook: which processes write the config, overrides and signature into a checkpoint."""

from types import SimpleNamespace

import pytest

from runner import provenance
from runner.engine import ProjectConfiguration
from runner.launch.worker import record_config_in_checkpoints
from runner.layout import CONFIG_FILE, OVERRIDES_FILE


def _save_hook(*, rank: int, local_rank: int, save_on_each_node: bool):
    hooks = []
    accelerator = SimpleNamespace(
        is_main_process=rank == 0,
        is_local_main_process=local_rank == 0,
        project_configuration=ProjectConfiguration(save_on_each_node=save_on_each_node),
        register_save_state_pre_hook=hooks.append,
    )
    record_config_in_checkpoints(accelerator, {"recipe": "x"}, ["trainer.max_steps=2"])
    return hooks[0]


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
    _save_hook(rank=rank, local_rank=local_rank, save_on_each_node=save_on_each_node)([], [], str(tmp_path))
    written = {path.name for path in tmp_path.iterdir()}
    assert written == ({CONFIG_FILE, OVERRIDES_FILE, provenance.SIGNATURE_FILE} if writes else set())
    if writes:
        assert provenance.signed_by_you(tmp_path)
