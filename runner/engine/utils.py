"""Accelerate's ``accelerate.utils`` names, so ``from accelerate.utils import X`` ports by renaming."""

from runner.engine.checkpoint import ProjectConfiguration
from runner.engine.checkpoint.merge import merge_fsdp_weights
from runner.engine.checkpoint.serialization import load_checkpoint_in_model
from runner.engine.distributed import DistributedType, InitProcessGroupKwargs
from runner.engine.environment import parse_flag_from_env, patch_environment, str_to_bool
from runner.engine.imports import (
    get_torch_accelerator_backend,
    is_bf16_available,
    is_cuda_available,
    is_datasets_available,
    is_deepspeed_available,
    is_fp16_available,
    is_hpu_available,
    is_mlflow_available,
    is_mps_available,
    is_npu_available,
    is_pytest_available,
    is_schedulefree_available,
    is_tensorboard_available,
    is_torch_xla_available,
    is_torchvision_available,
    is_transformers_available,
    is_wandb_available,
    is_xpu_available,
)
from runner.engine.launchers import debug_launcher, notebook_launcher
from runner.engine.loaders import DataLoaderConfiguration
from runner.engine.memory import find_executable_batch_size, release_memory, should_reduce_batch_size
from runner.engine.ops import (
    DistributedOperationException,
    broadcast,
    broadcast_object_list,
    copy_tensor_to_devices,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    send_to_device,
)
from runner.engine.optimizer import GradientAccumulationPlugin
from runner.engine.parallel import (
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
)
from runner.engine.precision import AutocastKwargs, GradScalerKwargs, PrecisionType
from runner.engine.profiling import ProfileKwargs
from runner.engine.rng import set_seed, synchronize_rng_states

__all__ = [
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
