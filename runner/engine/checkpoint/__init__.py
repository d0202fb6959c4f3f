"""The engine's checkpoint room: what a checkpoint folder holds, and how it is written, committed, found and read.

- :mod:`~runner.engine.checkpoint.errors`: :class:`CheckpointError`, in a module that imports nothing.
- :mod:`~runner.engine.checkpoint.checkpointer`: ``save_state``/``load_state`` for a set of prepared objects
  (the :class:`Checkpointer` the Accelerator holds), and the facts a manifest records to continue exactly.
- :mod:`~runner.engine.checkpoint.staging`: what each rank writes into a staging folder.
- :mod:`~runner.engine.checkpoint.folders`: naming, the commit (a rename), finding and rotating checkpoints.
- :mod:`~runner.engine.checkpoint.loading`: verifying and reading a checkpoint back.
- :mod:`~runner.engine.checkpoint.manifest`: the manifest (files, sizes, digests): written, read, its files checked.
- :mod:`~runner.engine.checkpoint.manifest_schema`: what each manifest field must be, and the manifest's own digest.
- :mod:`~runner.engine.checkpoint.serialization`: safetensors, and a model's weights folder (shards, an index).
- :mod:`~runner.engine.checkpoint.torch_files`: ``torch.save`` (without CRC32) and ``torch.load(weights_only=True)``.
- :mod:`~runner.engine.checkpoint.async_saves`: ``async_save``: host copies, written in the background.
- :mod:`~runner.engine.checkpoint.node_local`: ``save_on_each_node``, a copy on each node's own disk.
- :mod:`~runner.engine.checkpoint.sharded_state`: FSDP's sharded state through torch's DCP.
- :mod:`~runner.engine.checkpoint.model_weights`: a model's whole weights from any folder (export, from_run).
- :mod:`~runner.engine.checkpoint.merge`: ``merge_fsdp_weights``, a sharded FSDP folder as one weights file.
- :mod:`~runner.engine.checkpoint.verbs`: the Accelerator's checkpoint verbs (``save_state``, ``load_state``, ...).

It may import torch, safetensors, :mod:`runner.files`, and of the engine its constants, the collectives
(:mod:`runner.engine.ops`, :mod:`runner.engine.distributed`), RNG states, the prepared objects and the
strategies' shared base (:mod:`runner.engine.parallel.base`). The names below are importable from here
without loading the rest of the room.
"""

from runner.engine.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from runner.engine.checkpoint.folders import (
    ProjectConfiguration,
    checkpoint_number,
    checkpoints_dir,
    newest_intact_checkpoint,
    staging_dir,
)
from runner.engine.checkpoint.manifest import VerifiedCheckpoint, read_manifest

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "ProjectConfiguration",
    "checkpoint_number",
    "checkpoints_dir",
    "newest_intact_checkpoint",
    "read_manifest",
    "VerifiedCheckpoint",
    "staging_dir",
]
