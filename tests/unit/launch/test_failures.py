"""A failed run of several processes is reported as one sentence naming the rank that caused it, not a peer that
failed next on the broken connection. The failures are torch's own ProcessFailure, read from error files laid out as
torch's elastic agent lays them out: <log dir>/<run id>/attempt_<n>/<local rank>/error.json."""

import json

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from runner.launch.failures import describe_failure


def _error_file(attempt, local_rank, message):
    """An error file as torch's ErrorHandler.record_exception writes it; its path."""
    path = attempt / str(local_rank) / "error.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"message": {"message": message, "extraInfo": {"py_callstack": "", "timestamp": "0"}}}))
    return path


def _failure(attempt, local_rank, message, *, exitcode=1):
    return ProcessFailure(
        local_rank=local_rank, pid=1000 + local_rank, exitcode=exitcode,
        error_file=str(_error_file(attempt, local_rank, message)),
    )  # fmt: skip


def _without_error_file(tmp_path, local_rank, *, exitcode):
    return ProcessFailure(local_rank=local_rank, pid=1000, exitcode=exitcode, error_file=str(tmp_path / "absent.json"))


@pytest.mark.parametrize(
    "collateral",
    [
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242",
        "RuntimeError: Connection reset by peer",
        "BrokenPipeError: [Errno 32] Broken pipe",
        "DistBackendError: NCCL communicator was aborted on rank 0.",
        "RuntimeError: remote worker went away",
        "Signal 15 (SIGTERM) received by PID 1000",
    ],
)
def test_a_ranks_own_error_is_preferred_over_a_lower_ranks_broken_connection(tmp_path, collateral):
    attempt = tmp_path / "run" / "attempt_0"
    failures = {0: _failure(attempt, 0, collateral), 1: _failure(attempt, 1, "ValueError: the loss is nan")}
    assert describe_failure(failures) == "Worker rank 1 failed: ValueError: the loss is nan"


def test_among_own_errors_the_lowest_rank_is_named(tmp_path):
    attempt = tmp_path / "attempt_0"
    failures = {1: _failure(attempt, 1, "ValueError: one"), 0: _failure(attempt, 0, "KeyError: 'zero'")}
    assert describe_failure(failures) == "Worker rank 0 failed: KeyError: 'zero'"


def test_when_every_rank_failed_on_the_connection_the_lowest_rank_is_named(tmp_path):
    attempt = tmp_path / "attempt_0"
    failures = {
        1: _failure(attempt, 1, "RuntimeError: Connection closed by peer"),
        0: _failure(attempt, 0, "RuntimeError: Connection reset by peer"),
    }
    assert describe_failure(failures) == "Worker rank 0 failed: RuntimeError: Connection reset by peer"


def test_a_rank_that_left_no_error_is_named_when_the_reported_peer_failed_on_the_connection(tmp_path):
    # Rank 1 was killed with SIGKILL; rank 0 raised on the broken connection and exited in the same poll of the
    # agent, which reports only one of them. Rank 1's folder has no error file.
    attempt = tmp_path / "attempt_0"
    (attempt / "1").mkdir(parents=True)
    failures = {0: _failure(attempt, 0, "RuntimeError: [pair.cc:534] Connection closed by peer [127.0.0.1]:4242")}
    assert describe_failure(failures) == (
        "Worker rank 1 failed: it left no error of its own: it was killed (by a signal, e.g. the out-of-memory "
        "killer) or crashed, and rank 0 then failed on the broken connection"
    )


def test_a_rank_that_left_no_error_is_not_named_over_an_error_of_a_ranks_own(tmp_path):
    attempt = tmp_path / "attempt_0"
    (attempt / "1").mkdir(parents=True)
    failures = {0: _failure(attempt, 0, "ValueError: the loss is nan")}
    assert describe_failure(failures) == "Worker rank 0 failed: ValueError: the loss is nan"


def test_when_several_ranks_left_no_error_the_connection_error_is_named(tmp_path):
    # Which of them went away first is not known: the agent also kills ranks that hang after a failure.
    attempt = tmp_path / "attempt_0"
    (attempt / "1").mkdir(parents=True)
    (attempt / "2").mkdir()
    failures = {0: _failure(attempt, 0, "RuntimeError: Connection closed by peer")}
    assert describe_failure(failures) == "Worker rank 0 failed: RuntimeError: Connection closed by peer"


def test_the_error_file_of_a_rank_the_agent_has_not_reported_yet_is_read(tmp_path):
    # Node 1 of two with two local ranks each: global ranks 2 and 3. The agent reported rank 2, which failed on the
    # connection; rank 3 raised first but had not exited yet. Its error file sits next to rank 2's.
    attempt = tmp_path / "run" / "attempt_0"
    _error_file(attempt, 1, "runner.engine.checkpoint.CheckpointError: step_00000040 has no manifest")
    failures = {2: _failure(attempt, 0, "RuntimeError: Connection closed by peer")}
    assert describe_failure(failures) == "Worker rank 3 failed: CheckpointError: step_00000040 has no manifest"


def test_sibling_ranks_are_mapped_from_the_failed_ranks_local_rank(tmp_path):
    attempt = tmp_path / "attempt_0"
    _error_file(attempt, 0, "ValueError: from local rank 0")
    failures = {5: _failure(attempt, 1, "RuntimeError: Connection closed by peer")}  # global 5 = node 2, local 1
    assert describe_failure(failures) == "Worker rank 4 failed: ValueError: from local rank 0"


def test_a_reported_ranks_own_error_is_preferred_over_a_siblings_file(tmp_path):
    attempt = tmp_path / "attempt_0"
    _error_file(attempt, 0, "ValueError: sibling")
    failures = {1: _failure(attempt, 1, "TypeError: reported")}
    assert describe_failure(failures) == "Worker rank 1 failed: TypeError: reported"


def test_error_files_of_another_attempt_are_not_read(tmp_path):
    _error_file(tmp_path / "attempt_0", 1, "ValueError: from the attempt before the restart")
    failures = {0: _failure(tmp_path / "attempt_1", 0, "RuntimeError: Connection closed by peer")}
    assert describe_failure(failures) == "Worker rank 0 failed: RuntimeError: Connection closed by peer"


def test_unreadable_or_garbage_sibling_files_are_ignored(tmp_path):
    attempt = tmp_path / "attempt_0"
    failures = {0: _failure(attempt, 0, "RuntimeError: Connection closed by peer")}
    for local_rank, content in [(1, "{not json"), (2, '{"message": "a plain string"}'), (3, "[]"), (4, "{}")]:
        (attempt / str(local_rank)).mkdir()
        (attempt / str(local_rank) / "error.json").write_text(content)
    (attempt / "5").mkdir()
    (attempt / "5" / "error.json").write_bytes(b"\xff\xfe\x00 not utf-8")
    (attempt / "6" / "error.json").mkdir(parents=True)  # a folder where the file should be
    (attempt / "tmp").mkdir()  # not a local rank's folder
    (attempt / "tmp" / "error.json").write_text(json.dumps({"message": {"message": "ValueError: not a rank"}}))
    assert describe_failure(failures) == "Worker rank 0 failed: RuntimeError: Connection closed by peer"


def test_a_failure_whose_error_file_has_no_message_gives_its_exit_code(tmp_path):
    attempt = tmp_path / "attempt_0"
    assert describe_failure({0: _failure(attempt, 0, "  ", exitcode=3)}) == "Worker rank 0 failed: exit code 3"
    path = attempt / "1" / "error.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"message": {"extraInfo": {"timestamp": "0"}}}))
    failure = ProcessFailure(local_rank=1, pid=1, exitcode=7, error_file=str(path))
    assert describe_failure({1: failure}) == "Worker rank 1 failed: exit code 7"


def test_a_plain_string_message_is_used_as_it_is(tmp_path):
    path = tmp_path / "attempt_0" / "0" / "error.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"message": "OSError: [Errno 28] No space left on device", "timestamp": 0}))
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert describe_failure({0: failure}) == "Worker rank 0 failed: OSError: [Errno 28] No space left on device"


def test_a_worker_killed_by_a_signal_is_described_by_torchs_sentence(tmp_path):
    failures = {0: _without_error_file(tmp_path, 0, exitcode=-9)}
    assert describe_failure(failures) == "Worker rank 0 failed: Signal 9 (SIGKILL) received by PID 1000"


def test_a_worker_that_exits_without_an_error_file_gives_its_exit_code(tmp_path):
    assert describe_failure({0: _without_error_file(tmp_path, 0, exitcode=3)}) == "Worker rank 0 failed: exit code 3"


def test_a_sibling_file_with_an_empty_message_is_ignored(tmp_path):
    attempt = tmp_path / "attempt_0"
    _error_file(attempt, 1, "")
    failures = {0: _failure(attempt, 0, "RuntimeError: Connection closed by peer")}
    assert describe_failure(failures) == "Worker rank 0 failed: RuntimeError: Connection closed by peer"


@pytest.mark.parametrize(
    ("message", "detail"),
    [
        ("runner.engine.checkpoint.CheckpointError: x", "CheckpointError: x"),
        ("torch.OutOfMemoryError: CUDA out of memory.", "OutOfMemoryError: CUDA out of memory."),
        ("ConfigError: trainer.max_steps=0 must be positive", "ConfigError: trainer.max_steps=0 must be positive"),
        ("ValueError: see runner.engine.checkpoint: x", "ValueError: see runner.engine.checkpoint: x"),
    ],
)
def test_the_module_of_the_exception_is_left_out(tmp_path, message, detail):
    failures = {0: _failure(tmp_path / "attempt_0", 0, message)}
    assert describe_failure(failures) == f"Worker rank 0 failed: {detail}"


def test_the_last_line_of_a_traceback_is_used(tmp_path):
    traceback = (
        "Traceback (most recent call last):\n"
        '  File "/work/runner/training.py", line 12, in train\n'
        "    loss.backward()\n"
        "torch.AcceleratorError: CUDA error: an illegal memory access was encountered\n"
    )
    failures = {0: _failure(tmp_path / "attempt_0", 0, traceback)}
    expected = "Worker rank 0 failed: AcceleratorError: CUDA error: an illegal memory access was encountered"
    assert describe_failure(failures) == expected
