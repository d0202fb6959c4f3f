"""Stop cleanly when the cluster asks: SIGTERM or SIGUSR1 -> one agreed step, one checkpoint, exit 75.

Slurm and most schedulers send SIGTERM (or a chosen signal such as SIGUSR1, ``--signal``) some time
before they kill a job. Every worker records such a signal instead of dying; at optimizer step
boundaries (every 10th with several processes, see :func:`agreed`) the ranks reduce the flag, so all
of them stop at the same step, save the same checkpoint, and the run exits with :data:`EXIT_CODE`
(75, EX_TEMPFAIL: "try again later").
``python -m runner resume=<run folder>`` then continues exactly. A second signal during the save is
ignored; a kill during it leaves the previous checkpoint intact (checkpoints commit atomically).

An evaluation (``runner eval``) saves nothing, and writes its results only at its end: it stops at the next
batch the processes agree on (:func:`stop_evaluation` raises :class:`EvaluationStopped`), before anything is
written, with the same exit code.
"""

from __future__ import annotations

import logging
import signal
import threading

EXIT_CODE = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
logger = logging.getLogger("runner")
_received: list[str] = []


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
        signal.signal(number, _record)


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


def stop_evaluation(accelerator, batch: int | None = None) -> None:
    """Raise :class:`EvaluationStopped` if any process received a stop signal, during ``runner eval``'s evaluation.

    Every process calls it at the same batches, as :func:`agreed`: before each ``batch`` (several processes agree
    every 10th), and with ``batch=None`` once after the last, where every process looks (a signal that came
    during the last batches still stops the evaluation before its results are written).
    """
    if agreed(accelerator, batch or 0, every=1 if batch is None else 10):
        raise EvaluationStopped(received() or "a peer's signal")
