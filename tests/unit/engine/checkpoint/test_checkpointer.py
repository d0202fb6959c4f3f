"""The Checkpointer on its own: driven by a PreparedObjects view and a strategy of the test's, no Accelerator.

The strategy decides how models and optimizers are stored and what format the manifest records;
the Checkpointer asks it, never which strategy it is.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from torch import nn

from runner.engine import CheckpointError, GradientAccumulationPlugin, ProjectConfiguration
from runner.engine.checkpoint.checkpointer import Checkpointer
from runner.engine.distributed import DistributedEnvironment
from runner.engine.optimizer import AcceleratedOptimizer, GradientState
from runner.engine.prepared import PreparedObjects


class OwnFolders:
    """A strategy that keeps its model and optimizer state in folders of its own, and records every call."""

    name = "folders"
    checkpoint_format = "dcp"  # the manifest then asks for model/.metadata and optimizer/.metadata

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def wrap_model(self, model):
        return model

    def preparing_models(self, models, optimizers):
        return contextlib.nullcontext()

    def checkpoint_weights(self, models):
        self.calls.append(("checkpoint_weights", len(models)))
        return None

    def check_save(self, *, mid_cycle):
        self.calls.append(("check_save", mid_cycle))

    def save_model_state(self, folder, models, optimizers, *, weights, rank):
        self.calls.append(("save_model_state", folder.path.name, weights, rank))
        (folder.path / "model").mkdir()
        folder.save_tensors(models[0].state_dict(), "model/weights.safetensors")
        folder.save_object({"tensors": ["weight", "bias"]}, "model/.metadata")
        (folder.path / "optimizer").mkdir()
        folder.save_object(optimizers[0].state_dict(), "optimizer/.metadata")

    def check_load(self, checkpoint):
        self.calls.append(("check_load", checkpoint.state_format))

    def load_model_state(self, checkpoint, models, optimizers):
        self.calls.append(("load_model_state", sorted(checkpoint.listed_in("model"))))
        models[0].load_state_dict(checkpoint.load_tensors("model/weights.safetensors"))
        checkpoint.require("optimizer/.metadata")
        optimizers[0].load_state_dict(checkpoint.load_object("optimizer/.metadata"))


def _prepared(strategy, seed: int) -> PreparedObjects:
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    gradient_state = GradientState(GradientAccumulationPlugin())
    optimizer = AcceleratedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), gradient_state=gradient_state)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return PreparedObjects(
        env=DistributedEnvironment(), strategy=strategy, gradient_state=gradient_state, models=(model,),
        optimizers=(optimizer,),
    )  # fmt: skip


def test_the_checkpointer_saves_and_loads_through_the_strategy_it_is_given(tmp_path):
    saving = OwnFolders()
    prepared = _prepared(saving, seed=0)
    project = ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True)
    folder = Checkpointer().save(prepared, None, project=project, metadata=None)
    assert folder == tmp_path / "checkpoints" / "checkpoint_0" and project.iteration == 1
    assert saving.calls == [
        ("checkpoint_weights", 1),
        ("check_save", False),
        ("save_model_state", "checkpoint_0.incomplete", None, 0),
    ]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["state_format"] == "dcp" and manifest["contents"]["models"] == 1
    assert sorted(manifest["files"]) == [
        "model/.metadata", "model/weights.safetensors", "optimizer/.metadata", "random_states_0.pt",
    ]  # fmt: skip

    loading = OwnFolders()
    restored = _prepared(loading, seed=1)
    Checkpointer().load(restored, folder, project=ProjectConfiguration(), verify_checksums=True)
    assert loading.calls == [("check_load", "dcp"), ("load_model_state", ["weights.safetensors"])]
    assert torch.equal(restored.models[0].weight, prepared.models[0].weight)
    assert restored.optimizers[0].state_dict()["state"][0]["step"] == 1


def test_the_strategy_refuses_a_checkpoint_before_anything_is_loaded(tmp_path):
    folder = Checkpointer().save(
        _prepared(OwnFolders(), seed=0), tmp_path / "ck", project=ProjectConfiguration(), metadata=None,
    )  # fmt: skip

    class Refusing(OwnFolders):
        def check_load(self, checkpoint):
            raise CheckpointError(f"{checkpoint.path} is not for me.")

    strategy = Refusing()
    with pytest.raises(CheckpointError, match=r"ck is not for me\."):
        Checkpointer().load(_prepared(strategy, seed=1), folder, project=ProjectConfiguration(), verify_checksums=True)
    assert strategy.calls == []


def test_a_strategy_that_refuses_to_save_leaves_no_folder(tmp_path):
    class MidCycleRefusing(OwnFolders):
        def check_save(self, *, mid_cycle):
            raise CheckpointError("not now.")

    prepared = _prepared(MidCycleRefusing(), seed=0)
    with pytest.raises(CheckpointError, match="not now"):
        Checkpointer().save(prepared, tmp_path / "ck", project=ProjectConfiguration(), metadata=None)
    assert list(tmp_path.iterdir()) == []
