"""What torchrun, torch's elastic agent or srun said about this process is read from the variables they set."""

import dataclasses

import pytest

from runner.engine.launch_environment import LaunchEnvironment

TORCHRUN = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "8",
    "TORCHELASTIC_RUN_ID": "c10d-4f2a",
    "TORCHELASTIC_RESTART_COUNT": "2",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "MASTER_ADDR": "node0.cluster",
    "MASTER_PORT": "29500",
    "OMP_NUM_THREADS": "4",
}


def test_torchruns_variables_are_read():
    environment = LaunchEnvironment.read(TORCHRUN)
    assert environment == LaunchEnvironment(
        rank=3, world_size=8, run_id="c10d-4f2a", restart_count=2, agent_store=True,
        master_addr="node0.cluster", master_port=29500, threads=4, local_rank=1,
    )  # fmt: skip
    assert (environment.global_rank, environment.under_torchrun, environment.inside_launched_group) == (3, True, True)


def test_rank_zero_under_torchrun_is_rank_zero_not_absent():
    environment = LaunchEnvironment.read({**TORCHRUN, "RANK": "0"})
    assert (environment.rank, environment.global_rank, environment.under_torchrun) == (0, 0, True)


def test_without_a_launcher_the_process_is_rank_zero_of_no_group():
    environment = LaunchEnvironment.read({})
    assert environment == LaunchEnvironment()
    assert (environment.rank, environment.world_size, environment.restart_count) == (None, None, 0)
    assert (environment.global_rank, environment.under_torchrun, environment.inside_launched_group) == (0, False, False)


@pytest.mark.parametrize("text", ["zero", "-1", "2.5", "", "  ", "0x3"])
def test_a_value_that_is_not_a_count_reads_as_absent(text):
    variables = ["RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "MASTER_PORT", "OMP_NUM_THREADS"]
    environment = LaunchEnvironment.read(dict.fromkeys(variables, text))
    assert environment == LaunchEnvironment()
    assert environment.global_rank == 0


def test_a_process_count_that_is_not_one_is_named_by_the_engine_and_absent_to_the_command_line():
    from runner.engine.distributed import read_environment

    environment = LaunchEnvironment.read({"RANK": "zero", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "-1"})
    assert (environment.rank, environment.local_world_size, environment.global_rank) == (None, None, 0)
    assert environment.malformed == ("RANK='zero'", "LOCAL_WORLD_SIZE='-1'")
    assert LaunchEnvironment.read({"MASTER_PORT": "x", "OMP_NUM_THREADS": "y"}).malformed == ()  # not the engine's
    with pytest.raises(ValueError) as refused:
        read_environment(cpu=True, launched=environment)
    assert str(refused.value) == (
        "Environment variable RANK='zero' is not a count (a whole number from 0); unset it or fix it."
    )


def test_the_engine_reads_its_place_in_the_job_from_the_same_value():
    from runner.engine.distributed import read_environment

    launched = LaunchEnvironment.read({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"})
    env = read_environment(cpu=True, launched=launched)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.backend) == (3, 8, 1, 4, "gloo")
    alone = read_environment(cpu=True, launched=LaunchEnvironment())
    assert (alone.rank, alone.world_size, alone.local_rank, alone.local_world_size, alone.backend) == (0, 1, 0, 1, None)
    with pytest.raises(ValueError, match=r"^RANK=8 is outside WORLD_SIZE=8"):
        read_environment(cpu=True, launched=dataclasses.replace(launched, rank=8))


def test_surrounding_spaces_around_a_number_are_allowed():
    environment = LaunchEnvironment.read({"RANK": " 2 ", "MASTER_PORT": "29500\n"})
    assert (environment.rank, environment.master_port) == (2, 29500)


def test_the_agent_store_is_used_only_when_torch_says_so_in_its_own_spelling():
    assert LaunchEnvironment.read({"TORCHELASTIC_USE_AGENT_STORE": "True"}).agent_store is True
    for spelling in ["true", "1", "False", ""]:
        assert LaunchEnvironment.read({"TORCHELASTIC_USE_AGENT_STORE": spelling}).agent_store is False


def test_srun_style_rank_and_world_size_mean_a_launched_group_but_not_torchrun():
    environment = LaunchEnvironment.read({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "1"})
    assert (environment.inside_launched_group, environment.under_torchrun, environment.global_rank) == (True, False, 1)


def test_a_rank_alone_is_not_a_launched_group():
    environment = LaunchEnvironment.read({"RANK": "1"})
    assert (environment.inside_launched_group, environment.under_torchrun, environment.global_rank) == (False, False, 1)


def test_the_elastic_agents_own_process_is_inside_a_launched_group_without_being_a_rank():
    environment = LaunchEnvironment.read({"TORCHELASTIC_RUN_ID": "c10d-4f2a"})
    assert (environment.inside_launched_group, environment.under_torchrun, environment.global_rank) == (True, False, 0)


def test_by_default_this_processs_environment_is_read_and_the_value_is_immutable(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    environment = LaunchEnvironment.read()
    assert (environment.rank, environment.world_size, environment.run_id) == (5, 6, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        environment.rank = 0
