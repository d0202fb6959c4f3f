"""The strategy interface: each strategy's checkpoint format, and the hooks checkpoint.py and prepare() call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from runner.engine import Accelerator, CheckpointError, FullyShardedDataParallelPlugin
from runner.engine.checkpoint.serialization import load_safetensors, save_safetensors
from runner.engine.checkpoint.torch_files import torch_load
from runner.engine.distributed import DistributedEnvironment
from runner.engine.parallel import (
    DDPStrategy,
    DistributedDataParallelKwargs,
    FSDPStrategy,
    SingleProcessStrategy,
)

ONE = DistributedEnvironment()
TWO = DistributedEnvironment(rank=0, world_size=2, local_world_size=2, backend="gloo")


def _fsdp(state_dict_type: str = "SHARDED_STATE_DICT") -> FSDPStrategy:
    plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Linear"], state_dict_type=state_dict_type)
    return FSDPStrategy(ONE, plugin, None)


class Folder:
    """A checkpoint folder on disk that is both written and read (the CheckpointWriter and CheckpointReader)."""

    def __init__(self, path: Path, state_format: str = "safetensors") -> None:
        self.path = path
        self.state_format = state_format

    def save_tensors(self, tensors, name: str) -> None:
        save_safetensors(tensors, self.path / name)

    def save_object(self, obj: Any, name: str) -> None:
        torch.save(obj, self.path / name)

    def require(self, name: str) -> Path:
        if not (self.path / name).exists():
            raise CheckpointError(f"{self.path} has no {name}")
        return self.path / name

    def listed_in(self, folder: str) -> set[str]:
        return {p.name for p in (self.path / folder).iterdir()} - {".metadata"}

    def load_tensors(self, name: str) -> dict[str, torch.Tensor]:
        return load_safetensors(self.path / name)

    def load_object(self, name: str, *, mapped: bool = False) -> Any:
        return torch_load(self.path / name, mapped=mapped)


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_each_strategy_reports_the_checkpoint_format_it_writes():
    assert SingleProcessStrategy().checkpoint_format == "safetensors"
    assert DDPStrategy(TWO, DistributedDataParallelKwargs()).checkpoint_format == "safetensors"
    assert _fsdp("SHARDED_STATE_DICT").checkpoint_format == "dcp"
    assert _fsdp("FULL_STATE_DICT").checkpoint_format == "safetensors"  # gathered to rank 0, written whole


def test_only_fsdp_refuses_a_save_in_the_middle_of_an_accumulation_cycle():
    for strategy in (SingleProcessStrategy(), DDPStrategy(TWO, DistributedDataParallelKwargs()), _fsdp()):
        strategy.check_save(mid_cycle=False)
    SingleProcessStrategy().check_save(mid_cycle=True)  # the pending gradients are saved per rank
    with pytest.raises(CheckpointError, match=r"save_state under FSDP needs a gradient accumulation cycle boundary"):
        _fsdp().check_save(mid_cycle=True)


def test_every_strategy_loads_both_formats(tmp_path):
    for strategy in (SingleProcessStrategy(), DDPStrategy(TWO, DistributedDataParallelKwargs()), _fsdp()):
        strategy.check_load(Folder(tmp_path, state_format="dcp"))  # sharded state is read by parameter name
        strategy.check_load(Folder(tmp_path))


def test_replicated_state_is_written_by_rank_0_only_and_loads_back_exactly(tmp_path):
    strategy = SingleProcessStrategy()
    model, optimizer = _trained()
    weights = strategy.checkpoint_weights([model])
    assert [sorted(w) for w in weights] == [["0.bias", "0.weight"]]  # what save_state's hooks may edit

    (tmp_path / "rank1").mkdir()
    strategy.save_model_state(Folder(tmp_path / "rank1"), [model], [optimizer], weights=weights, rank=1)
    assert list((tmp_path / "rank1").iterdir()) == []
    strategy.save_model_state(Folder(tmp_path), [model], [optimizer], weights=weights, rank=0)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["model.safetensors", "optimizer.bin"]

    fresh, fresh_optimizer = _trained(seed=1)
    strategy.load_model_state(Folder(tmp_path), [fresh], [fresh_optimizer])
    assert all(torch.equal(value, fresh.state_dict()[key]) for key, value in model.state_dict().items())
    saved, loaded = optimizer.state_dict()["state"][0], fresh_optimizer.state_dict()["state"][0]
    assert torch.equal(saved["exp_avg"], loaded["exp_avg"]) and torch.equal(saved["step"], loaded["step"])


def test_fsdp_hands_the_save_hooks_no_weights():
    assert _fsdp().checkpoint_weights([nn.Linear(2, 2)]) is None


def test_replicated_strategies_leave_optimizers_as_they_were_built():
    model, optimizer = _trained()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    with SingleProcessStrategy().preparing_models([model], [optimizer]):
        model[0].weight = nn.Parameter(model[0].weight.detach().clone())
    assert [p for group in optimizer.param_groups for p in group["params"]] == params


def test_fsdp_points_optimizers_at_the_parameters_that_replaced_the_models_own():
    model = nn.Sequential(nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with _fsdp().preparing_models([model], [optimizer]):  # as fully_shard does: every parameter is replaced
        model[0].weight = nn.Parameter(model[0].weight.detach().clone())
        model[0].bias = nn.Parameter(model[0].bias.detach().clone())
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(model[0].weight), id(model[0].bias)]


def test_prepare_under_fsdp_refuses_an_optimizer_that_already_stepped():
    model, optimizer = _trained()
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Linear"]))
    with pytest.raises(ValueError, match=r"this optimizer has already stepped on the unsharded ones"):
        accelerator.prepare(model, optimizer)
    Accelerator().prepare(*_trained())  # without sharding, nothing to re-point


def _overwrite_in_place(path: Path) -> None:
    """Zero a file's bytes without replacing it: what a memory map of it still sees."""
    size = path.stat().st_size
    with open(path, "r+b") as file:
        file.write(bytes(size))


def test_loaded_optimizer_state_goes_into_the_tensors_it_held_and_keeps_nothing_of_the_file(tmp_path):
    strategy = SingleProcessStrategy()
    model, optimizer = _trained()
    strategy.save_model_state(Folder(tmp_path), [model], [optimizer], weights=None, rank=0)
    saved = {key: value.clone() for key, value in optimizer.state_dict()["state"][0].items()}

    trained, trained_optimizer = _trained(seed=1)  # holds moments of the same shapes: they are reused
    fresh = nn.Sequential(nn.Linear(3, 2))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)  # holds none: new memory
    held = trained_optimizer.state[trained[0].weight]["exp_avg"]
    strategy.load_model_state(Folder(tmp_path), [trained], [trained_optimizer])
    strategy.load_model_state(Folder(tmp_path), [fresh], [fresh_optimizer])
    assert trained_optimizer.state[trained[0].weight]["exp_avg"] is held

    _overwrite_in_place(tmp_path / "optimizer.bin")
    for loaded in (trained_optimizer, fresh_optimizer):
        state = loaded.state_dict()["state"][0]
        assert all(torch.equal(state[key], value) for key, value in saved.items())
    # The check above can fail: a tensor left as a view of the file's map sees the overwrite.
    model, optimizer = _trained()
    strategy.save_model_state(Folder(tmp_path), [model], [optimizer], weights=None, rank=0)
    mapped = torch_load(tmp_path / "optimizer.bin", mapped=True)["state"][0]["exp_avg"]
    _overwrite_in_place(tmp_path / "optimizer.bin")
    assert not mapped.any()
