"""The engine's public names: what a script written for Accelerate imports and calls, kept whatever moves inside."""

import importlib
import inspect

import runner.engine
import runner.engine.data_loader
import runner.engine.tracking
import runner.engine.utils
from runner.engine import Accelerator

ENGINE = [
    "AcceleratedOptimizer",
    "AcceleratedScheduler",
    "Accelerator",
    "AsyncSave",
    "AutocastKwargs",
    "CheckpointError",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedOperationException",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GeneralTracker",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "ParallelismConfig",
    "PartialState",
    "ProjectConfiguration",
    "debug_launcher",
    "find_executable_batch_size",
    "load_checkpoint_in_model",
    "notebook_launcher",
    "register_tracker_class",
    "set_seed",
]
UTILS = [
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedOperationException",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "PrecisionType",
    "ProfileKwargs",
    "ProjectConfiguration",
    "broadcast",
    "broadcast_object_list",
    "copy_tensor_to_devices",
    "debug_launcher",
    "find_executable_batch_size",
    "gather",
    "gather_object",
    "get_torch_accelerator_backend",
    "is_bf16_available",
    "is_cuda_available",
    "is_datasets_available",
    "is_deepspeed_available",
    "is_fp16_available",
    "is_hpu_available",
    "is_mlflow_available",
    "is_mps_available",
    "is_npu_available",
    "is_pytest_available",
    "is_schedulefree_available",
    "is_tensorboard_available",
    "is_torch_xla_available",
    "is_torchvision_available",
    "is_transformers_available",
    "is_wandb_available",
    "is_xpu_available",
    "load_checkpoint_in_model",
    "merge_fsdp_weights",
    "notebook_launcher",
    "pad_across_processes",
    "parse_flag_from_env",
    "patch_environment",
    "reduce",
    "release_memory",
    "send_to_device",
    "set_seed",
    "should_reduce_batch_size",
    "str_to_bool",
    "synchronize_rng_states",
]
TRACKING = [  # accelerate.tracking's counterpart
    "CSVTracker",
    "GeneralTracker",
    "JSONLTracker",
    "MLflowTracker",
    "TRACKERS",
    "TensorBoardTracker",
    "WandBTracker",
    "build_trackers",
    "flatten",
    "register_tracker_class",
]
DATA_LOADER = [  # accelerate.data_loader's counterpart
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "prepare_data_loader",
    "skip_first_batches",
]
# Where porting users import from, by module: each name must stay importable there.
IMPORTED_FROM = {
    "runner.engine.data": ["DataLoaderConfiguration", "SeedableRandomSampler", "prepare_data_loader"],  # old home
    "runner.engine.loaders": ["DataLoaderConfiguration", "SeedableRandomSampler", "prepare_data_loader"],
    "runner.engine.dispatch": ["DispatchedDataLoader", "IterableDatasetShard"],
    "runner.engine.local_sgd": ["LocalSGD"],
    "runner.engine.state": ["AcceleratorState", "GradientState", "PartialState"],
}
# accelerate.data_loader.prepare_data_loader's parameters, in order: positional calls port unchanged.
PREPARE_DATA_LOADER = [
    "dataloader",
    "device",
    "num_processes",
    "process_index",
    "split_batches",
    "put_on_device",
    "rng_types",
    "dispatch_batches",
    "even_batches",
    "slice_fn_for_dispatch",
    "use_seedable_sampler",
    "data_seed",
    "non_blocking",
    "use_stateful_dataloader",
    "torch_device_mesh",
]
ACCELERATOR = [
    "accumulate",
    "autocast",
    "backward",
    "check_trigger",
    "clear",
    "clip_grad_norm_",
    "clip_grad_value_",
    "device",
    "distributed_type",
    "end_training",
    "forward_backward",
    "free_memory",
    "gather",
    "gather_for_metrics",
    "get_state_dict",
    "get_tracker",
    "gradient_accumulation_steps",
    "init_trackers",
    "is_last_process",
    "is_local_main_process",
    "is_main_process",
    "join_uneven_inputs",
    "load_state",
    "local_main_process_first",
    "local_process_index",
    "log",
    "log_artifact",
    "logging_dir",
    "main_process_first",
    "mark_verified",
    "mixed_precision",
    "no_sync",
    "num_processes",
    "on_last_process",
    "on_local_main_process",
    "on_local_process",
    "on_main_process",
    "on_process",
    "optimizer_step_was_skipped",
    "pad_across_processes",
    "prepare",
    "prepare_data_loader",
    "prepare_model",
    "prepare_optimizer",
    "prepare_scheduler",
    "print",
    "process_index",
    "profile",
    "project_dir",
    "reduce",
    "register_for_checkpointing",
    "register_load_state_pre_hook",
    "register_save_state_commit_hook",
    "register_save_state_pre_hook",
    "save",
    "save_iteration",
    "save_model",
    "save_state",
    "set_trigger",
    "skip_first_batches",
    "split_batches",
    "split_between_processes",
    "sync_gradients",
    "torch_device_mesh",
    "trackers",
    "trigger_sync_in_backward",
    "unscale_gradients",
    "unwrap_model",
    "use_distributed",
    "wait_for_checkpoint",
    "wait_for_everyone",
]


def test_the_engine_and_its_utils_export_the_same_names_and_each_resolves():
    assert sorted(runner.engine.__all__) == ENGINE
    assert sorted(runner.engine.utils.__all__) == UTILS
    assert all(getattr(runner.engine, name) is not None for name in ENGINE)
    assert all(getattr(runner.engine.utils, name) is not None for name in UTILS)
    assert sorted(runner.engine.tracking.__all__) == TRACKING
    assert all(getattr(runner.engine.tracking, name) is not None for name in TRACKING)


def test_accelerates_data_loader_names_and_their_old_homes_resolve():
    assert sorted(runner.engine.data_loader.__all__) == DATA_LOADER
    assert all(getattr(runner.engine.data_loader, name) is not None for name in DATA_LOADER)
    for module, names in IMPORTED_FROM.items():
        assert all(getattr(importlib.import_module(module), name) is not None for name in names), module
    parameters = inspect.signature(runner.engine.data_loader.prepare_data_loader).parameters
    assert list(parameters) == PREPARE_DATA_LOADER
    assert all(parameter.kind is parameter.POSITIONAL_OR_KEYWORD for parameter in parameters.values())


def test_the_accelerator_keeps_every_public_verb_and_property():
    assert sorted(name for name in dir(Accelerator) if not name.startswith("_")) == ACCELERATOR
