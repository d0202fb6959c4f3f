"""FSDP2 (parallel strategy fsdp) on 2 gloo processes: training, clipping, checkpoints that reshard."""

import torch
from safetensors.torch import load_file

from runner.engine import Accelerator, FullyShardedDataParallelPlugin
from runner.engine.checkpoint.sharded_state import gather_full
from runner.engine.utils import merge_fsdp_weights
from tests.helpers import assert_same_optimizer_state, assert_state_close, resumable_run, small_model, train


def _plugin(**options):
    return FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Linear"], **options)


def _fsdp_and_ddp():
    fsdp = Accelerator(fsdp_plugin=_plugin())
    sharded = train(fsdp, batch_size=4, epochs=2, scheduler=True)
    ddp = Accelerator()
    replicated = train(ddp, batch_size=4, epochs=2, scheduler=True)

    # The gradient norm clip_grad_norm_ sees: FSDP's is across all shards, DDP's over whole gradients.
    norms = []
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(fsdp.process_index))
    for accelerator in (Accelerator(fsdp_plugin=_plugin()), Accelerator()):
        model = accelerator.prepare(small_model())
        accelerator.backward(model(x).pow(2).sum())
        norms.append(accelerator.clip_grad_norm_(model.parameters(), max_norm=0.1))
    kinds = [type(m).__name__ for m in fsdp._models[0].modules()][:2]
    return {"fsdp": sharded, "ddp": replicated, "norms": norms, "kinds": kinds, "type": fsdp.distributed_type.value}


def test_fsdp_trains_like_ddp_and_clips_by_the_norm_across_shards(launch):
    main, other = launch(_fsdp_and_ddp)
    # Same samples, same math; FSDP reduce-scatters where DDP all-reduces, so the float32 sums run in
    # another order: equal to rounding (1e-6 relative per step), over 32 steps with momentum.
    assert_state_close(main["fsdp"], main["ddp"], atol=1e-5)
    assert other["fsdp"] == {}  # the full state dict is gathered to the main process only
    for result in (main, other):
        assert result["type"] == "FSDP" and result["kinds"][0].startswith("FSDP")
        fsdp_norm, ddp_norm = result["norms"]
        assert type(fsdp_norm) is torch.Tensor and torch.allclose(fsdp_norm, ddp_norm, rtol=1e-6)


def _train_and_save(directory, model_dir, state_dict_type):
    accelerator = Accelerator(fsdp_plugin=_plugin(state_dict_type=state_dict_type))
    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(accelerator.process_index))
    accelerator.backward(model(x).pow(2).sum())
    optimizer.step()
    accelerator.save_state(directory)
    accelerator.save_model(model, model_dir)
    refusal = None
    if state_dict_type == "SHARDED_STATE_DICT":  # the main process merges; every process learns its verdict
        merge_fsdp_weights(f"{directory}/model", f"{directory}_merged")
        try:
            merge_fsdp_weights(directory, f"{directory}_merged")  # the checkpoint, not its model folder
        except ValueError as error:
            refusal = str(error)
    return accelerator.get_state_dict(model), gather_full([model], [optimizer])[1][0], refusal


def _load(directory):
    accelerator = Accelerator(fsdp_plugin=_plugin())
    model = small_model(seed=1)  # other initial weights: the checkpoint must overwrite them
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.load_state(directory)
    return accelerator.get_state_dict(model), gather_full([accelerator.unwrap_model(model)], [optimizer])[1][0]


def test_sharded_checkpoints_reshard_from_two_processes_to_one_and_back(launch, tmp_path):
    saved, saved_by_other = launch(
        _train_and_save, str(tmp_path / "two"), str(tmp_path / "model"), "SHARDED_STATE_DICT"
    )
    files = {p.relative_to(tmp_path / "two").as_posix() for p in (tmp_path / "two").rglob("*") if p.is_file()}
    assert {"model/__0_0.distcp", "model/__1_0.distcp", "model/.metadata", "optimizer/.metadata"} <= files
    on_one = launch(_load, str(tmp_path / "two"), nproc=1)[0]
    assert on_one[0].keys() == saved[0].keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert all(torch.equal(on_one[0][k], saved[0][k]) for k in saved[0])
    assert_same_optimizer_state(on_one[1], saved[1])

    # save_model writes a normal full state dict that a plain model loads.
    plain = small_model(seed=2)
    plain.load_state_dict(load_file(tmp_path / "model" / "model.safetensors"))
    assert all(torch.equal(plain.state_dict()[k], saved[0][k]) for k in saved[0])

    # merge_fsdp_weights consolidates the model's shards into the full state dict; a wrong folder is refused on
    # every process with the same sentence.
    merged = load_file(tmp_path / "two_merged" / "model.safetensors")
    assert merged.keys() == saved[0].keys() and all(torch.equal(merged[k], saved[0][k]) for k in saved[0])
    assert saved[2] == saved_by_other[2] and saved[2].startswith(f"{tmp_path / 'two'} is not a torch.distributed")
    assert saved[2].endswith(f"pass {tmp_path / 'two' / 'model'} instead.")

    # The reverse: saved by one process, loaded (sharded) by two.
    alone = launch(_train_and_save, str(tmp_path / "one"), str(tmp_path / "model_1"), "SHARDED_STATE_DICT", nproc=1)[0]
    reference = load_file(tmp_path / "model_1" / "model.safetensors")
    assert torch.equal(load_file(tmp_path / "one_merged" / "model.safetensors")["2.weight"], reference["2.weight"])
    weights, optimizer = launch(_load, str(tmp_path / "one"))[0]
    assert weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k]) for k in reference)
    assert_same_optimizer_state(optimizer, alone[1])


def test_a_full_state_dict_checkpoint_loads_under_fsdp(launch, tmp_path):
    saved = launch(_train_and_save, str(tmp_path / "full"), str(tmp_path / "model"), "FULL_STATE_DICT")[0]
    files = {p.name for p in (tmp_path / "full").iterdir()}
    assert {"model.safetensors", "optimizer.bin"} <= files and "model" not in files
    weights, optimizer = launch(_load, str(tmp_path / "full"))[0]
    assert weights.keys() == saved[0].keys() and all(torch.equal(weights[k], saved[0][k]) for k in saved[0])
    assert_same_optimizer_state(optimizer, saved[1])


def _resumable(project_dir, options):
    return resumable_run(project_dir, fsdp=True, **options)


def test_fsdp_interrupted_and_resumed_equals_uninterrupted(launch, tmp_path):
    full = launch(_resumable, str(tmp_path / "full"), {})
    launch(_resumable, str(tmp_path / "cut"), {"stop_after": 11})  # mid-epoch (8 micro-steps an epoch)
    rest = launch(_resumable, str(tmp_path / "cut"), {"resume": True})
    for rank in (0, 1):
        assert full[rank]["losses"][11:] == rest[rank]["losses"]
    assert full[0]["weights"].keys() == rest[0]["weights"].keys() == {"0.weight", "0.bias", "3.weight", "3.bias"}
    for key, value in full[0]["weights"].items():  # gathered on the main process
        assert torch.equal(value, rest[0]["weights"][key]), key
    assert_same_optimizer_state(full[0]["optimizer"], rest[0]["optimizer"])
    manifest = (tmp_path / "cut" / "checkpoints" / "checkpoint_0" / "manifest.json").read_text()
    assert '"model/__1_0.distcp"' in manifest and '"optimizer/.metadata"' in manifest


def _options_and_accumulation():
    accumulated = train(
        Accelerator(gradient_accumulation_steps=2, fsdp_plugin=_plugin()), batch_size=2, epochs=2, scheduler=True
    )
    larger_batch = train(Accelerator(), batch_size=4, epochs=2, scheduler=True)

    plugin = _plugin(activation_checkpointing=True, cpu_offload=True, reshard_after_forward=False)
    accelerator = Accelerator(mixed_precision="bf16", fsdp_plugin=plugin)
    weights = train(accelerator, batch_size=4, epochs=1)
    unit = accelerator._models[0][0]

    # Evaluation through the sharded model: one prediction per sample of an odd-sized set.
    model = accelerator._models[0]
    data = torch.utils.data.TensorDataset(torch.randn(37, 8, generator=torch.Generator().manual_seed(3)))
    predictions = []
    with torch.no_grad():
        for (x,) in accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=4)):
            predictions.append(accelerator.gather_for_metrics(model(x)))

    fp16 = Accelerator(mixed_precision="fp16", fsdp_plugin=_plugin())
    fp16_weights = train(fp16, batch_size=4, epochs=2)
    return {
        "predictions": torch.cat(predictions).shape,
        "fp16": (fp16_weights, fp16.scaler.get_scale()),
        "accumulated": accumulated,
        "larger_batch": larger_batch,
        "weights": weights,
        "checkpointed": type(unit).__name__,
        "offloaded": accelerator._models[0][0]._checkpoint_wrapped_module.weight.device.type,
    }


def test_accumulation_and_the_options_under_fsdp(launch):
    main, _ = launch(_options_and_accumulation)
    # 2 processes x batch 2 x 2 micro-steps under FSDP (no_sync in between) == 2 x batch 4 with DDP.
    assert_state_close(main["accumulated"], main["larger_batch"], atol=1e-5)
    assert main["checkpointed"].startswith("FSDP") and "CheckpointWrapper" in main["checkpointed"]
    assert main["offloaded"] == "cpu"
    assert main["predictions"] == (37, 1)
    fp16_weights, scale = main["fp16"]
    assert scale < 2.0**16 and all(torch.isfinite(v).all() for v in fp16_weights.values())  # scaled, steps skipped
    # Activation checkpointing's wrapper never shows in the saved names: they load into a plain model.
    plain = small_model()
    plain.load_state_dict(main["weights"])
    assert all(torch.isfinite(value).all() for value in main["weights"].values())
