"""On 2 gloo processes, a stop signal that only one rank received stops both at the same agreed step."""

import os
import signal

from runner.engine import Accelerator
from runner.training import preemption


def _stop_steps(signal_steps):
    """For each step at which rank 1 signals itself: the step at which this rank stops, and what it received."""
    accelerator = Accelerator()
    preemption.watch()
    outcomes = []
    for signal_step in signal_steps:
        preemption._received.clear()  # a fresh run in the same worker
        stop = None
        for step in range(1, 31):
            if accelerator.process_index == 1 and step == signal_step:
                os.kill(os.getpid(), signal.SIGUSR1)
            if preemption.agreed(accelerator, step):
                stop = step
                break
        outcomes.append((stop, preemption.received()))
    preemption.release()
    return outcomes


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(launch):
    rank_0, rank_1 = launch(_stop_steps, (3, 10, 11))
    assert rank_0 == [(10, None), (10, None), (20, None)]
    assert rank_1 == [(10, "SIGUSR1"), (10, "SIGUSR1"), (20, "SIGUSR1")]
