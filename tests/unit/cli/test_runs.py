import json
import os
import signal
import struct
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from runner.cli.runs import USAGE, main, read_query
from runner.launch.lock import RunLock

OBJECTIVE = {"name": "eval/accuracy", "direction": "maximize"}


def _local(when: str) -> datetime:
    """A local time, as run.log writes it."""
    return datetime.fromisoformat(when)


def _run(
    folder: Path,
    *,
    started: str,
    messages: list[str],
    seconds: float = 60,
    metrics: dict | None = None,
    overrides: tuple[str, ...] | list[str] = (),
    attempts: int = 1,
    objective: tuple[str, str] = ("eval/accuracy", "maximize"),
    lr: float = 0.001,
) -> Path:
    """A run folder as the runner leaves it: run.log (its first line at ``started``, local time, the others
    ``seconds`` later; the file itself written now, as a copy is), .hydra/, one provenance record per launch, and
    metrics.json when given."""
    (folder / ".hydra").mkdir(parents=True)
    config = {
        "seed": 42,
        "objective": {"metric": objective[0], "direction": objective[1]},
        "trainer": {"max_steps": 6, "mixed_precision": "no", "compile": False},
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": lr},
        "data": {"train_split": "test[:512]"},
    }
    (folder / ".hydra" / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
    OmegaConf.save(OmegaConf.create(list(overrides)), folder / ".hydra" / "overrides.yaml")
    start = _local(started).timestamp()
    first, later = (datetime.fromtimestamp(when).strftime("%Y-%m-%d %H:%M:%S") for when in (start, start + seconds))
    lines = [f"[{first},000][runner][INFO] - Running recipe supervised on Accelerator(distributed_type=NO, "
             "num_processes=1)\n", *(f"[{later},000][runner][INFO] - {line}\n" for line in messages)]  # fmt: skip
    (folder / "run.log").write_text("".join(lines))
    if attempts:
        (folder / "provenance").mkdir()
        for number in range(1, attempts + 1):
            record = {"attempt": number, "started_at": _local(started).astimezone().isoformat(), "seed": 42,
                      "overrides": list(overrides), "resume": None if number == 1 else str(folder)}  # fmt: skip
            (folder / "provenance" / f"attempt_{number}.json").write_text(json.dumps(record))
    if metrics is not None:
        (folder / "metrics.json").write_text(json.dumps(metrics))
    return folder


def _job(sweep: Path, number: int, *, status: str, lr: str, started: str, seconds: float, **extra) -> Path:
    """A sweep job's folder: a run folder with its job.json."""
    overrides = ["experiment=mnist", f"optimizer.lr={lr}"]
    folder = _run(sweep / str(number), started=started, messages=extra.pop("messages", []), seconds=seconds,
                  metrics=extra.pop("metrics", None), overrides=overrides, lr=float(lr))  # fmt: skip
    ended = datetime.fromtimestamp(_local(started).timestamp() + seconds).astimezone().isoformat()
    record = {"overrides": overrides, "status": status, "project_dir": str(folder), "objective": OBJECTIVE,
              "started_at": _local(started).astimezone().isoformat(), "ended_at": ended, **extra}  # fmt: skip
    (folder / "job.json").write_text(json.dumps(record))
    return folder


def _grid(sweep: Path, task: list[str]) -> None:
    """The multirun.yaml of a grid sweep of ``task`` (the overrides typed)."""
    sweeper = {"_target_": "hydra_plugins.runner_sweeper.resumable.ResumableSweeper", "params": None}
    OmegaConf.save(
        OmegaConf.create({"hydra": {"sweeper": sweeper, "overrides": {"task": task}}}), sweep / "multirun.yaml"
    )


def _checkpoint(folder: Path, *, step: int) -> None:
    """A complete checkpoint of a model alone, saved at ``step`` (its files are stand-ins: only sizes are read)."""
    from runner.engine.checkpoint.manifest import write_manifest

    folder.mkdir(parents=True)
    for name in ("model.safetensors", "random_states_0.pt"):
        (folder / name).write_bytes(b"\0" * 8)
    contents = {"models": 1, "optimizers": 0, "schedulers": 0, "custom_objects": 0, "dataloaders": 0}
    write_manifest(folder, world_size=1, iteration=1, state_format="safetensors", metadata={"step": step, "epoch": 0},
                   contents={**contents, "scaler": False, "gradients": False})  # fmt: skip


def _step(step: int, accuracy: float) -> str:
    return f"step {step}/6 | eval/loss 2.024 | eval/accuracy {accuracy}"


def _five_runs(outputs: Path) -> Path:
    """One run of each status but running (the test holds that one's lock): newest first, live, done, broken, cut,
    killed."""
    _run(outputs / "2026-12-07" / "05-00-00", started="2026-12-07 05:00:00", messages=[_step(2, 0.2)], seconds=30,
         overrides=["experiment=mnist_ddp"])  # fmt: skip
    _run(outputs / "2026-12-07" / "04-00-00", started="2026-12-07 04:00:00", overrides=["experiment=mnist"],
         messages=[_step(6, 0.365), "Finished at step 6 in 8.9 s: eval/accuracy=0.365, eval/loss=2.024."],
         metrics={"eval/accuracy": 0.365, "eval/loss": 2.024, "step": 6, "wall_time_s": 8.564})  # fmt: skip
    _run(outputs / "broken", started="2026-12-07 03:00:00", seconds=45, messages=[
        _step(3, 0.3), "Failed: Worker rank 0 failed: RuntimeError: boom", "The run failed after 45.0 s.",
        f"Run folder: {outputs / 'broken'}; newest checkpoint: no complete checkpoint.",
    ])  # fmt: skip
    cut = _run(outputs / "cut", started="2026-12-06 02:00:00", seconds=62, messages=[
        _step(2, 0.33), "Stopped after 1 min 02 s: stopped by SIGTERM at a step all processes agreed on; checkpoint_1 "
        "is saved; continue with `python -m runner resume=cut` (exit code 75).",
    ])  # fmt: skip
    _checkpoint(cut / "checkpoints" / "checkpoint_1", step=4)  # saved as it stopped, after the last step logged
    _run(outputs / "killed", started="2026-12-05 01:00:00", seconds=10, messages=[_step(1, 0.1)], attempts=0)
    return outputs / "2026-12-07" / "05-00-00"


def _sweep(outputs: Path) -> Path:
    """A grid sweep of four jobs: two finished, one failed, one not started."""
    sweep = outputs / "lr_sweep"
    sweep.mkdir(parents=True)
    _grid(sweep, ["experiment=mnist", "optimizer.lr=0.001,0.003,0.01,0.03"])
    _job(sweep, 0, status="finished", lr="0.001", started="2026-12-06 10:00:00", seconds=20, wall_time_s=20.0,
         messages=[_step(6, 0.5)], metrics={"eval/accuracy": 0.5, "step": 6, "wall_time_s": 19.0})  # fmt: skip
    _job(sweep, 1, status="finished", lr="0.003", started="2026-12-06 10:00:30", seconds=25, wall_time_s=25.0,
         messages=[_step(6, 0.7)], metrics={"eval/accuracy": 0.7, "step": 6, "wall_time_s": 24.0})  # fmt: skip
    _job(sweep, 2, status="failed", lr="0.01", started="2026-12-06 10:01:00", seconds=5, wall_time_s=5.0,
         messages=[_step(2, 0.1)], error="Worker rank 0 failed: RuntimeError: boom")  # fmt: skip
    return sweep


def _listed(capsys, *argv: str) -> list[str]:
    """What ``runner runs *argv`` prints, line by line (it exits 0 and says nothing on stderr)."""
    assert main(list(argv)) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out.splitlines()


def _refused(capsys, *argv: str) -> str:
    """What ``runner runs *argv`` says on stderr, exiting 2 and printing nothing."""
    assert main(list(argv)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


def test_every_status_newest_first_with_step_objective_duration_and_resumes(tmp_path, capsys):
    live = _five_runs(tmp_path)
    lock = RunLock(live).acquire()
    try:
        rows = _listed(capsys, str(tmp_path))
        running = _listed(capsys, str(tmp_path), "--status", "running")
    finally:
        lock.release()
    assert rows == [
        "folder               experiment  status       step  objective      last   best   duration    resumes",
        "2026-12-07/05-00-00  mnist_ddp   running      2/6   eval/accuracy  0.2    -      30.0 s      0",
        "2026-12-07/04-00-00  mnist       finished     6/6   eval/accuracy  0.365  0.365  8.6 s       0",
        "broken               -           failed       3/6   eval/accuracy  0.3    -      45.0 s      0",
        "cut                  -           preempted    4/6   eval/accuracy  0.33   -      1 min 02 s  0",
        "killed               -           interrupted  1/6   eval/accuracy  0.1    -      10.0 s      0",
    ]
    assert running == [
        "folder               experiment  status   step  objective      last  best  duration  resumes",
        "2026-12-07/05-00-00  mnist_ddp   running  2/6   eval/accuracy  0.2   -     30.0 s    0",
    ]
    assert main([str(tmp_path), "--status", "running"]) == 0  # its lock is free again: it was interrupted
    assert capsys.readouterr().err == f"runner: no run under {tmp_path} passes the filters.\n"
    assert [row.split()[0] for row in _listed(capsys, str(tmp_path), "--status=interrupted,preempted")] == [
        "folder", "2026-12-07/05-00-00", "cut", "killed",
    ]  # fmt: skip


def test_the_last_launch_decides_a_runs_status_and_each_launch_after_the_first_is_a_resume(tmp_path, capsys):
    failed_then_finished = [
        _step(3, 0.3), "Failed: Worker rank 0 failed: RuntimeError: boom", "The run failed after 5.0 s.",
        "Running recipe supervised on Accelerator(distributed_type=NO, num_processes=1)",
        "Resumed at step 3 (epoch 0) from /runs/a/checkpoints/checkpoint_0", _step(6, 0.4), "Finished at step 6.",
    ]  # fmt: skip
    _run(tmp_path / "a", started="2026-12-07 03:00:00", messages=failed_then_finished, attempts=2,
         metrics={"eval/accuracy": 0.4, "step": 6, "wall_time_s": 12.0})  # fmt: skip
    finished_then_failed = [  # metrics.json is the first launch's: the second one failed
        _step(6, 0.4), "Finished at step 6.", "Resumed at step 6 (epoch 0) from /runs/b",
        "step 8/8 | eval/loss 1.9 | eval/accuracy 0.5", "Failed: Worker rank 1 failed: RuntimeError: boom",
    ]  # fmt: skip
    _run(tmp_path / "b", started="2026-12-07 02:00:00", messages=finished_then_failed, attempts=3,
         metrics={"eval/accuracy": 0.4, "step": 6, "wall_time_s": 12.0})  # fmt: skip
    stopped_then_killed = [  # written before provenance/ was kept: run.log counts its resumes
        _step(2, 0.2), "Stopped after 4.0 s: stopped by SIGTERM at a step all processes agreed on; ...",
        "Resumed at step 2 (epoch 0) from /runs/c", _step(4, 0.3), "Stopped after 4.0 s: stopped by SIGTERM ...",
        "Running recipe supervised on Accelerator(distributed_type=NO, num_processes=1)",
        "Resumed at step 4 (epoch 0) from /runs/c", _step(5, 0.35),
    ]  # fmt: skip
    _run(tmp_path / "c", started="2026-12-07 01:00:00", messages=stopped_then_killed, attempts=0, seconds=90)
    assert _listed(capsys, str(tmp_path)) == [
        "folder  experiment  status       step  objective      last  best  duration    resumes",
        "a       -           finished     6/6   eval/accuracy  0.4   0.4   12.0 s      1",
        "b       -           failed       8/8   eval/accuracy  0.4   0.4   12.0 s      2",
        "c       -           interrupted  5/6   eval/accuracy  0.35  -     1 min 30 s  2",
    ]


SWEEP_ROW = "lr_sweep  mnist       2 finished, 1 failed, 1 pending  -     eval/accuracy  -     0.7   1 min 05 s  0"
SWEEP_JOBS = [
    "  lr_sweep/0  mnist       finished                         6/6   eval/accuracy  0.5   0.5   20.0 s      0",
    "  lr_sweep/1  mnist       finished                         6/6   eval/accuracy  0.7   0.7   25.0 s      0",
    "  lr_sweep/2  mnist       failed                           2/6   eval/accuracy  0.1   -     5.0 s       0",
    "  lr_sweep/3  mnist       pending                          -     -              -     -     -           0",
]


def test_a_sweep_is_one_row_that_expands_into_its_jobs(tmp_path, capsys):
    sweep = _sweep(tmp_path)
    _run(tmp_path / "single", started="2026-12-06 09:00:00", messages=[_step(6, 0.8)],
         metrics={"eval/accuracy": 0.8, "step": 6, "wall_time_s": 7.5})  # fmt: skip
    assert _listed(capsys, str(tmp_path)) == [  # the sweep started last: first
        "folder    experiment  status                           step  objective      last  best  duration    resumes",
        SWEEP_ROW,
        "single    -           finished                         6/6   eval/accuracy  0.8   0.8   7.5 s       0",
    ]
    expanded = _listed(capsys, str(tmp_path), "--expand")
    assert expanded == [
        "folder        experiment  status                           step  objective      last  best  duration    "
        "resumes",
        SWEEP_ROW.replace("lr_sweep  ", "lr_sweep      "),
        *SWEEP_JOBS,
        "single        -           finished                         6/6   eval/accuracy  0.8   0.8   7.5 s       0",
    ]
    assert _listed(capsys, str(sweep)) == expanded[:-1]  # a sweep named: expanded, whatever the folder around it


def test_filters_on_status_start_and_config_keep_a_sweep_with_the_jobs_that_pass(tmp_path, capsys):
    _sweep(tmp_path)
    _run(tmp_path / "single", started="2026-12-07 09:00:00", messages=[_step(6, 0.8)], lr=0.01,
         overrides=["experiment=mnist_ddp"], metrics={"eval/accuracy": 0.8, "step": 6, "wall_time_s": 7.5})  # fmt: skip
    _run(tmp_path / "older", started="2026-12-01 09:00:00", messages=[_step(6, 0.6)], lr=0.003,
         metrics={"eval/accuracy": 0.6, "step": 6, "wall_time_s": 7.5})  # fmt: skip

    def names(*argv: str) -> list[str]:
        assert main([str(tmp_path), "--expand", *argv]) == 0
        captured = capsys.readouterr()
        listed = [row.split()[0] for row in captured.out.splitlines()[1:]]
        assert captured.err == ("" if listed else f"runner: no run under {tmp_path} passes the filters.\n")
        return listed

    assert names() == ["single", "lr_sweep", "lr_sweep/0", "lr_sweep/1", "lr_sweep/2", "lr_sweep/3", "older"]
    assert names("--status", "failed") == ["lr_sweep", "lr_sweep/2"]
    assert names("--status", "finished", "--status", "pending") == [
        "single", "lr_sweep", "lr_sweep/0", "lr_sweep/1", "lr_sweep/3", "older",
    ]  # fmt: skip
    assert names("optimizer.lr=3e-3") == ["lr_sweep", "lr_sweep/1", "older"]  # 3e-3 is 0.003, as a number
    assert names("optimizer.lr=0.001,0.01") == ["single", "lr_sweep", "lr_sweep/0", "lr_sweep/2"]
    assert names("optimizer.lr=0.003", "--status=failed") == []  # no job passes both
    assert names("experiment=mnist_ddp") == ["single"]
    every_config = ['data.train_split="test[:512]"', "trainer.compile=false", "optimizer._target_=torch.optim.AdamW"]
    assert names(*every_config) == ["single", "lr_sweep", "lr_sweep/0", "lr_sweep/1", "lr_sweep/2", "older"]
    assert names("trainer.no_such_key=1") == [] and names("trainer.no_such_key=null") == []
    assert names("--since", "2026-12-06") == ["single", "lr_sweep", "lr_sweep/0", "lr_sweep/1", "lr_sweep/2"]
    assert names("--since", "2026-12-06T10:00:30") == ["single", "lr_sweep", "lr_sweep/1", "lr_sweep/2"]
    now = datetime.fromisoformat("2026-12-07 09:30:00").timestamp()
    assert read_query(["--since", "2d"], now=now).since == now - 2 * 86400
    assert read_query(["--since=90m"], now=now).since == now - 90 * 60
    assert read_query(["--since", "1.5h"], now=now).since == now - 5400


def test_json_lists_each_row_and_a_sweeps_jobs(tmp_path, capsys):
    _sweep(tmp_path)
    listed = json.loads("\n".join(_listed(capsys, str(tmp_path), "--json", "--status", "failed")))
    started = datetime.fromisoformat("2026-12-06 10:00:00").astimezone().isoformat()
    keys = ("folder", "kind", "status", "best", "started_at", "duration_s", "jobs_by_status")
    assert [{key: row[key] for key in keys} for row in listed] == [{
        "folder": str(tmp_path / "lr_sweep"), "kind": "sweep", "status": "2 finished, 1 failed, 1 pending",
        "best": 0.7, "started_at": started, "duration_s": 65.0,
        "jobs_by_status": {"finished": 2, "failed": 1, "pending": 1},
    }]  # fmt: skip
    assert listed[0]["jobs"] == [{
        "folder": str(tmp_path / "lr_sweep" / "2"), "kind": "job", "experiment": "mnist", "status": "failed",
        "step": 2, "max_steps": 6, "objective": "eval/accuracy", "direction": "maximize", "last": 0.1, "best": None,
        "started_at": datetime.fromisoformat("2026-12-06 10:01:00").astimezone().isoformat(), "duration_s": 5.0,
        "resumes": 0,
    }]  # fmt: skip


def _events(logs: Path, tag: str, points: list[tuple[int, float]]) -> None:
    """A TensorBoard event file holding ``tag``'s ``points``, as TensorBoard's writer frames it."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    logs.mkdir(parents=True)
    with open(logs / "events.out.tfevents.1796613520.host.1.0", "wb") as file:
        for step, value in points:
            summary = Summary(value=[Summary.Value(tag=tag, simple_value=value)])
            data = Event(step=step, wall_time=1796613520.0 + step, summary=summary).SerializeToString()
            header = struct.pack("<Q", len(data))
            file.write(
                header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))
            )


def test_last_and_best_come_from_the_logged_curve_in_the_objectives_direction(tmp_path, capsys):
    run = _run(tmp_path / "run", started="2026-12-07 03:00:00", objective=("eval/loss", "minimize"),
               messages=["step 6/6 | eval/loss 1.7"], seconds=20)  # fmt: skip
    _events(run / "logs", "eval/loss", [(2, 2.0), (4, 1.5), (6, 1.7)])
    (run / ".hydra" / "hydra.yaml").write_text(json.dumps({"hydra": {"runtime": {"choices": {"experiment": "gpt"}}}}))
    assert _listed(capsys, str(run)) == [  # a run folder named: its own row; the experiment is Hydra's choice
        "folder  experiment  status       step  objective  last  best  duration  resumes",
        "run     gpt         interrupted  6/6   eval/loss  1.7   1.5   20.0 s    0",
    ]


def test_a_missing_folder_a_folder_without_runs_and_bad_arguments_get_one_sentence(tmp_path, capsys):
    usage = "pass a folder of runs, a run folder or a sweep folder."
    assert _refused(capsys, str(tmp_path / "missing")) == (
        f"runner: error: {tmp_path / 'missing'} is not a folder; pass a folder of runs (outputs/ by default), a run "
        "folder or a sweep folder.\n"
    )
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("nothing here")
    assert _refused(capsys, str(tmp_path)) == (
        f"runner: error: {tmp_path} holds no run (run.log, checkpoints/, .hydra/) and no sweep (multirun.yaml, job "
        f"folders); {usage}\n"
    )
    assert _refused(capsys, str(tmp_path), "--statuses", "failed") == (
        f"runner: error: --statuses is not an option of runner runs; {USAGE}\n"
    )
    assert _refused(capsys, "--status", "done") == (
        "runner: error: --status done is not a status; pass one or more of running, finished, failed, preempted, "
        "interrupted, pending (e.g. --status failed,preempted).\n"
    )
    assert _refused(capsys, "--status") == "runner: error: --status needs a value, e.g. --status failed.\n"
    assert _refused(capsys, "--since", "yesterday") == (
        "runner: error: --since yesterday is neither a date (2026-12-01, 2026-12-01T10:00) nor an age (30m, 3h, 2d, "
        "1w); pass one of those.\n"
    )
    assert _refused(capsys, str(tmp_path), str(tmp_path / "notes")) == (
        f"runner: error: runner runs lists one folder, and {tmp_path / 'notes'} is a second one; list each in its own "
        "command.\n"
    )
    assert _refused(capsys, "~optimizer.lr") == (  # not a filter: a folder, and there is none of that name
        f"runner: error: {Path.cwd() / '~optimizer.lr'} is not a folder; pass a folder of runs (outputs/ by default), "
        "a run folder or a sweep folder.\n"
    )
    assert _refused(capsys, "+optimizer.lr=1") == (
        "runner: error: +optimizer.lr=1 is not a filter; filter on a key's value with key=value, e.g. "
        "optimizer.lr=0.001.\n"
    )


def test_the_default_folder_is_outputs_and_help_shows_the_usage(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _refused(capsys) == (
        f"runner: error: {tmp_path / 'outputs'} is not a folder; pass a folder of runs (outputs/ by default), a run "
        "folder or a sweep folder.\n"
    )
    _run(tmp_path / "outputs" / "2026-12-07" / "03-00-00", started="2026-12-07 03:00:00", messages=[_step(1, 0.1)])
    assert _listed(capsys)[1].startswith("2026-12-07/03-00-00  -           interrupted  1/6")
    assert main(["--help"]) == 0
    helped = capsys.readouterr().out
    assert helped.startswith(f"{USAGE}\n\n    runner runs\n") and "--since DATE|AGE" in helped


def test_a_reader_that_stops_early_ends_the_listing_quietly(tmp_path):
    for minute in range(3):
        _run(tmp_path / f"03-0{minute}-00", started=f"2026-12-07 03:0{minute}:00", messages=[_step(1, 0.1)])
    # The reader is gone before the command writes a line (runner runs | head, cut short): no traceback.
    listing = subprocess.Popen([sys.executable, "-m", "runner", "runs", "--json", str(tmp_path)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    listing.stdout.close()
    assert listing.wait(timeout=60) == -signal.SIGPIPE and listing.stderr.read() == b""


def test_links_are_never_followed(tmp_path, capsys):
    outputs, elsewhere = tmp_path / "outputs", tmp_path / "elsewhere"
    _run(outputs / "kept", started="2026-12-07 03:00:00", messages=[_step(1, 0.1)])
    linked = _run(outputs / "linked", started="2026-12-07 04:00:00", messages=[_step(1, 0.1)])
    _run(elsewhere / "run", started="2026-12-07 05:00:00", messages=[_step(1, 0.1)])
    (elsewhere / "metrics.json").write_text(json.dumps({"step": 6}))
    (linked / "metrics.json").symlink_to(elsewhere / "metrics.json")
    (outputs / "shortcut").symlink_to(elsewhere / "run")
    sentence = (
        f"{linked / 'metrics.json'} is a symbolic link (to {elsewhere / 'metrics.json'}); a run folder holds no links, "
        "so remove it or copy the run with links resolved (cp -rL)."
    )
    assert main([str(outputs)]) == 0
    captured = capsys.readouterr()
    assert [row.split()[0] for row in captured.out.splitlines()] == ["folder", "kept"]
    assert captured.err.splitlines() == [
        f"runner: skipped {outputs / 'shortcut'}: it is a symbolic link (to {elsewhere / 'run'}), not followed.",
        f"runner: skipped {linked}: {sentence}",
    ]
    assert _refused(capsys, str(linked)) == f"runner: error: {sentence}\n"  # the run named: refused


def test_a_sweep_job_runs_while_its_lock_is_held(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    job = _job(sweep, 0, status="running", lr="0.001", started="2026-12-07 03:00:00", seconds=40,
               messages=[_step(3, 0.3)])  # fmt: skip
    lock = RunLock(job).acquire()
    try:
        held = _listed(capsys, str(sweep))
    finally:
        lock.release()
    assert held == [
        "folder     experiment  status     step  objective      last  best  duration  resumes",
        "sweep      mnist       1 running  -     eval/accuracy  -     -     40.0 s    0",
        "  sweep/0  mnist       running    3/6   eval/accuracy  0.3   -     40.0 s    0",
    ]
    assert _listed(capsys, str(job)) == [  # its process is gone, and its record still says running
        "folder  experiment  status       step  objective      last  best  duration  resumes",
        "0       mnist       interrupted  3/6   eval/accuracy  0.3   -     40.0 s    0",
    ]


def test_a_moved_sweep_shows_its_own_values_and_never_reads_the_project_dir_its_records_name(tmp_path, capsys):
    import shutil

    sweep = _sweep(tmp_path / "before")
    moved = tmp_path / "after" / "lr_sweep"
    moved.parent.mkdir()
    shutil.move(sweep, moved)
    decoy = sweep / "1"  # where job 1's record says it ran: another run's folder now
    _run(decoy, started="2026-12-06 10:00:30", messages=[_step(6, 0.99)], metrics={"eval/accuracy": 0.99, "step": 6})
    _events(decoy / "logs", "eval/accuracy", [(6, 0.99)])
    assert _listed(capsys, str(moved)) == [
        "folder        experiment  status                           step  objective      last  best  duration    "
        "resumes",
        SWEEP_ROW.replace("lr_sweep  ", "lr_sweep      "),
        *SWEEP_JOBS,
    ]


def test_interpolations_in_a_sweeps_files_stay_text_and_nothing_is_resolved(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RUNNER_TEST_SECRET", raising=False)  # resolving it would fail
    sweep = _sweep(tmp_path)
    _grid(sweep, ["experiment=mnist", "optimizer.lr=0.001,0.003,0.01,${oc.env:RUNNER_TEST_SECRET}"])
    (sweep / "0" / ".hydra" / "overrides.yaml").write_text("- experiment=${oc.env:RUNNER_TEST_SECRET}\n")
    (sweep / "0" / "job.json").unlink()  # its overrides come from .hydra/overrides.yaml
    rows = _listed(capsys, str(sweep), "--json")
    jobs = json.loads("\n".join(rows))[0]["jobs"]
    assert [(job["folder"].rsplit("/", 1)[1], job["status"], job["experiment"]) for job in jobs] == [
        ("0", "interrupted", "${oc.env:RUNNER_TEST_SECRET}"), ("1", "finished", "mnist"), ("2", "failed", "mnist"),
        ("3", "pending", "mnist"),
    ]  # fmt: skip


def test_records_of_the_wrong_shape_get_no_traceback(tmp_path, capsys):
    sweep = _sweep(tmp_path)
    (sweep / "0" / "job.json").write_text("[1]")
    (sweep / "1" / "metrics.json").write_text("{cut short")
    (sweep / "2" / ".hydra" / "overrides.yaml").write_text("- [unclosed\n")
    (sweep / "2" / "provenance" / "attempt_1.json").write_text("not json")
    rows = _listed(capsys, str(sweep))
    assert [row.split()[:3] for row in rows[2:]] == [
        ["lr_sweep/0", "mnist", "interrupted"],  # its record unread: as a job that left none
        ["lr_sweep/1", "mnist", "finished"],
        ["lr_sweep/2", "-", "failed"],
        ["lr_sweep/3", "mnist", "pending"],
    ]


def test_one_sweep_that_cannot_be_read_is_skipped_with_a_note(tmp_path, capsys, monkeypatch):
    from runner.sweeps import report

    _sweep(tmp_path)
    broken = tmp_path / "broken_sweep"
    _job(broken, 0, status="finished", lr="0.1", started="2026-12-01 10:00:00", seconds=5)
    collect = report.collect

    def unreadable(folder, **options):
        if folder == broken:
            raise PermissionError(13, "Permission denied", str(broken / "0" / "logs"))
        return collect(folder, **options)

    monkeypatch.setattr(report, "collect", unreadable)
    assert main([str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert [row.split()[0] for row in captured.out.splitlines()] == ["folder", "lr_sweep"]
    assert captured.err == f"runner: skipped {broken}: {broken / '0' / 'logs'} cannot be read (Permission denied).\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="permission bits do not stop root from reading")
def test_a_folder_that_cannot_be_read_is_skipped_with_a_note(tmp_path, capsys):
    _run(tmp_path / "kept", started="2026-12-07 03:00:00", messages=[_step(1, 0.1)])
    closed = tmp_path / "closed"
    _run(closed / "inside", started="2026-12-07 04:00:00", messages=[_step(1, 0.1)])
    closed.chmod(0)
    try:
        assert main([str(tmp_path)]) == 0
        captured = capsys.readouterr()
    finally:
        closed.chmod(0o755)
    assert [row.split()[0] for row in captured.out.splitlines()] == ["folder", "kept"]
    assert captured.err == f"runner: skipped {closed}: it cannot be read (Permission denied).\n"


def test_a_run_begun_before_launch_records_counts_its_resumes_from_run_log(tmp_path, capsys):
    resumed = [_step(2, 0.2), "Resumed at step 2 (epoch 0) from /runs/old", _step(4, 0.3),
               "Resumed at step 4 (epoch 0) from /runs/old", _step(5, 0.35)]  # fmt: skip
    old = _run(tmp_path / "old", started="2026-12-07 01:00:00", messages=resumed, attempts=2, seconds=50)
    for number in (1, 2):  # records of its last two launches only: the first one predates them
        path = old / "provenance" / f"attempt_{number}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "resume": str(old)}))
    row = _listed(capsys, str(old))[1]
    assert row == "old     -           interrupted  5/6   eval/accuracy  0.35  -     50.0 s    2"


def test_the_duration_runs_to_the_last_line_of_run_log_whatever_the_files_time(tmp_path, capsys):
    run = _run(tmp_path / "copied", started="2026-12-07 01:00:00", messages=[_step(3, 0.3)], seconds=75)
    os.utime(run / "run.log", (2e9, 2e9))  # copied long after: the file's own time says nothing of the run
    row = _listed(capsys, str(run))[1]
    assert row == "copied  -           interrupted  3/6   eval/accuracy  0.3   -     1 min 15 s  0"


def test_hidden_folders_and_trees_of_code_are_not_searched(tmp_path, capsys):
    _run(tmp_path / "outputs" / "kept", started="2026-12-07 03:00:00", messages=[_step(1, 0.1)])
    for hidden in (".git/lfs", ".venv/lib", "src/__pycache__", "env/lib/python3.11/site-packages/pkg"):
        _run(tmp_path / hidden / "run", started="2026-12-07 04:00:00", messages=[_step(1, 0.1)])
    (tmp_path / "env" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    _run(tmp_path / "plainenv" / "run", started="2026-12-07 04:00:00", messages=[_step(1, 0.1)])
    (tmp_path / "plainenv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    assert [row.split()[0] for row in _listed(capsys, str(tmp_path))] == ["folder", "outputs/kept"]


def test_the_objective_alone_is_read_from_the_logs(tmp_path, capsys, monkeypatch):
    from runner.sweeps import report

    run = _run(tmp_path / "run", started="2026-12-07 03:00:00", messages=[_step(6, 0.5)], seconds=20)
    _events(run / "logs", "eval/accuracy", [(2, 0.4), (4, 0.6), (6, 0.5)])
    asked = []
    read_scalars = report.read_scalars
    monkeypatch.setattr(report, "read_scalars", lambda logs, **how: asked.append(how) or read_scalars(logs, **how))
    assert _listed(capsys, str(run))[1].split()[5:7] == ["0.5", "0.6"]
    assert asked == [{"tags": {"eval/accuracy"}}]


def test_a_folder_the_walk_cannot_open_is_skipped_with_a_note(tmp_path, capsys, monkeypatch):
    from runner.cli import runs

    _run(tmp_path / "kept", started="2026-12-07 03:00:00", messages=[_step(1, 0.1)])
    closed = tmp_path / "closed"
    closed.mkdir()
    scandir = os.scandir

    def refusing(path):
        if Path(path) == closed:
            raise PermissionError(13, "Permission denied", str(closed))
        return scandir(path)

    monkeypatch.setattr(runs.os, "scandir", refusing)
    assert main([str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert [row.split()[0] for row in captured.out.splitlines()] == ["folder", "kept"]
    assert captured.err == f"runner: skipped {closed}: it cannot be read (Permission denied).\n"
