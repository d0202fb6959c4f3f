"""Accelerator behaviour that needs a real process group: ordering, options, RNG sync, fp16 with DDP."""

import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from runner.engine import Accelerator, DistributedDataParallelKwargs, GeneralTracker, GradScalerKwargs
from runner.engine.utils import ProfileKwargs
from tests.helpers import train


class _EveryRank(GeneralTracker):
    """A tracker that asks to run on every process, not only the main one."""

    name = "every_rank"
    main_process_only = False

    def __init__(self):
        super().__init__()
        self.logged = []

    def log(self, values, step=None, **kwargs):
        self.logged.append((step, values))


def _trackers(folder: str) -> dict:
    every = _EveryRank()
    accelerator = Accelerator(project_dir=folder, log_with=["csv", every])
    accelerator.init_trackers("", config={"seed": 1})
    accelerator.log({"loss": 1.0 + accelerator.process_index}, step=1)
    started = [tracker.name for tracker in accelerator.trackers]
    csv_here = type(accelerator.get_tracker("csv")).__name__  # flushes: what was logged has arrived
    accelerator.end_training()
    return {"started": started, "every_rank": every.logged, "csv": csv_here}


def _behaviour(marker_dir):
    accelerator = Accelerator(
        rng_types=["torch"],
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
    )
    rank = accelerator.process_index
    marker = Path(marker_dir) / "written-by-main"
    with accelerator.main_process_first():
        if accelerator.is_main_process:
            time.sleep(0.5)  # a slow download; the other rank must wait for it
            marker.write_text("done")
        main_first = marker.exists()

    model = accelerator.prepare(nn.Linear(2, 2))
    torch.manual_seed(100 + rank)  # diverge, then let the loader's epoch start re-synchronise
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(4)), batch_size=1))
    next(iter(loader))
    synced_draw = torch.rand(2)

    traces = Path(marker_dir) / "traces"
    with accelerator.profile(ProfileKwargs(activities=["cpu"], output_trace_dir=traces)):
        nn.Linear(2, 2)(torch.ones(1, 2))
    traces_on_exit = sorted(path.name for path in traces.iterdir())  # every rank's, once profile() has returned

    fp16 = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=256.0)])
    weights = train(fp16, batch_size=4, epochs=3)
    return {
        "trackers": _trackers(str(Path(marker_dir) / "tracked")),
        "main_first": main_first,
        "find_unused": model.find_unused_parameters,
        "synced_draw": synced_draw,
        "fp16_weights": weights,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "local_main": accelerator.is_local_main_process,
        "traces_on_exit": traces_on_exit,
    }


def test_accelerator_behaviour_on_two_processes(launch, tmp_path):
    rank0, rank1 = launch(_behaviour, str(tmp_path))
    assert rank0["main_first"] and rank1["main_first"]
    assert rank0["find_unused"] and rank1["find_unused"]
    assert torch.equal(rank0["synced_draw"], rank1["synced_draw"])
    for key, value in rank0["fp16_weights"].items():
        assert torch.equal(value, rank1["fp16_weights"][key]), key  # DDP keeps replicas identical under fp16
        assert torch.isfinite(value).all()
    assert (rank0["local_rank"], rank0["local_main"], rank1["local_rank"], rank1["local_main"]) == (0, True, 1, False)
    assert rank0["traces_on_exit"] == rank1["traces_on_exit"] == ["profile_0.json", "profile_1.json"]
    # Trackers run on the main process, and on every process those whose class says main_process_only = False;
    # elsewhere get_tracker gives a stand-in that does nothing.
    assert rank0["trackers"] == {
        "started": ["csv", "every_rank"],
        "every_rank": [(1, {"loss": 1.0})],
        "csv": "CSVTracker",
    }
    assert rank1["trackers"] == {"started": ["every_rank"], "every_rank": [(1, {"loss": 2.0})], "csv": "_BlankTracker"}
    assert (tmp_path / "tracked" / "metrics.csv").read_text().splitlines() == ["step,loss", "1,1.0"]
