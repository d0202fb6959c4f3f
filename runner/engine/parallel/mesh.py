"""The device mesh of an N-D parallel run: pipeline stages x data-parallel replication x data-parallel sharding x
tensor parallelism.

:class:`ParallelismConfig` keeps Hugging Face Accelerate's field names and meaning (``dp_replicate_size``,
``dp_shard_size``, ``tp_size``, ``cp_size``; torchtitan's ``ParallelDims`` is the same idea), with pipeline
parallelism added as torchtitan has it (``pp_size``, outermost). Ranks are laid out row-major over
``(pp, dp_replicate, dp_shard, tp)``, so the processes of one tensor-parallel group are neighbours (on one
host, where their frequent collectives are cheapest) and see the same batch, and the stages of a pipeline
are the farthest apart (they only pass activations to their neighbour). The processes of one pipeline
(its stages) read the same batches too.

The mesh always has the three dimensions after ``pp`` (``pp`` itself when there are several stages), size-1
ones included, so every submesh can be asked for
whatever is switched on: ``mesh["tp"]`` for ``parallelize_module``, ``mesh[config.fsdp_dim_names]``
for ``fully_shard`` (``("dp_shard",)``, or ``("dp_replicate", "dp_shard")`` for HSDP), and
:func:`data_parallel_mesh`, the two data-parallel dimensions flattened into ``"dp"``, for loading data
and averaging metrics. (torch deprecates ``mesh["dp"]``, slicing a flattened dimension from the root.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "tp")
PIPELINE_DIM_NAME = "pp"  # the outermost dimension, when pp_size > 1
CONTEXT_DIM_NAME = "cp"  # between dp_shard and tp, when cp_size > 1
SHARD_AND_CONTEXT_DIM_NAME = "dp_shard_cp"  # flattened: FSDP shards over both, and averages gradients over both
DATA_PARALLEL_DIM_NAME = "dp"  # the flattened (dp_replicate, dp_shard) submesh
SHARD_AND_TP_DIM_NAME = "dp_shard_tp"  # flattened so that reducing over both (a gradient norm) is one all-reduce
REST_OF_THE_WORLD = "auto"  # dp_shard_size: the processes the other dimensions leave

_CONFIG_KEYS = {
    "dp_replicate_size": "parallel.dp_replicate",
    "dp_shard_size": "parallel.dp_shard",
    "tp_size": "parallel.tp",
    "cp_size": "parallel.cp",
    "pp_size": "parallel.pp",
    "pp_schedule": "parallel.pp_schedule",
    "pp_microbatches": "parallel.pp_microbatches",
    "pp_split_points": "parallel.pp_split_points",
    "pp_stages_per_rank": "parallel.pp_stages_per_rank",
}


@dataclass(frozen=True)
class ParallelismConfig:
    """How the processes split the work (Accelerate's ``ParallelismConfig``).

    Args:
        dp_replicate_size: Groups holding whole copies of the (sharded) model, each fed its own
            batches; with ``dp_shard_size > 1`` this is HSDP (shards within a group, replicas across).
        dp_shard_size: Processes across which FSDP shards parameters, gradients and optimizer state;
            ``"auto"`` (or ``None`` or ``-1``) takes whatever the other sizes leave of the world size.
        tp_size: Processes that split each layer of the model (tensor parallelism); they see the same
            batch.
        cp_size: Context parallelism: processes that each hold a slice of every sequence (torch's
            ``context_parallel``: the inputs sharded along the sequence, attention computed ring-wise); they read
            the same batch, and FSDP shards the model over ``dp_shard x cp``. CUDA only: torch has no sharding
            rule for the CPU's attention kernels.
        tp_plan: How tensor parallelism splits the model: module-name patterns (``*`` matches one
            name segment) to ``"colwise"``, ``"rowwise"`` or ``"sequence"`` (or torch ``ParallelStyle``
            objects); None takes the model class's own ``tp_plan`` (see
            :mod:`runner.engine.parallel.tensor_parallel`).
        pp_size: Pipeline stages: processes that each hold a run of the model's blocks, passing activations to the
            next (see :mod:`runner.engine.parallel.pipeline`); they see the same batch.
        pp_schedule: torch's schedule that orders the stages' forwards and backwards over the micro-batches
            (``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``looped_bfs``, ``interleaved_zero_bubble``,
            ``zbv_zero_bubble``; the last four hold several stages per process).
        pp_microbatches: Micro-batches each process's batch is split into for the pipeline; None: one per stage.
        pp_split_points: The unit (module name) each stage after the first begins with; None cuts the model's
            blocks evenly.
        pp_stages_per_rank: Stages each process holds under a multi-stage schedule (2 for the V-shaped one).

    Raises:
        ValueError: A size is not a whole number of at least 1, ``cp_size > 1`` with pipeline stages, an unknown
            schedule, or micro-batches the schedule cannot run.

    Example:
        >>> config = ParallelismConfig(dp_shard_size="auto", tp_size=2).resolve(world_size=8)
        >>> config.dp_shard_size, config.data_parallel_size
        (4, 4)
        >>> mesh = config.build_device_mesh("cuda")  # inside an initialised process group of 8
        >>> mesh["tp"], mesh[config.fsdp_dim_names], data_parallel_mesh(mesh)
    """

    dp_replicate_size: int = 1
    dp_shard_size: int | str | None = 1
    tp_size: int = 1
    cp_size: int = 1
    tp_plan: Mapping[str, Any] | None = None
    pp_size: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None
    pp_split_points: tuple[str, ...] | None = None
    pp_stages_per_rank: int | None = None

    def __post_init__(self) -> None:
        for name in ("dp_replicate_size", "tp_size", "cp_size", "pp_size"):
            _check_size(name, getattr(self, name))
        for name in ("pp_microbatches", "pp_stages_per_rank"):
            if getattr(self, name) is not None:
                _check_size(name, getattr(self, name))
        if self.pp_split_points is not None:
            object.__setattr__(self, "pp_split_points", tuple(self.pp_split_points))
        if self.pp_enabled:
            from runner.engine.parallel.pipeline import check_schedule

            check_schedule(
                self.pp_schedule, pp=self.pp_size, stages=self.pp_stages, microbatches=self.microbatches,
                split_points=self.pp_split_points,
            )  # fmt: skip
        if not _is_rest(self.dp_shard_size):
            _check_size("dp_shard_size", self.dp_shard_size)
        if self.cp_enabled and self.pp_enabled:
            raise ValueError(
                f"cp_size={self.cp_size} ({_CONFIG_KEYS['cp_size']}) with pp_size={self.pp_size} "
                f"({_CONFIG_KEYS['pp_size']}): context parallelism inside pipeline stages is not supported; set one "
                "of them to 1."
            )

    def resolve(self, world_size: int) -> ParallelismConfig:
        """This config with every size a number that fits ``world_size`` processes.

        ``dp_shard_size="auto"`` becomes the world size over the other sizes. As in Accelerate, all
        sizes 1 on several processes means plain data parallelism: ``dp_replicate_size = world_size``.

        Raises:
            ValueError: The sizes' product is not ``world_size``.
        """
        if _is_rest(self.dp_shard_size):
            names = ["dp_replicate_size", "tp_size"]
            names += [name for name, on in (("cp_size", self.cp_enabled), ("pp_size", self.pp_enabled)) if on]
            others = self.dp_replicate_size * self.tp_size * self.cp_size * self.pp_size
            if world_size % others:
                keys = [_CONFIG_KEYS[name] for name in names]
                raise ValueError(
                    f"dp_shard_size={REST_OF_THE_WORLD!r} ({_CONFIG_KEYS['dp_shard_size']}) needs the {world_size} "
                    f"processes to divide by {' * '.join(names)} = {others}; choose {', '.join(keys[:-1])} and "
                    f"{keys[-1]} whose product divides the number of processes."
                )
            return dataclasses.replace(self, dp_shard_size=world_size // others)
        if self.total_size == 1 and world_size > 1:
            return dataclasses.replace(self, dp_replicate_size=world_size)
        if self.total_size != world_size:
            names = ["dp_replicate_size", "dp_shard_size", "tp_size"]
            names += [name for name, on in (("cp_size", self.cp_enabled), ("pp_size", self.pp_enabled)) if on]
            product = " * ".join(names)
            values = " * ".join(str(getattr(self, name)) for name in names)
            keys = " * ".join(_CONFIG_KEYS[name] for name in names)
            raise ValueError(
                f"{product} = {values} = {self.total_size} does not match the {world_size} processes; make {keys} "
                f"equal the number of processes, or set {_CONFIG_KEYS['dp_shard_size']}={REST_OF_THE_WORLD}."
            )
        return self

    @property
    def is_resolved(self) -> bool:
        return not _is_rest(self.dp_shard_size)

    @property
    def total_size(self) -> int:
        """Processes the mesh spans: the product of all sizes."""
        return self.data_parallel_size * self.non_data_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel ranks: groups of processes that each read their own batches."""
        return self.dp_replicate_size * self._dp_shard_size

    @property
    def non_data_parallel_size(self) -> int:
        """Processes that read the same batch: one tensor-parallel group, times the stages of a pipeline."""
        return self.tp_size * self.cp_size * self.pp_size

    @property
    def pp_enabled(self) -> bool:
        return self.pp_size > 1

    @property
    def pp_stages(self) -> int:
        """The pipeline's stages: one per process of it, or ``pp_stages_per_rank`` each under a multi-stage
        schedule (2 under the V-shaped one unless given)."""
        from runner.engine.parallel.pipeline import SCHEDULES

        layout = SCHEDULES.get(self.pp_schedule, ("", "single"))[1]
        if layout == "single":
            return self.pp_size
        return self.pp_size * (self.pp_stages_per_rank or 2)

    @property
    def microbatches(self) -> int:
        """Micro-batches of each pipeline step: ``pp_microbatches``, or one per stage."""
        return self.pp_microbatches or self.pp_stages

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate_size > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self._dp_shard_size > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Whether ``fully_shard`` has anything to shard across (``dp_shard_size > 1``)."""
        return self.dp_shard_enabled

    @property
    def tp_enabled(self) -> bool:
        return self.tp_size > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp_size > 1

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The mesh's dimensions: :data:`MESH_DIM_NAMES`, after ``"pp"`` when there are several stages, with
        ``"cp"`` before ``"tp"`` under context parallelism."""
        pp = (PIPELINE_DIM_NAME,) if self.pp_enabled else ()
        cp = (CONTEXT_DIM_NAME,) if self.cp_enabled else ()
        return (*pp, *MESH_DIM_NAMES[:2], *cp, MESH_DIM_NAMES[2])

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The mesh's sizes along :attr:`mesh_dim_names`."""
        pp = (self.pp_size,) if self.pp_enabled else ()
        cp = (self.cp_size,) if self.cp_enabled else ()
        return (*pp, self.dp_replicate_size, self._dp_shard_size, *cp, self.tp_size)

    @property
    def dp_dim_names(self) -> tuple[str, str]:
        """The dimensions flattened into the ``"dp"`` submesh."""
        return MESH_DIM_NAMES[:2]

    @property
    def fsdp_dim_names(self) -> tuple[str, ...]:
        """The submesh to give ``fully_shard``: 2-D (replicate, shard) for HSDP, else the shard dimension; the shard
        dimension flattened with ``cp`` under context parallelism (each context rank's gradients are its slice's)."""
        shard = SHARD_AND_CONTEXT_DIM_NAME if self.cp_enabled else MESH_DIM_NAMES[1]
        return (MESH_DIM_NAMES[0], shard) if self.dp_replicate_enabled else (shard,)

    def data_parallel_rank(self, rank: int) -> int:
        """Which data-parallel rank global ``rank`` is (the same for every process of one TP group, and for every
        stage of one pipeline)."""
        return (rank // (self.tp_size * self.cp_size)) % self.data_parallel_size

    def pp_rank(self, rank: int) -> int:
        """Which stage of its pipeline global ``rank`` holds (the first of them, under a multi-stage schedule)."""
        return rank // (self.data_parallel_size * self.tp_size * self.cp_size)

    def tp_rank(self, rank: int) -> int:
        """Global ``rank``'s place in its tensor-parallel group."""
        return rank % self.tp_size

    def build_device_mesh(self, device_type: str):
        """The ``DeviceMesh`` of this (resolved) config over the default process group.

        Dimensions are named :attr:`mesh_dim_names`, with two flattened submeshes: ``"dp"`` (see
        :func:`data_parallel_mesh`) and ``"dp_shard_tp"``, which DTensor finds by itself to reduce a
        2-D sharded gradient's norm in one all-reduce rather than two; with ``cp``, ``"dp_shard_cp"`` too
        (FSDP's, :attr:`fsdp_dim_names`), and ``"dp_shard_tp"`` spans ``cp`` as well. A collective: every process
        must call it, in the same order relative to other collectives.

        Args:
            device_type: ``"cpu"`` or ``"cuda"`` (no index), as ``init_device_mesh`` takes it.

        Returns:
            A 3-D ``torch.distributed.device_mesh.DeviceMesh`` (4-D with pipeline stages).

        Raises:
            RuntimeError: There is no default process group, or it is not ``total_size`` processes.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not self.is_resolved:
            raise RuntimeError("build_device_mesh needs a resolved ParallelismConfig; call resolve(world_size) first.")
        # init_device_mesh would otherwise start a process group of its own from the environment.
        if not dist.is_initialized():
            raise RuntimeError(
                "build_device_mesh needs the default process group; initialise it first (Accelerator does)."
            )
        if dist.get_world_size() != self.total_size:
            raise RuntimeError(
                f"The mesh spans {self.total_size} processes but the process group has {dist.get_world_size()}; "
                "resolve the ParallelismConfig against the group's world size."
            )
        mesh = init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=self.mesh_dim_names)
        # The flattened groups are created now, on every rank: creating one later on some ranks only would hang.
        mesh[self.dp_dim_names]._flatten(DATA_PARALLEL_DIM_NAME)
        if self.cp_enabled:
            mesh[(MESH_DIM_NAMES[1], CONTEXT_DIM_NAME)]._flatten(SHARD_AND_CONTEXT_DIM_NAME)
            mesh[(MESH_DIM_NAMES[1], CONTEXT_DIM_NAME, MESH_DIM_NAMES[2])]._flatten(SHARD_AND_TP_DIM_NAME)
        else:
            mesh[MESH_DIM_NAMES[1:]]._flatten(SHARD_AND_TP_DIM_NAME)
        return mesh

    @property
    def _dp_shard_size(self) -> int:
        if not self.is_resolved:
            raise RuntimeError(f"dp_shard_size={self.dp_shard_size!r} is unresolved; call resolve(world_size) first.")
        return self.dp_shard_size


def data_parallel_mesh(mesh):
    """The 1-D submesh of ``mesh``'s data-parallel ranks: the processes that read different batches.

    Args:
        mesh: A mesh from :meth:`ParallelismConfig.build_device_mesh`, which made this submesh (on every
            rank) already; this only looks it up.

    Example:
        >>> dp = data_parallel_mesh(mesh)
        >>> dp.size(), dp.get_local_rank()  # the data loader's num_replicas and rank
    """
    return mesh[MESH_DIM_NAMES[:2]]._flatten(DATA_PARALLEL_DIM_NAME)


def _is_rest(size: object) -> bool:
    return size is None or size == REST_OF_THE_WORLD or (type(size) is int and size == -1)


def _check_size(name: str, value: object) -> None:
    if type(value) is not int or value < 1:  # type(): True is an int, but not a number of processes
        extra = f", or {REST_OF_THE_WORLD}" if name == "dp_shard_size" else ""
        raise ValueError(f"{name}={value!r} ({_CONFIG_KEYS[name]}) must be a whole number of at least 1{extra}.")
