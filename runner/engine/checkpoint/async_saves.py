"""``save_state(async_save="writes")`` (or ``True``): the state copied to host memory on the loop, everything else in
the background. :class:`AsyncSave` names the modes (``"commit"`` leaves only the commit to the background).

The save runs as a synchronous one does up to the writes: the target is chosen, the staging folder
made and the save hooks run, on every rank. Then, instead of writing, each rank hands what it would
write to a :class:`Snapshot`, which copies every tensor to host memory (pinned where CUDA is used,
so the copies from the GPU overlap) and every other value as a deep copy; the state is then free to
change, and ``save_state`` returns. Under sharded FSDP the shards go to
``torch.distributed.checkpoint.async_save`` instead, which stages them the same way.

A background thread on each rank then writes its files from the snapshot, hashes them, and meets
the others on a process group of its own (gloo, so the loop's collectives on the default group
never interleave with its): rank 0 writes the manifest, syncs the folder to disk and renames it
into place (then rotates ``total_limit``), and tells every rank the outcome. Until then the
checkpoint does not exist: a crash or a full disk leaves the previous checkpoints as they were, and
the failure is raised on every rank by the next ``save_state``, ``load_state``,
``wait_for_checkpoint`` or ``end_training``.
"""

from __future__ import annotations

import copy
import enum
import logging
import shutil
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runner.engine.checkpoint import manifest as manifests
from runner.engine.checkpoint.errors import CheckpointError
from runner.engine.checkpoint.folders import commit as commit_folder
from runner.engine.checkpoint.folders import failure_reason
from runner.engine.checkpoint.staging import StagingFolder, own_shards
from runner.files import sync_tree

logger = logging.getLogger("runner")


class AsyncSave(enum.StrEnum):
    """What ``save_state(async_save=...)`` leaves to the background; the folder appears only once complete either way.

    - ``none`` (or ``False``): nothing; ``save_state`` returns once the checkpoint is committed.
    - ``writes`` (or ``True``): the writes; ``save_state`` returns once the state is copied to host memory, and
      every rank writes and hashes its files, and rank 0 commits, in background threads (this module).
    - ``commit``: the commit; ``save_state`` returns once every rank's files are written and hashed, and rank 0
      writes the manifest and renames the folder into place in a background thread.
    """

    NONE = "none"
    WRITES = "writes"
    COMMIT = "commit"

    @classmethod
    def of(cls, value: AsyncSave | str | bool | None) -> AsyncSave:
        """The mode ``value`` names.

        Raises:
            ValueError: ``value`` names none.
        """
        if isinstance(value, bool) or value is None:
            return cls.WRITES if value else cls.NONE
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"save_state(async_save={value!r}) is not a mode; pass 'none', 'writes' (or True) or 'commit'."
            ) from None


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class HostCopier:
    """Copies of tensors in host memory (pinned when they come from CUDA), one per distinct tensor view, so
    tied weights stay tied; other values are deep-copied. :meth:`finish` waits for the copies from the GPU.

    ``kept`` holds the host buffers of the last save, by source view: a tensor that is still there (a parameter,
    an optimizer moment) is copied into its buffer again, one copy and no allocation (as DCP's cached stager
    does), and a tensor made anew for each save (an RNG state) into a free buffer of its shape and dtype;
    :meth:`finish` keeps this save's buffers there, and only those. The buffers are free to reuse once the save
    that filled them is written: every save waits for the one before it.
    """

    def __init__(self, kept: dict[tuple, torch.Tensor] | None = None) -> None:
        # Each copy beside its source: while the source lives, no tensor made later can take its address
        # (and so its key); a state_dict() that makes its tensors anew frees them once they are copied.
        self._copies: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._kept = {} if kept is None else kept
        self._taken: set[int] = set()  # the kept buffers this save has filled, by id
        self._gpus: set[torch.device] = set()

    def copy(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if type(value) in (dict, OrderedDict):
            return type(value)((key, self.copy(item)) for key, item in value.items())
        if type(value) in (list, tuple):
            return type(value)(self.copy(item) for item in value)
        if value is None or isinstance(value, bool | int | float | str | bytes | torch.dtype | torch.device):
            return value
        return copy.deepcopy(value)

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.device.type == "meta" or tensor.numel() == 0:
            return tensor.to("cpu") if tensor.device.type != "meta" else tensor
        key = (
            tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()),
            tensor.dtype, tensor.device,
        )  # fmt: skip
        if key not in self._copies:
            on_gpu = tensor.device.type == "cuda"
            host = self._buffer(key, tensor.shape, tensor.dtype, on_gpu)
            host.copy_(tensor, non_blocking=on_gpu)
            if on_gpu:
                self._gpus.add(tensor.device)
            self._copies[key] = (tensor, host)
        return self._copies[key][1]

    def _buffer(self, key: tuple, shape: torch.Size, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """A kept buffer for the source ``key`` (its own, else a free one that fits), or a new one."""
        host = self._kept.get(key)
        if host is None or id(host) in self._taken:
            free = (h for h in self._kept.values() if id(h) not in self._taken)
            host = next((h for h in free if h.shape == shape and h.dtype == dtype and h.is_pinned() == pinned), None)
        if host is None:
            host = torch.empty(shape, dtype=dtype, pin_memory=pinned)
        self._taken.add(id(host))
        return host

    def finish(self) -> None:
        for device in self._gpus:
            torch.cuda.synchronize(device)
        self._gpus.clear()
        self._kept.clear()
        self._kept.update((key, host) for key, (_, host) in self._copies.items())
        self._copies.clear()
        self._taken.clear()


@dataclass
class Snapshot:
    """A ``CheckpointWriter`` that keeps in host memory what the engine and the strategies would write into
    :attr:`path`, for :meth:`write` to write later; sharded state goes to DCP's ``async_save`` at once."""

    path: Path
    groups: Callable[[int], Any]  # the process group for the i-th DCP save (each has its own upload thread)
    copier: HostCopier = field(default_factory=HostCopier)
    stagers: Callable[[int, bool], Any] | None = None  # the i-th DCP save's stager, kept between saves
    pending: list[tuple[str, str, Any]] = field(default_factory=list)
    sharded: list[tuple[str, Future]] = field(default_factory=list)

    def save_tensors(self, tensors: Mapping[str, torch.Tensor], name: str) -> None:
        self.pending.append(("tensors", name, self.copier.copy(dict(tensors))))

    def save_object(self, obj: Any, name: str) -> None:
        self.pending.append(("object", name, self.copier.copy(obj)))

    def save_sharded(self, state: dict[str, Any], name: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # DCP's stager copies the shards to host memory (pinned under CUDA) before async_save returns; one kept
        # between saves copies into the host storages of the last (it caches them by source storage).
        on_gpu = any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in _leaves(state))
        index = len(self.sharded)
        if self.stagers is not None:
            stager = self.stagers(index, on_gpu)
        else:
            stager = DefaultStager(StagingOptions(on_gpu, False, False, False))
        group = self.groups(index) if _distributed() else None
        future = dcp.async_save(
            state, checkpoint_id=self.path / name, process_group=group, async_stager=stager, no_dist=group is None
        )
        if self.stagers is None:
            future.add_done_callback(lambda _: stager.close())
        self.sharded.append((name, future))

    def write(self, staging: StagingFolder) -> None:
        """Write every file of the snapshot into ``staging`` (this rank's share), and wait for the shards."""
        wait([future for _, future in self.sharded])  # all of them, even if one failed: none still writes after
        for name, future in self.sharded:
            future.result()
            staging.written.extend(own_shards(staging.path / name, staging.path))
        for kind, name, value in self.pending:
            if kind == "tensors":
                staging.save_tensors(value, name)
            else:
                staging.save_object(value, name)
        self.pending.clear()


def _leaves(value: Any):
    if isinstance(value, Mapping):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def write_in_background(
    snapshot: Snapshot,
    staging: StagingFolder,
    target: Path,
    *,
    rank: int,
    group: Any,
    record: dict[str, Any],
    after_commit: Callable[[], None] | None,
) -> str | None:
    """On each rank's background thread: write and hash this rank's files, then commit with the others.

    Returns:
        The first failure of any rank (the same sentence on every rank), or None once committed.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    failure, entries = None, {}
    try:
        snapshot.write(staging)
        entries = staging.entries(record["checksum"])
    except (OSError, CheckpointException) as error:  # a full disk, a lost mount, a failed DCP write
        failure = f"rank {rank}: {failure_reason(error)}"
    except Exception as error:  # every rank must still meet the others below
        failure = f"rank {rank}: {type(error).__name__}: {error}"
    failure, entries = _gathered(failure, entries, group)
    if failure is None and rank == 0:
        try:
            manifests.write_manifest(staging.path, **{**record, "entries": entries})
            sync_tree(staging.path)
            commit_folder(staging.path, target)
            if after_commit is not None:
                after_commit()
        except (OSError, CheckpointError) as error:
            failure = f"rank 0: {failure_reason(error)}"
        except Exception as error:  # every rank still learns it below
            failure = f"rank 0: {type(error).__name__}: {error}"
    failure = _broadcast(failure, group)
    if failure is None:
        return None
    if rank == 0:
        shutil.rmtree(staging.path, ignore_errors=True)  # free what the partial save took
    return (
        f"Saving {target.name} in the background failed ({failure}); the checkpoints saved before it are intact, so "
        "free the space (or fix the folder) and resume from the newest of them."
    )


def _gathered(failure: str | None, entries: dict, group: Any) -> tuple[str | None, dict]:
    if group is None:
        return failure, entries
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (failure, entries), group=group)
    first = next((failed for failed, _ in gathered if failed), None)
    return first, {name: entry for _, listed in gathered for name, entry in listed.items()}


def _broadcast(failure: str | None, group: Any) -> str | None:
    if group is None:
        return failure
    import torch.distributed as dist

    shared = [failure]
    dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
    return shared[0]


class BackgroundSaves:
    """One rank's background saves: its thread, and the gloo process groups they meet on (made on first use,
    on every rank alike, since every rank saves)."""

    def __init__(self) -> None:
        self._thread: ThreadPoolExecutor | None = None
        self._groups: list[Any] = []
        self.kept: dict[tuple, torch.Tensor] = {}  # the last save's host copies (HostCopier), reused by the next
        self._stagers: dict[int, Any] = {}  # the DCP saves' stagers, by folder, with their cached host storages
        self._reported = 0

    def snapshot(self, path: Path, prepared: Any) -> Snapshot:
        """The writer of a save of ``prepared`` into ``path``, copying into the buffers of the last save."""
        return Snapshot(path, groups=self.groups(prepared), copier=HostCopier(self.kept), stagers=self._stager)

    def _stager(self, index: int, on_gpu: bool) -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if index not in self._stagers:
            self._stagers[index] = DefaultStager(StagingOptions(on_gpu, False, False, False))
        return self._stagers[index]

    def kept_bytes(self) -> int:
        """Host memory the copies of the last save hold (DCP's staged shards not counted: DCP keeps them)."""
        return sum(tensor.numel() * tensor.element_size() for tensor in self.kept.values())

    def report(self) -> None:
        """Say how much host memory the copies keep between saves, when it changes."""
        kept = self.kept_bytes()
        if kept != self._reported:
            self._reported = kept
            logger.info(
                "Asynchronous saves keep %.1f MB of host memory for their copies of the state between saves (one "
                "copy per save, no allocation); end_training() frees it.",
                kept / 1e6,
            )

    def release(self) -> None:
        """Free the kept host copies and the DCP stagers' (the next save allocates anew)."""
        self.kept.clear()
        for stager in self._stagers.values():
            stager.close()
        self._stagers.clear()
        self._reported = 0

    def group(self, index: int) -> Any:
        """The ``index``-th process group of the background saves (0: the commit's; 1, 2, ...: DCP's)."""
        if not _distributed():
            return None
        import torch.distributed as dist

        while len(self._groups) <= index:
            self._groups.append(dist.new_group(backend="gloo"))
        return self._groups[index]

    def groups(self, prepared: Any) -> Callable[[int], Any]:
        """Make, now and on every rank alike, the groups a save of ``prepared`` uses (the commit's, and one per
        DCP folder under sharded FSDP); returns the i-th DCP folder's group by ``i``."""
        folders = len(prepared.models) + len(prepared.optimizers) if prepared.strategy.checkpoint_format == "dcp" else 0
        for index in range(folders + 1):
            self.group(index)
        return lambda index: self._groups[index + 1] if _distributed() else None

    def submit(self, job: Callable[[], str | None]) -> Future:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-save")
        return self._thread.submit(job)


__all__ = ["BackgroundSaves", "HostCopier", "Snapshot", "write_in_background"]
