"""A stop signal (SIGTERM, SIGUSR1) is recorded instead of ending the process, and the processes of a run agree on
the step at which they stop. The signals are real ones, sent to this process; the real 2-process agreement is in
tests/distributed/test_preemption.py."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from runner.training import preemption


@pytest.fixture(autouse=True)
def _handlers_and_flag_restored():
    handlers = {number: signal.getsignal(number) for number in preemption.SIGNALS}
    preemption._received.clear()
    yield
    for number, handler in handlers.items():
        signal.signal(number, handler)
    preemption._received.clear()


class _Accelerator:
    """As many processes as told; ``reduce`` adds the other processes' flags to this one's and counts its calls."""

    def __init__(self, num_processes, *, others_flag=0.0):
        self.num_processes = num_processes
        self.device = torch.device("cpu")
        self.others_flag = others_flag
        self.reductions = []

    def reduce(self, tensor, reduction="sum"):
        self.reductions.append((tensor.tolist(), reduction))
        return tensor + self.others_flag


def test_a_stop_signal_is_recorded_instead_of_ending_the_process(caplog):
    preemption.watch()
    assert preemption.received() is None
    with caplog.at_level(logging.WARNING, logger="runner"):
        os.kill(os.getpid(), signal.SIGTERM)
    assert preemption.received() == "SIGTERM"
    assert caplog.messages == ["Received SIGTERM: stopping at the next step boundary, after a checkpoint"]


def test_the_first_signal_is_kept_and_announced_once(caplog):
    preemption.watch()
    preemption.watch()  # idempotent
    with caplog.at_level(logging.WARNING, logger="runner"):
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # the second one, during the save, changes nothing
    assert preemption.received() == "SIGUSR1"
    assert preemption._received == ["SIGUSR1", "SIGTERM"]
    assert caplog.messages == ["Received SIGUSR1: stopping at the next step boundary, after a checkpoint"]


def test_release_restores_the_default_handlers():
    preemption.watch()
    assert all(signal.getsignal(number) is preemption._record for number in preemption.SIGNALS)
    preemption.release()
    assert all(signal.getsignal(number) is signal.SIG_DFL for number in preemption.SIGNALS)


def test_after_release_a_stop_signal_ends_the_process_again():
    script = textwrap.dedent(
        """
        import os, signal
        from runner.training import preemption
        preemption.watch()
        os.kill(os.getpid(), signal.SIGTERM)
        print(preemption.received(), flush=True)
        preemption.release()
        os.kill(os.getpid(), signal.SIGTERM)
        print("still alive", flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout) == (-signal.SIGTERM, "SIGTERM\n")


def test_watch_outside_the_main_thread_changes_nothing():
    before = {number: signal.getsignal(number) for number in preemption.SIGNALS}
    errors = []
    thread = threading.Thread(target=lambda: _call_and_keep_errors(preemption.watch, errors))
    thread.start()
    thread.join()
    assert errors == []
    assert {number: signal.getsignal(number) for number in preemption.SIGNALS} == before


def _call_and_keep_errors(function, errors):
    try:
        function()
    except Exception as error:  # signal.signal raises ValueError outside the main thread
        errors.append(error)


def test_alone_a_process_looks_at_its_own_flag_every_step():
    accelerator = _Accelerator(1)
    preemption.watch()
    assert [preemption.agreed(accelerator, step) for step in range(1, 4)] == [False, False, False]
    os.kill(os.getpid(), signal.SIGUSR1)
    assert [preemption.agreed(accelerator, step) for step in range(4, 7)] == [True, True, True]
    assert accelerator.reductions == []


def test_several_processes_reduce_their_flags_only_every_tenth_step():
    accelerator = _Accelerator(2)
    preemption.watch()
    os.kill(os.getpid(), signal.SIGTERM)
    stops = [step for step in range(1, 26) if preemption.agreed(accelerator, step)]
    assert stops == [10, 20]
    assert accelerator.reductions == [([1.0], "sum"), ([1.0], "sum")]  # no collective on the steps between


def test_a_signal_to_another_process_stops_this_one_at_the_agreed_step():
    accelerator = _Accelerator(4, others_flag=1.0)
    assert [preemption.agreed(accelerator, step, every=5) for step in range(1, 6)] == [False] * 4 + [True]
    assert accelerator.reductions == [([0.0], "sum")]
    assert preemption.received() is None


def test_no_process_signalled_means_no_stop():
    accelerator = _Accelerator(2)
    assert not any(preemption.agreed(accelerator, step) for step in range(1, 31))
    assert len(accelerator.reductions) == 3


# ------------------------------------------------------------------------------------------------ runner eval
def test_alone_an_evaluation_stops_at_the_batch_after_the_signal_before_writing_anything():
    accelerator = _Accelerator(1)
    preemption.watch()
    for batch in range(3):
        preemption.stop_evaluation(accelerator, batch)
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(preemption.EvaluationStopped) as stopped:
        preemption.stop_evaluation(accelerator, 3)
    assert isinstance(stopped.value, preemption.Preempted)  # the launcher exits with EXIT_CODE, as for training
    assert str(stopped.value) == "the evaluation stopped by SIGTERM before writing its results"
    assert (stopped.value.signal_name, stopped.value.step) == ("SIGTERM", -1)
    assert accelerator.reductions == []


def test_several_processes_agree_every_tenth_batch_and_once_more_after_the_last():
    accelerator = _Accelerator(2, others_flag=1.0)  # another process was signalled
    for batch in range(1, 10):
        preemption.stop_evaluation(accelerator, batch)  # no collective between the agreed batches
    assert accelerator.reductions == []
    with pytest.raises(preemption.EvaluationStopped, match="^the evaluation stopped by a peer's signal before"):
        preemption.stop_evaluation(accelerator)  # after the last batch, whatever its number
    assert accelerator.reductions == [([0.0], "sum")]


def test_an_evaluation_no_process_was_signalled_in_runs_to_its_end():
    accelerator = _Accelerator(2)
    for batch in range(25):
        preemption.stop_evaluation(accelerator, batch)
    preemption.stop_evaluation(accelerator)
    assert len(accelerator.reductions) == 4  # batches 0, 10, 20, and after the last
