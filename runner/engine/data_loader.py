"""Accelerate's ``accelerate.data_loader`` names, so ``from accelerate.data_loader import X`` ports by renaming.

The loaders themselves live in :mod:`runner.engine.loaders`; this module gives them Accelerate's names
(``DataLoaderShard`` is the prepared loader each process reads, ``DataLoaderDispatcher`` the one rank 0
loads and sends) and :func:`prepare_data_loader` Accelerate's signature, for scripts that shard a loader
without an ``Accelerator``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from runner.engine.loaders.batch_shards import BatchSamplerShard
from runner.engine.loaders.dispatch import DispatchedDataLoader, IterableDatasetShard
from runner.engine.loaders.loader import DataLoaderConfiguration, PreparedDataLoader
from runner.engine.loaders.prepare import prepare_data_loader as _prepare
from runner.engine.loaders.sampling import SeedableRandomSampler
from runner.engine.ops import rank_zero_value
from runner.engine.optimizer import GradientAccumulationPlugin, GradientState
from runner.engine.rng import synchronize_rng_states

DataLoaderShard = PreparedDataLoader
DataLoaderDispatcher = DispatchedDataLoader

__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "prepare_data_loader",
    "skip_first_batches",
]


def prepare_data_loader(
    dataloader: DataLoader,
    device: torch.device | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: list[str] | None = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Any = None,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh: Any = None,
) -> PreparedDataLoader:
    """Shard ``dataloader`` across the processes of the current process group, as Accelerate's function does.

    ``accelerator.prepare`` does this for a loader; call it directly to shard one without an Accelerator.
    The number of processes and this one's index default to the process group's (one process without
    one). Batches move to ``device`` only with ``put_on_device``. ``rng_types`` are synchronised from
    rank 0 as each pass begins. The other settings are :class:`DataLoaderConfiguration`'s. The loader's
    padding is trimmed by ``gather_for_metrics`` of an Accelerator that prepared it; a loader prepared
    here reports its end and padding to its own gradient state.

    Raises:
        ValueError: ``slice_fn_for_dispatch`` or ``torch_device_mesh`` is given (this engine cuts
            dispatched batches itself, and takes the data-parallel layout from ``num_processes`` and
            ``process_index``), or a setting cannot shard the loader (the message says which).
    """
    if slice_fn_for_dispatch is not None:
        raise ValueError(
            "prepare_data_loader(slice_fn_for_dispatch=...) is not supported: dispatched batches are cut by rows "
            "of every tensor; leave it None."
        )
    if torch_device_mesh is not None:
        raise ValueError(
            "prepare_data_loader(torch_device_mesh=...) is not supported: pass num_processes and process_index of "
            "the data-parallel dimensions instead (or prepare the loader with an Accelerator and its "
            "parallelism_config)."
        )
    distributed = dist.is_available() and dist.is_initialized()
    if num_processes is None:
        num_processes = dist.get_world_size() if distributed else 1
    if process_index is None:
        process_index = dist.get_rank() if distributed else 0
    config = DataLoaderConfiguration(
        split_batches=split_batches,
        dispatch_batches=dispatch_batches,
        even_batches=even_batches,
        use_seedable_sampler=use_seedable_sampler,
        use_stateful_dataloader=use_stateful_dataloader,
        non_blocking=non_blocking,
        data_seed=data_seed,
    )
    synced = [kind for kind in rng_types or () if kind != "generator"]
    cpu = torch.device("cpu")
    return _prepare(
        dataloader,
        device=device if put_on_device else None,
        num_processes=num_processes,
        process_index=process_index,
        gradient_state=GradientState(GradientAccumulationPlugin()),
        config=config,
        broadcast_seed=rank_zero_value,  # the value itself on one process
        share=rank_zero_value,
        on_epoch_start=functools.partial(synchronize_rng_states, synced) if distributed and synced else None,
        comm_device=device if distributed and dist.get_backend() == "nccl" and device is not None else cpu,
    )


def skip_first_batches(dataloader: PreparedDataLoader, num_batches: int = 0) -> PreparedDataLoader:
    """Make the next pass of a prepared loader start after its first ``num_batches`` batches (they are never
    loaded); returns the loader, for ``for batch in skip_first_batches(loader, n)``.

    Raises:
        ValueError: ``dataloader`` was not prepared.
    """
    if not isinstance(dataloader, PreparedDataLoader):
        raise ValueError("skip_first_batches needs a prepared loader; pass it through prepare_data_loader first.")
    dataloader.skip_first_batches(num_batches)
    return dataloader
