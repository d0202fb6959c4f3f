"""ParallelismConfig: sizes resolved against a world size, every error sentence, and the mesh on one process."""

import pytest
import torch.distributed as dist

from runner.engine.parallel.mesh import MESH_DIM_NAMES, ParallelismConfig, data_parallel_mesh


@pytest.mark.parametrize("rest", ["auto", None, -1])
def test_auto_dp_shard_takes_what_the_other_sizes_leave(rest):
    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=rest, tp_size=2)
    assert not config.is_resolved
    resolved = config.resolve(world_size=16)
    assert resolved == ParallelismConfig(dp_replicate_size=2, dp_shard_size=4, tp_size=2)
    assert resolved.mesh_shape == (2, 4, 2) and resolved.total_size == 16
    assert (resolved.data_parallel_size, resolved.non_data_parallel_size) == (8, 2)
    assert resolved.dp_replicate_enabled and resolved.fsdp_enabled and resolved.tp_enabled
    assert not resolved.cp_enabled
    assert resolved.fsdp_dim_names == ("dp_replicate", "dp_shard")  # HSDP: fully_shard gets the 2-D submesh
    assert resolved.dp_dim_names == ("dp_replicate", "dp_shard")


def test_defaults_are_one_process_and_all_ones_on_several_is_plain_data_parallel():
    assert ParallelismConfig().resolve(world_size=1).mesh_shape == (1, 1, 1)
    ddp = ParallelismConfig().resolve(world_size=4)  # as in Accelerate
    assert ddp.mesh_shape == (4, 1, 1) and ddp.dp_replicate_enabled and not ddp.fsdp_enabled
    assert ddp.fsdp_dim_names == ("dp_replicate", "dp_shard")


def test_fsdp_with_tensor_parallelism():
    config = ParallelismConfig(dp_shard_size="auto", tp_size=2).resolve(world_size=8)
    assert config.mesh_shape == (1, 4, 2)
    assert config.fsdp_enabled and not config.dp_replicate_enabled
    assert config.fsdp_dim_names == ("dp_shard",)
    assert ParallelismConfig(dp_shard_size=4, tp_size=2).resolve(world_size=8) == config  # explicit sizes too


def test_ranks_of_one_tensor_parallel_group_share_a_data_parallel_rank():
    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2).resolve(world_size=8)
    assert [config.data_parallel_rank(rank) for rank in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [config.tp_rank(rank) for rank in range(8)] == [0, 1] * 4


def test_pipeline_stages_are_the_outermost_dimension_and_read_the_same_batches():
    config = ParallelismConfig(pp_size=2, dp_shard_size="auto", tp_size=2).resolve(world_size=8)
    assert config.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "tp") and config.mesh_shape == (2, 1, 2, 2)
    assert (config.data_parallel_size, config.non_data_parallel_size, config.total_size) == (2, 4, 8)
    # Row-major over (pp, dp_replicate, dp_shard, tp): the stages of one pipeline are 4 ranks apart.
    assert [config.pp_rank(rank) for rank in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [config.data_parallel_rank(rank) for rank in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert (config.pp_stages, config.microbatches) == (2, 2)  # 1f1b: one stage per process, a micro-batch each
    looped = ParallelismConfig(pp_size=2, pp_schedule="interleaved_1f1b", pp_microbatches=8)
    assert (looped.pp_stages, looped.microbatches) == (4, 8)
    assert ParallelismConfig(pp_size=2, pp_schedule="looped_bfs", pp_stages_per_rank=3).pp_stages == 6
    assert ParallelismConfig(pp_size=1).mesh_dim_names == MESH_DIM_NAMES  # no pp dimension without stages


def test_context_parallel_ranks_sit_between_the_shards_and_tensor_parallelism_and_shard_with_them():
    config = ParallelismConfig(dp_shard_size="auto", cp_size=2, tp_size=2).resolve(world_size=8)
    assert config.mesh_dim_names == ("dp_replicate", "dp_shard", "cp", "tp") and config.mesh_shape == (1, 2, 2, 2)
    assert (config.data_parallel_size, config.non_data_parallel_size) == (2, 4)  # a cp group reads one batch
    assert [config.data_parallel_rank(rank) for rank in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert config.fsdp_dim_names == ("dp_shard_cp",)  # FSDP averages the slices' gradients too
    hybrid = ParallelismConfig(dp_replicate_size=2, dp_shard_size=1, cp_size=2).resolve(world_size=4)
    assert hybrid.fsdp_dim_names == ("dp_replicate", "dp_shard_cp")
    with pytest.raises(ValueError) as error:
        ParallelismConfig(dp_shard_size="auto", cp_size=3).resolve(world_size=4)
    assert str(error.value) == (
        "dp_shard_size='auto' (parallel.dp_shard) needs the 4 processes to divide by dp_replicate_size * tp_size * "
        "cp_size = 3; choose parallel.dp_replicate, parallel.tp and parallel.cp whose product divides the number of "
        "processes."
    )


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"pp_size": 0}, "pp_size=0 (parallel.pp) must be a whole number of at least 1."),
        ({"pp_size": 2, "pp_microbatches": 0}, "pp_microbatches=0 (parallel.pp_microbatches) must be a whole number"),
        ({"pp_size": 2, "pp_schedule": "dualpipe"}, "parallel.pp_schedule='dualpipe' is not a pipeline schedule"),
        ({"pp_size": 2, "pp_microbatches": 1}, "parallel.pp_microbatches=1 is too few for 1f1b on 2 stages"),
        ({"pp_size": 2, "pp_split_points": ["a", "b"]}, "parallel.pp_split_points names 2 units, and the 2 stages"),
    ],
)
def test_a_pipeline_the_schedule_cannot_run_is_refused(sizes, message):
    with pytest.raises(ValueError) as error:
        ParallelismConfig(**sizes)
    assert str(error.value).startswith(message)


def test_a_pipeline_that_does_not_fit_the_processes_names_every_size():
    with pytest.raises(ValueError) as error:
        ParallelismConfig(pp_size=2, dp_shard_size=2).resolve(world_size=2)
    assert str(error.value) == (
        "dp_replicate_size * dp_shard_size * tp_size * pp_size = 1 * 2 * 1 * 2 = 4 does not match the 2 processes; "
        "make parallel.dp_replicate * parallel.dp_shard * parallel.tp * parallel.pp equal the number of processes, or "
        "set parallel.dp_shard=auto."
    )


def test_an_unresolved_config_says_so():
    with pytest.raises(RuntimeError, match=r"dp_shard_size='auto' is unresolved; call resolve\(world_size\) first"):
        _ = ParallelismConfig(dp_shard_size="auto").total_size


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"tp_size": 0},
            "tp_size=0 (parallel.tp) must be a whole number of at least 1.",
        ),
        (
            {"dp_replicate_size": 2.0},
            "dp_replicate_size=2.0 (parallel.dp_replicate) must be a whole number of at least 1.",
        ),
        (
            {"dp_shard_size": "all"},
            "dp_shard_size='all' (parallel.dp_shard) must be a whole number of at least 1, or auto.",
        ),
        (
            {"dp_shard_size": 0},
            "dp_shard_size=0 (parallel.dp_shard) must be a whole number of at least 1, or auto.",
        ),
        (
            {"tp_size": True},
            "tp_size=True (parallel.tp) must be a whole number of at least 1.",
        ),
        (
            {"cp_size": 2, "pp_size": 2},
            "cp_size=2 (parallel.cp) with pp_size=2 (parallel.pp): context parallelism inside pipeline stages is not "
            "supported; set one of them to 1.",
        ),
    ],
)
def test_bad_sizes_are_one_sentence(options, message):
    with pytest.raises(ValueError) as error:
        ParallelismConfig(**options)
    assert str(error.value) == message


def test_sizes_that_do_not_fill_the_world_are_one_sentence():
    with pytest.raises(ValueError) as error:
        ParallelismConfig(dp_shard_size=2, tp_size=2).resolve(world_size=8)
    assert str(error.value) == (
        "dp_replicate_size * dp_shard_size * tp_size = 1 * 2 * 2 = 4 does not match the 8 processes; make "
        "parallel.dp_replicate * parallel.dp_shard * parallel.tp equal the number of processes, or set "
        "parallel.dp_shard=auto."
    )
    with pytest.raises(ValueError) as error:
        ParallelismConfig(dp_shard_size="auto", tp_size=4).resolve(world_size=6)
    assert str(error.value) == (
        "dp_shard_size='auto' (parallel.dp_shard) needs the 6 processes to divide by dp_replicate_size * tp_size = "
        "4; choose parallel.dp_replicate and parallel.tp whose product divides the number of processes."
    )


def test_the_mesh_of_one_process_has_every_dimension(one_process_group):
    mesh = ParallelismConfig().resolve(world_size=1).build_device_mesh("cpu")
    assert mesh.mesh_dim_names == MESH_DIM_NAMES and tuple(mesh.shape) == (1, 1, 1)
    assert mesh["tp"].size() == 1 and mesh[("dp_shard",)].size() == 1
    dp = data_parallel_mesh(mesh)
    assert dp.mesh_dim_names == ("dp",) and dp.size() == 1 and dp.get_local_rank() == 0
    with pytest.raises(RuntimeError) as error:
        ParallelismConfig(tp_size=2).resolve(world_size=2).build_device_mesh("cpu")
    assert str(error.value) == (
        "The mesh spans 2 processes but the process group has 1; resolve the ParallelismConfig against the "
        "group's world size."
    )


def test_the_mesh_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError) as error:
        ParallelismConfig().resolve(world_size=1).build_device_mesh("cpu")
    assert str(error.value) == (
        "build_device_mesh needs the default process group; initialise it first (Accelerator does)."
    )
