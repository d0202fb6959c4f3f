"""Stop cleanly when the cluster asks: SIGTERM, SIGUSR1 or SIGUSR2 -> one agreed step, one checkpoint, exit 75.

Slurm and most schedulers send SIGTERM (or a chosen signal, ``--signal``: SIGUSR2 is submitit's, unless
``SUBMITIT_PREEMPT_SIGNAL`` names another) some time before they kill a job. Every worker records such a signal
instead of dying; at optimizer step boundaries (every 10th with several processes, see :func:`agreed`) the ranks
reduce the flag, so all of them stop at the same step, save the same checkpoint, and the run exits with
:data:`EXIT_CODE` (75, EX_TEMPFAIL: "try again later").
``python -m runner resume=<run folder>`` then continues exactly. A second signal during the save is
ignored; a kill during it leaves the previous checkpoint intact (checkpoints commit atomically).

Inside a job submitit started (``hydra/launcher=slurm``), submitit's own handler for its signal would requeue the
job at once, in the middle of a step or of a save. The runner takes the signal over and keeps that handler
(:func:`take_over`); once the checkpoint is saved, :func:`requeue` calls it, so submitit requeues the job as it
does for its own checkpointing jobs, counting ``max_num_timeout``, and the requeued job continues from the
checkpoint.

``RUNNER_STOP_AT_STEP=K`` stops a run the same way at optimizer step K, without a signal: what ``runner
check-resume`` cuts its interrupted run with (every process reaches step K, so they agree without a collective).

An evaluation (``runner eval``) saves nothing, and writes its results only at its end: it stops at the next
batch the processes agree on (:func:`stop_evaluation` raises :class:`EvaluationStopped`), before anything is
written, with the same exit code.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

EXIT_CODE = 75
SUBMITIT_SIGNAL_ENV = "SUBMITIT_PREEMPT_SIGNAL"  # submitit's choice of signal, read by submitit as by the runner
STOP_AT_STEP_ENV = "RUNNER_STOP_AT_STEP"  # stop as if preempted at this optimizer step (runner check-resume's cut)


def _signals() -> tuple[signal.Signals, ...]:
    chosen = getattr(signal, "SIG" + os.environ.get(SUBMITIT_SIGNAL_ENV, "USR2"), signal.SIGUSR2)
    return tuple(dict.fromkeys((signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, chosen)))


SIGNALS = _signals()
logger = logging.getLogger("runner")
_received: list[str] = []
_submitit: dict[int, Callable[[int, Any], None]] = {}  # signal -> submitit's handler for it, taken over


class Preempted(Exception):
    """The run stopped at an agreed step after a stop signal, with a checkpoint saved."""

    def __init__(self, signal_name: str, step: int) -> None:
        super().__init__(f"stopped by {signal_name} at step {step}")
        self.signal_name = signal_name
        self.step = step


class EvaluationStopped(Preempted):
    """``runner eval`` stopped at a batch after a stop signal, before it wrote anything: the run is as it was."""

    def __init__(self, signal_name: str) -> None:
        Exception.__init__(self, f"the evaluation stopped by {signal_name} before writing its results")
        self.signal_name = signal_name
        self.step = -1  # no training step: nothing was trained or saved


def watch() -> None:
    """Record SIGTERM and SIGUSR1 from now on instead of dying (main thread only; idempotent)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for number in SIGNALS:
        take_over(number, _record)


def take_over(number: int, handler: Callable[[int, Any], None]) -> Any:
    """Handle signal ``number`` with ``handler`` from now on, keeping submitit's own handler for it if it had one
    (for :func:`requeue`); return the previous handler."""
    previous = signal.signal(number, handler)
    if getattr(previous, "__name__", "") == "checkpoint_and_try_requeue" and type(
        getattr(previous, "__self__", None)
    ).__module__.startswith("submitit."):
        _submitit[number] = previous
    return previous


def submitit_requeues(stop: Preempted) -> bool:
    """Whether submitit's handler was taken over for the signal that stopped the run (see :func:`requeue`)."""
    return getattr(signal.Signals, stop.signal_name, None) in _submitit


def requeue(stop: Preempted) -> str | None:
    """Hand a stop by submitit's signal to submitit, once the checkpoint is saved: it requeues the job and this
    process exits (with :data:`EXIT_CODE`) when ``max_num_timeout`` allows. Returns None where submitit leaves the
    requeue to the job's first task (this is another), else why submitit did not requeue the job.

    Call it only where :func:`submitit_requeues`; a SIGTERM (``scancel``, ``scontrol requeue``, a preemption with
    a grace time) is Slurm's own doing, and Slurm requeues or ends the job itself.
    """
    number = signal.Signals[stop.signal_name]
    try:
        _submitit[number](number, None)  # checkpoints the submission through the launcher, scontrol requeue, exit
    except SystemExit:
        raise SystemExit(EXIT_CODE) from None
    except Exception as error:  # submitit's UncompletedJobError: "Job not requeued because: ..."
        return str(error).rstrip(".")
    return None


def _record(number: int, frame) -> None:
    name = signal.Signals(number).name
    if not _received:
        logger.warning("Received %s: stopping at the next step boundary, after a checkpoint", name)
    _received.append(name)


def release() -> None:
    """Let stop signals end the process again (once the checkpoint is safe)."""
    if threading.current_thread() is threading.main_thread():
        for number in SIGNALS:
            signal.signal(number, signal.SIG_DFL)


def received() -> str | None:
    """The first stop signal this process received, if any."""
    return _received[0] if _received else None


def agreed(accelerator, step: int, every: int = 10) -> bool:
    """Whether any process received a stop signal. Every process calls it at the same steps.

    Alone, a process looks at its own flag each step. Several reduce theirs every ``every`` steps
    only: the reduction reads a value back from the device, which would stall a GPU each step.
    """
    if accelerator.num_processes == 1:
        return bool(_received)
    if step % every:
        return False
    import torch

    flag = torch.tensor([float(bool(_received))], device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum").item())


def cut_at(step: int) -> bool:
    """Whether ``RUNNER_STOP_AT_STEP`` names this optimizer step: the run stops here as if preempted (every process
    reaches the step, so every one answers alike)."""
    if os.environ.get(STOP_AT_STEP_ENV) != str(step):
        return False
    if not _received:
        _received.append(f"{STOP_AT_STEP_ENV}={step}")
    return True


def stop_evaluation(accelerator, batch: int | None = None) -> None:
    """Raise :class:`EvaluationStopped` if any process received a stop signal, during ``runner eval``'s evaluation.

    Every process calls it at the same batches, as :func:`agreed`: before each ``batch`` (several processes agree
    every 10th), and with ``batch=None`` once after the last, where every process looks (a signal that came
    during the last batches still stops the evaluation before its results are written).
    """
    if agreed(accelerator, batch or 0, every=1 if batch is None else 10):
        raise EvaluationStopped(received() or "a peer's signal")
