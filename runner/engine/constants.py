"""File and folder names of checkpoints and saved models, defined once."""

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
SAFE_WEIGHTS_SHARD_PATTERN = "model-{index:05d}-of-{total:05d}.safetensors"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
WEIGHTS_SHARD_PATTERN = "pytorch_model-{index:05d}-of-{total:05d}.bin"

# Inside a save_state folder: model.safetensors, model_1.safetensors, optimizer.bin, optimizer_1.bin, ...
MODEL_NAME = "model"
OPTIMIZER_NAME = "optimizer"
SCHEDULER_NAME = "scheduler"
SCALER_NAME = "scaler.pt"
RNG_STATE_NAME = "random_states"
GRADIENTS_NAME = "gradients"  # gradients_{rank}.safetensors, only mid accumulation cycle
CUSTOM_STATE_NAME = "custom_checkpoint"
MANIFEST_NAME = "manifest.json"
DCP_METADATA_NAME = ".metadata"  # in each DCP folder (model/, optimizer/, ...) of a sharded checkpoint

CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_PREFIX = "checkpoint_"
INCOMPLETE_SUFFIX = ".incomplete"

# Defaults an Accelerator() reads from its environment (set by notebook_launcher / debug_launcher).
MIXED_PRECISION_ENV = "RUNNER_MIXED_PRECISION"
USE_CPU_ENV = "RUNNER_USE_CPU"
# Debug mode (runner.engine.ops checks shapes before each collective): ours, and the name Accelerate reads.
DEBUG_MODE_ENV = "RUNNER_DEBUG_MODE"
ACCELERATE_DEBUG_MODE_ENV = "ACCELERATE_DEBUG_MODE"


def indexed_name(stem: str, index: int, suffix: str) -> str:
    """``model.safetensors``, ``model_1.safetensors``, ...: the first object has no index."""
    return f"{stem}{suffix}" if index == 0 else f"{stem}_{index}{suffix}"


def rng_state_name(rank: int) -> str:
    return f"{RNG_STATE_NAME}_{rank}.pt"


def gradients_name(rank: int) -> str:
    return f"{GRADIENTS_NAME}_{rank}.safetensors"


def custom_state_name(index: int) -> str:
    return f"{CUSTOM_STATE_NAME}_{index}.pt"
