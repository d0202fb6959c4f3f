"""Slurm's view of submitted jobs, read from squeue's output without accounting (runner.launch.slurm_jobs)."""

import pytest

from runner.launch.slurm_jobs import GONE, ended_sentence, is_alive, parse_squeue


def test_squeue_output_is_read_as_each_jobs_state():
    text = "17_0 RUNNING\n17_1 PENDING\n18 CANCELLED\n\n19 completing\nslurm_load_jobs error: x y\n"
    assert parse_squeue(text) == {"17_0": "RUNNING", "17_1": "PENDING", "18": "CANCELLED", "19": "COMPLETING"}
    assert parse_squeue("") == {}


@pytest.mark.parametrize(
    ("state", "alive"),
    [
        ("PENDING", True), ("RUNNING", True), ("REQUEUED", True), ("REQUEUE_HOLD", True), ("COMPLETING", True),
        ("SUSPENDED", True), ("CONFIGURING", True), ("COMPLETED", False), ("CANCELLED", False), ("FAILED", False),
        ("TIMEOUT", False), ("NODE_FAIL", False), ("OUT_OF_MEMORY", False), ("BOOT_FAIL", False),
        ("DEADLINE", False), ("PREEMPTED", False), (GONE, False),
    ],
)  # fmt: skip
def test_a_job_is_alive_until_slurm_ends_it_or_forgets_it(state, alive):
    assert is_alive(state) is alive


def test_how_slurm_ended_a_job_is_said_in_words():
    assert ended_sentence("17_0", "CANCELLED", started=True) == "Slurm ended job 17_0 as CANCELLED before it finished"
    assert ended_sentence("18", "NODE_FAIL", started=False) == "Slurm ended job 18 as NODE_FAIL before it started"
    assert ended_sentence("19", GONE, started=True) == "Slurm no longer lists job 19, which ended before it finished"
