import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from runner.engine import (
    AcceleratedOptimizer,
    AcceleratedScheduler,
    Accelerator,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    ProjectConfiguration,
)
from runner.engine.loaders import PreparedDataLoader
from tests.helpers import loader, regression_data, small_model, train


def test_single_process_attributes():
    accelerator = Accelerator(project_dir="somewhere")
    assert accelerator.device == torch.device("cpu")
    assert (accelerator.process_index, accelerator.local_process_index, accelerator.num_processes) == (0, 0, 1)
    assert accelerator.is_main_process and accelerator.is_local_main_process
    assert accelerator.distributed_type.value == "NO"
    assert accelerator.mixed_precision == "no"
    assert accelerator.sync_gradients and accelerator.gradient_accumulation_steps == 1
    assert accelerator.project_dir == "somewhere" and accelerator.logging_dir == "somewhere"


def test_two_accelerators_with_different_settings_coexist(tmp_path):
    first = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=4)
    second = Accelerator(mixed_precision="fp16", project_config=ProjectConfiguration(str(tmp_path)))
    assert (first.mixed_precision, first.gradient_accumulation_steps, first.scaler) == ("bf16", 4, None)
    assert (second.mixed_precision, second.gradient_accumulation_steps) == ("fp16", 1)
    assert second.scaler is not None and second.project_dir == str(tmp_path)
    model = first.prepare(nn.Linear(2, 2))
    assert first._models == [model] and second._models == []


def test_prepare_returns_objects_in_the_order_given():
    accelerator = Accelerator()
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    data = loader(regression_data(), 4)
    other = {"not": "prepared"}
    prepared = accelerator.prepare(scheduler, data, other, optimizer, model)
    assert isinstance(prepared[0], AcceleratedScheduler) and prepared[0].optimizers == [prepared[3]]
    assert isinstance(prepared[1], PreparedDataLoader)
    assert prepared[2] is other
    assert isinstance(prepared[3], AcceleratedOptimizer) and prepared[3].optimizer is optimizer
    assert prepared[4] is model
    assert accelerator.prepare(model) is model  # a single object comes back alone, not in a tuple


def test_unwrap_model_returns_the_original_class_and_can_drop_autocast():
    accelerator = Accelerator(mixed_precision="bf16")
    model = small_model()
    prepared = accelerator.prepare(model)
    assert type(accelerator.unwrap_model(prepared)) is nn.Sequential
    assert accelerator.unwrap_model(prepared)(torch.randn(2, 8)).dtype == torch.float32  # fp32 outputs
    plain = accelerator.unwrap_model(prepared, keep_fp32_wrapper=False)
    assert "forward" not in plain.__dict__


def _raw_loop(epochs: int, batches) -> dict[str, torch.Tensor]:
    """The training of tests.helpers.train written by hand, over the ``(x, y)`` batches ``batches(epoch)`` yields."""
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(epochs):
        for x, y in batches(epoch):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return model.state_dict()


def test_single_process_training_equals_a_raw_pytorch_loop_over_the_same_unprepared_loader():
    engine_weights = train(Accelerator(), batch_size=8, epochs=3)

    # The same loop by hand, over the same DataLoader unprepared: the prepared one yields its batches.
    plain = loader(regression_data(), 8)
    for key, value in _raw_loop(3, lambda epoch: plain).items():
        assert torch.equal(value, engine_weights[key]), key


def test_with_the_seedable_sampler_training_equals_a_raw_loop_over_randperm_of_seed_plus_epoch():
    config = DataLoaderConfiguration(use_seedable_sampler=True)
    engine_weights = train(Accelerator(dataloader_config=config), batch_size=8, epochs=3)

    # The seedable sampler shuffles with randperm(seed + epoch) of torch's seed as prepare() runs (small_model's
    # manual_seed(0)), as Accelerate's does, not of the seed of the loader's generator (1234).
    dataset = regression_data()

    def batches(epoch):
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0 + epoch)).tolist()
        return (dataset[order[start : start + 8]] for start in range(0, len(order), 8))

    for key, value in _raw_loop(3, batches).items():
        assert torch.equal(value, engine_weights[key]), key


def test_kwargs_handlers_are_validated():
    with pytest.raises(ValueError, match="kwargs_handlers got dict"):
        Accelerator(kwargs_handlers=[{}])
    with pytest.raises(ValueError, match="two GradScalerKwargs"):
        Accelerator(kwargs_handlers=[GradScalerKwargs(), GradScalerKwargs()])
    scaled = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    assert scaled.scaler.get_scale() == 1024.0
    assert DistributedDataParallelKwargs(find_unused_parameters=True).to_kwargs() == {"find_unused_parameters": True}


def test_print_only_on_the_main_process(capsys):
    Accelerator().print("hello", 3)
    assert capsys.readouterr().out == "hello 3\n"


def test_deepcopy_of_a_prepared_model_runs_its_own_weights():
    accelerator = Accelerator(mixed_precision="bf16")
    model = accelerator.prepare(small_model())
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    x = torch.randn(3, 8)
    assert torch.equal(twin(x), torch.zeros(3, 1))  # the copy's forward uses the copy, not the original
    assert not torch.equal(model(x), torch.zeros(3, 1))


def test_prepared_loader_batches_and_lengths():
    accelerator = Accelerator()
    data = accelerator.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=4))
    assert len(data) == 3 and data.total_batch_size == 4
    assert [b[0].tolist() for b in data] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_split_between_processes_gives_contiguous_shares():
    from runner.engine.ops import split_between_processes

    def shares(inputs, world, **kwargs):
        return [split_between_processes(inputs, num_processes=world, process_index=r, **kwargs) for r in range(world)]

    assert shares(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert shares(list(range(7)), 3, apply_padding=True) == [[0, 1, 2], [3, 4, 4], [5, 6, 6]]
    assert shares(["a"], 2, apply_padding=True) == [["a"], ["a"]]
    tensors = shares(torch.arange(5), 2, apply_padding=True)
    assert [t.tolist() for t in tensors] == [[0, 1, 2], [3, 4, 4]]
    assert shares({"x": [1, 2, 3], "y": "abc"}, 2) == [{"x": [1, 2], "y": "ab"}, {"x": [3], "y": "c"}]
    with pytest.raises(ValueError, match="the values of a dict to have the same length"):
        shares({"x": [1], "y": [1, 2]}, 2)
    accelerator = Accelerator()
    with accelerator.split_between_processes([1, 2, 3]) as mine:
        assert mine == [1, 2, 3]  # one process gets everything


def test_process_decorators_and_atomic_save(tmp_path):
    accelerator = Accelerator()
    calls = []

    @accelerator.on_main_process
    def main_only(value):
        calls.append(("main", value))
        return value

    @accelerator.on_process(process_index=1)
    def second_only():
        calls.append("second")

    assert main_only(3) == 3 and second_only() is None
    assert accelerator.on_local_process(lambda: "local", local_process_index=0)() == "local"
    assert accelerator.on_local_main_process(lambda: "node")() == "node"
    assert calls == [("main", 3)]

    accelerator.save({"step": 3}, tmp_path / "state.pt")
    assert torch.load(tmp_path / "state.pt", weights_only=True) == {"step": 3}
    accelerator.save({"w": torch.ones(2)}, tmp_path / "w.safetensors", safe_serialization=True)
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "w.safetensors")["w"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.pt", "w.safetensors"]  # no temporary file left


def test_fsdp_on_one_process_names_a_missing_shard_unit_and_otherwise_leaves_the_model_whole():
    from runner.engine import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"])
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    with pytest.raises(
        ValueError, match=r"No module of class Block in the model to shard \(its classes: Linear, ReLU, "
    ):
        Accelerator(fsdp_plugin=plugin).prepare(model)
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Linear"]))
    assert accelerator.prepare(model) is model and accelerator.distributed_type.value == "FSDP"
    with pytest.raises(ValueError, match="state_dict_type='LOCAL' is not supported"):
        FullyShardedDataParallelPlugin(state_dict_type="LOCAL")


def test_split_between_processes_gives_a_datasets_table_its_rows_as_a_table():
    datasets = pytest.importorskip("datasets", reason="the hf extra (datasets) is not installed")
    from runner.engine.ops import split_between_processes

    table = datasets.Dataset.from_dict({"id": list(range(7)), "text": list("abcdefg")})
    shares = [split_between_processes(table, num_processes=3, process_index=r, apply_padding=True) for r in range(3)]
    assert all(isinstance(share, datasets.Dataset) for share in shares)
    assert [share["id"] for share in shares] == [[0, 1, 2], [3, 4, 4], [5, 6, 6]]
    assert shares[1]["text"] == ["d", "e", "e"]
    one = split_between_processes(datasets.Dataset.from_dict({"id": [9]}), num_processes=2, process_index=1,
                                  apply_padding=True)  # fmt: skip
    assert one["id"] == [9]  # an empty share repeats the table's last row


def test_check_trigger_answers_once_per_set_trigger_on_one_process():
    accelerator = Accelerator()
    assert accelerator.check_trigger() is False
    accelerator.set_trigger()
    assert accelerator.check_trigger() is True
    assert accelerator.check_trigger() is False  # reset by the check that saw it


def test_join_uneven_inputs_warns_and_does_nothing_on_one_process():
    accelerator = Accelerator()
    model = accelerator.prepare(nn.Linear(2, 1))
    with pytest.warns(UserWarning, match="does nothing on a single process"):
        with accelerator.join_uneven_inputs([model], even_batches=False):
            accelerator.backward(model(torch.ones(1, 2)).sum())
    assert torch.equal(model.weight.grad, torch.ones(1, 2))


def test_trigger_sync_in_backward_leaves_a_model_without_ddp_alone():
    model = nn.Linear(2, 1)
    with Accelerator.trigger_sync_in_backward(model):
        model(torch.ones(1, 2)).sum().backward()
    assert torch.equal(model.weight.grad, torch.ones(1, 2))


def test_distributed_type_has_accelerates_members_and_selects_only_its_own():
    from runner.engine import DistributedType

    accelerate_members = "NO MULTI_CPU MULTI_GPU MULTI_NPU MULTI_MLU MULTI_SDAA MULTI_MUSA MULTI_XPU DEEPSPEED FSDP XLA"
    for name in [*accelerate_members.split(), "MEGATRON_LM", "MULTI_HPU", "MULTI_NEURON"]:
        assert DistributedType[name].value == name and DistributedType[name] == name
    assert Accelerator().distributed_type is DistributedType.NO
