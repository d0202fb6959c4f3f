"""Sweep records, plans and reports, on folders written by hand."""

import importlib.util
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from runner.config import ConfigError
from runner.config.check import check_plugins
from runner.launch.lock import RunLock, is_locked
from runner.sweeps import report
from runner.sweeps.job import record_ended
from runner.sweeps.jobs import read_job, read_submissions, record_submissions, swept_keys
from runner.sweeps.plan import contiguous, plan, still_in_slurm, submitted_line


def _job(folder: Path, overrides: list[str], status: str, **extra) -> Path:
    folder.mkdir(parents=True)
    record = {"overrides": overrides, "status": status, "project_dir": str(folder), **extra}
    (folder / "job.json").write_text(json.dumps(record))
    return folder


def test_swept_keys_are_the_keys_whose_values_differ():
    jobs = [["data.root=x", "lr=1", "bs=8"], ["data.root=x", "lr=2", "bs=8"], ["data.root=x", "lr=1", "bs=16"]]
    assert swept_keys(jobs) == ["lr", "bs"]
    assert swept_keys([["data.root=x", "lr=1"]]) == ["data.root", "lr"]  # one job: everything it was given
    assert swept_keys([["lr=1"], ["lr=1", "+extra=2"]]) == ["extra"]  # present in some jobs only
    assert swept_keys([["lr=1", "hydra.sweep.dir=a"], ["lr=2", "hydra.sweep.dir=a"]]) == ["lr"]


def test_contiguous_groups_keep_job_numbers():
    assert contiguous([0, 1, 3, 4, 5, 7]) == [[0, 1], [3, 4, 5], [7]]
    assert contiguous([]) == []


def test_plan_skips_finished_jobs_reruns_the_rest_and_flags_another_sweeps_folder(tmp_path):
    _job(tmp_path / "0", ["lr=1"], "finished")
    _job(tmp_path / "1", ["lr=2"], "failed", error="boom")
    _job(tmp_path / "2", ["lr=3"], "running")
    jobs = [(tmp_path / str(i), [f"lr={i + 1}"]) for i in range(4)]
    assert plan(jobs) == ([1, 2, 3], [])

    hydra_only = tmp_path / "4" / ".hydra"  # killed before the runner wrote its record: Hydra's says who it was
    hydra_only.mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(["lr=9"]), hydra_only / "overrides.yaml")
    run, problems = plan([*jobs, (tmp_path / "4", ["lr=5"])])
    assert run == [1, 2, 3] and problems == [f"{tmp_path / '4'} holds a job with overrides ['lr=9'], not ['lr=5']"]


def test_report_lists_pending_grid_jobs_and_tells_interrupted_from_running(tmp_path):
    _grid_sweep(tmp_path, ["trainer.max_steps=5", "optimizer.lr=1e-3,3e-3", "data.batch_size=16,32"])
    grid = [["trainer.max_steps=5", f"optimizer.lr={lr}", f"data.batch_size={bs}"]
            for lr in ("0.001", "0.003") for bs in ("16", "32")]  # fmt: skip
    objective = {"name": "eval/accuracy", "direction": "maximize"}
    done = _job(tmp_path / "0", grid[0], "finished", objective=objective, wall_time_s=12.5)
    (done / "metrics.json").write_text(json.dumps({"eval/accuracy": 0.75, "step": 5}))
    _job(tmp_path / "1", grid[1], "running", objective=objective)  # its process is gone: no lock held
    live = _job(tmp_path / "2", grid[2], "running", objective=objective)
    lock = RunLock(live).acquire()
    try:
        assert is_locked(live) and not is_locked(tmp_path / "1")
        jobs = report.write_summary(tmp_path, plot=False)
    finally:
        lock.release()
    assert [(job.name, job.status) for job in jobs] == [
        ("0", "finished"), ("1", "interrupted"), ("2", "running"), ("3", "pending"),
    ]  # fmt: skip
    assert jobs[3].overrides == grid[3]
    rows = (tmp_path / "summary.csv").read_text().splitlines()
    assert rows[0].startswith("job,status,optimizer.lr,data.batch_size,objective,eval/accuracy,step,best_step")
    assert rows[1].startswith("0,finished,0.001,16,eval/accuracy,0.75,5,,,12.5,")
    markdown = (tmp_path / "summary.md").read_text()
    assert "1 finished, 1 interrupted, 1 running, 1 pending." in markdown
    assert "Best: job 0 (optimizer.lr=0.001, data.batch_size=16), eval/accuracy 0.75." in markdown
    assert not (tmp_path / "summary.png").exists()


def test_report_command_refuses_a_folder_without_jobs_and_writes_nothing(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"runner.report: error: {tmp_path} holds no sweep jobs (no */job.json or */.hydra); pass a sweep folder.\n"
    )
    assert list(tmp_path.iterdir()) == []
    assert report.main([str(tmp_path / "missing")]) == 2


def test_read_scalars_keeps_the_last_value_logged_for_a_step(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    for values in ([(1, 3.0), (2, 2.0), (3, 9.0)], [(3, 1.5), (4, 1.0)]):  # a run, then its resumed part
        writer = SummaryWriter(str(tmp_path / "logs"))
        for step, value in values:
            writer.add_scalar("train/loss", value, step)
        writer.close()
    assert report.read_scalars(tmp_path / "logs") == {"train/loss": [(1, 3.0), (2, 2.0), (3, 1.5), (4, 1.0)]}
    assert report.read_scalars(tmp_path / "nothing") == {}


def test_read_scalars_drops_what_a_resume_from_an_earlier_step_purged(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    # A run logged to step 6; a resume from its checkpoint at step 3 purges the steps after it, as TensorBoard does.
    for purge, values in ((None, [(2, 3.0), (4, 2.0), (6, 1.0)]), (4, [(4, 2.5), (5, 2.25)])):
        writer = SummaryWriter(str(tmp_path / "logs"), purge_step=purge)
        for step, value in values:
            writer.add_scalar("train/loss", value, step)
            writer.add_scalar("eval/loss", value + 1, step)
        writer.close()
    logged = report.read_scalars(tmp_path / "logs")
    assert logged == {"train/loss": [(2, 3.0), (4, 2.5), (5, 2.25)], "eval/loss": [(2, 4.0), (4, 3.5), (5, 3.25)]}


@pytest.mark.parametrize(
    ("override", "extra"),
    [("hydra/launcher=joblib", "joblib"), ("hydra/launcher=slurm", "slurm"), ("hparams_search=mnist_optuna", "optuna")],
)
def test_an_option_whose_plugin_is_missing_names_the_extra_to_install(monkeypatch, override, extra):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError) as error:
        check_plugins(["optimizer.lr=1e-3", override])
    group, option = override.split("=")
    assert str(error.value).startswith(f"{group}={option} needs a Hydra plugin that is not installed (hydra_plugins.")
    assert str(error.value).endswith(f"install it with pip install -e '.[{extra}]'.")
    check_plugins(["hparams_search=null", "hydra/launcher=basic"])  # nothing needed


@pytest.mark.parametrize(
    ("overrides", "objective"),
    [
        ([], ("eval/accuracy", "maximize")),  # data=mnist declares accuracy and optimises it
        (["experiment=mnist_ddp"], ("eval/accuracy", "maximize")),
        (["experiment=shakespeare_gpt"], ("eval/loss", "minimize")),
        (["objective.metric=eval/loss", "objective.direction=minimize"], ("eval/loss", "minimize")),
    ],
)
def test_each_experiment_declares_its_objective_and_direction(overrides, objective):
    from hydra import compose, initialize_config_dir

    from runner.config import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    assert (cfg.objective.metric, cfg.objective.direction) == objective


def _logged(run: Path, *lines: str) -> None:
    """run.log as the runner writes it: one line per logged step."""
    (run / "run.log").write_text("".join(f"[2026-12-05 10:00:00,000][runner][INFO] - {line}\n" for line in lines))


def test_runner_status_shows_each_job_of_a_slurm_sweep_from_its_folder(tmp_path, capsys):
    from runner.cli.status import main as status

    _grid_sweep(tmp_path, ["trainer.max_steps=300", "optimizer.lr=1e-3,2e-3,3e-3,4e-3,5e-3"])
    (tmp_path / ".submitit" / "17").mkdir(parents=True)  # submitted through hydra/launcher=slurm
    grid = [["trainer.max_steps=300", f"optimizer.lr={lr}"] for lr in ("0.001", "0.002", "0.003", "0.004", "0.005")]
    objective = {"name": "eval/accuracy", "direction": "maximize"}
    done = _job(tmp_path / "0", grid[0], "finished", objective=objective)
    (done / "metrics.json").write_text(json.dumps({"eval/accuracy": 0.94, "train/loss": 0.03549, "step": 300}))
    _logged(
        done, "step 300/300 | train/loss 0.03549 | train/lr 0", "step 300/300 | eval/loss 0.2342 | eval/accuracy 0.94"
    )
    live = _job(tmp_path / "1", grid[1], "running", objective=objective)
    _logged(live, "step 100/300 | train/loss 0.3 | train/lr 0.001", "step 100/300 | eval/accuracy 0.87",
            "step 120/300 | train/loss 0.2104 | train/lr 0.0009")  # fmt: skip
    requeued = "stopped by SIGUSR2 at a step all processes agreed on; checkpoint_1 is saved; submitit requeues the " \
               "job, which continues from it."  # fmt: skip
    _logged(_job(tmp_path / "2", grid[2], "requeued", objective=objective, error=requeued),
            "step 125/300 | train/loss 0.1932 | train/lr 0.0008")  # fmt: skip
    _logged(_job(tmp_path / "3", grid[3], "failed", objective=objective, error="Worker rank 1 failed: boom"),
            "step 40/300 | train/loss 0.912 | train/lr 0.001")  # fmt: skip
    lock = RunLock(live).acquire()
    try:
        assert status([str(tmp_path)]) == 0
    finally:
        lock.release()
    assert capsys.readouterr().out.splitlines() == [
        "job  status    step     train/loss  eval/accuracy  detail",
        "0    finished  300/300  0.03549     0.94",
        "1    running   120/300  0.2104      0.87",
        f"2    requeued  125/300  0.1932      -              {requeued}",
        "3    failed    40/300   0.912       -              Worker rank 1 failed: boom",
        "4    queued    -        -           -              submitted to Slurm, not started yet",
    ]
    assert status([str(live)]) == 0  # a run folder: its own line, its lock now free and no metrics.json
    assert capsys.readouterr().out.splitlines() == [
        "run  status   step     train/loss  eval/accuracy  detail",
        "1    stopped  120/300  0.2104      0.87           no checkpoint was saved",
    ]
    (tmp_path / "0" / "run.log").rename(tmp_path / "elsewhere.log")
    (tmp_path / "0" / "run.log").symlink_to(tmp_path / "elsewhere.log")
    assert status([str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"runner: error: {tmp_path / '0' / 'run.log'} is a symbolic link")
    assert status([str(tmp_path / "nothing")]) == 2 and status([]) == 2


def test_the_last_job_of_a_grid_to_end_writes_the_plot_too(tmp_path):
    from runner.sweeps.summary import summarise

    _grid_sweep(tmp_path, ["optimizer.lr=1e-3,2e-3"])
    _job(tmp_path / "0", ["optimizer.lr=0.001"], "finished")
    summarise(tmp_path, plot=None)  # job 1 has not run yet: the table only
    assert (tmp_path / "summary.md").is_file() and not (tmp_path / "summary.png").exists()
    _job(tmp_path / "1", ["optimizer.lr=0.002"], "requeued", error="stopped by SIGUSR2 ...")
    summarise(tmp_path, plot=None)  # back in Slurm's queue: it will run again
    assert not (tmp_path / "summary.png").exists()
    (tmp_path / "1" / "job.json").write_text(json.dumps({"overrides": ["optimizer.lr=0.002"], "status": "failed"}))
    summarise(tmp_path, plot=None)
    assert (tmp_path / "summary.png").read_bytes().startswith(b"\x89PNG")


def test_the_slurm_job_each_job_was_submitted_as_is_recorded_in_the_sweep_folder(tmp_path):
    assert read_submissions(tmp_path) == {}
    record_submissions(tmp_path, {0: "17_0", 1: "17_1", 10: "17_2"}, at="2026-12-05T10:00:00.000+00:00")
    record_submissions(tmp_path, {1: "18"}, at="2026-12-05T11:00:00.000+00:00")  # job 1 submitted again
    assert read_submissions(tmp_path) == {
        0: {"slurm_job": "17_0", "submitted_at": "2026-12-05T10:00:00.000+00:00"},
        1: {"slurm_job": "18", "submitted_at": "2026-12-05T11:00:00.000+00:00"},
        10: {"slurm_job": "17_2", "submitted_at": "2026-12-05T10:00:00.000+00:00"},
    }
    assert list(json.loads((tmp_path / "slurm_jobs.json").read_text())) == ["0", "1", "10"]
    (tmp_path / "slurm_jobs.json").write_text("[1, 2]")
    assert read_submissions(tmp_path) == {}  # not a record of ours: nothing is known


def test_a_job_whose_slurm_job_is_still_queued_or_running_is_not_submitted_again():
    submissions = {number: {"slurm_job": job, "submitted_at": "t"} for number, job in
                   enumerate(["17_0", "17_1", "18", "19", "20", "21"])}  # fmt: skip
    states = {"17_0": "RUNNING", "17_1": "CANCELLED", "18": "PENDING", "19": "GONE", "20": "REQUEUED",
              "21": "COMPLETED"}  # fmt: skip
    assert still_in_slurm([0, 1, 2, 3, 4, 5, 6], submissions, states) == {
        0: ("17_0", "RUNNING"),
        2: ("18", "PENDING"),
        4: ("20", "REQUEUED"),
    }  # 1, 3 and 5 ended without finishing (or they would not be asked about), 6 was never submitted
    assert still_in_slurm([1, 3], submissions, states) == {}
    assert still_in_slurm([0], submissions, {}) == {}  # Slurm no longer lists it


def test_a_sweep_that_does_not_wait_says_what_it_submitted_and_how_to_follow_it(tmp_path):
    follow = (
        f"follow the sweep with `runner status {tmp_path}`; its summary ({tmp_path / 'summary.md'}) is complete when "
        "the last job ends."
    )
    assert submitted_line(tmp_path, submitted=["17_0", "17_1"], still=[]) == (
        f"runner: submitted 2 jobs to Slurm (17_0, 17_1) without waiting for them; {follow}"
    )
    assert submitted_line(tmp_path, submitted=["18"], still=[]) == (
        f"runner: submitted 1 job to Slurm (18) without waiting for it; {follow}"
    )
    assert submitted_line(tmp_path, submitted=[], still=["17_0"]) == (
        f"runner: submitted 0 jobs to Slurm (none) without waiting for them; 1 more still queued or running there "
        f"(17_0); {follow}"
    )


def test_a_job_slurm_ended_is_recorded_failed_unless_it_recorded_its_own_end(tmp_path):
    sentence = "Slurm ended job 17_0 as CANCELLED before it finished; ..."
    for status in ("finished", "failed"):
        _job(tmp_path / status, ["lr=1"], status, error="its own sentence" if status == "failed" else None)
        before = read_job(tmp_path / status)
        assert record_ended(tmp_path / status, ["lr=1"], sentence) == before == read_job(tmp_path / status)
    for status in ("running", "stopped", "requeued"):
        _job(tmp_path / status, ["lr=1"], status, error="stopped by SIGTERM ...", wall_time_s=12.5)
        record = record_ended(tmp_path / status, ["lr=1"], sentence)
        assert record == read_job(tmp_path / status)
        assert (record["status"], record["error"], record["wall_time_s"]) == ("failed", sentence, 12.5)
    record = record_ended(tmp_path / "never_started", ["lr=2"], sentence)  # cancelled in the queue: no folder yet
    assert (
        {k: v for k, v in read_job(tmp_path / "never_started").items() if k != "ended_at"}
        == {"overrides": ["lr=2"], "status": "failed", "error": sentence}
        == {k: v for k, v in record.items() if k != "ended_at"}
    )


def test_runner_status_shows_a_job_submitted_again_as_queued_until_it_starts(tmp_path, capsys):
    from runner.cli.status import main as status

    _grid_sweep(tmp_path, ["optimizer.lr=1e-3,2e-3,3e-3"])
    (tmp_path / ".submitit" / "17").mkdir(parents=True)
    earlier, later = "2026-12-05T10:00:00.000+00:00", "2026-12-05T11:00:00.000+00:00"
    _job(tmp_path / "0", ["optimizer.lr=0.001"], "failed", error="Slurm ended job 17_0 ...", ended_at=earlier)
    _job(tmp_path / "1", ["optimizer.lr=0.002"], "failed", error="Worker rank 1 failed: boom", ended_at=later)
    record_submissions(tmp_path, {0: "17_0", 1: "17_1", 2: "17_2"}, at=earlier)
    record_submissions(tmp_path, {0: "18_0", 2: "18_1"}, at="2026-12-05T10:30:00.000+00:00")
    assert status([str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "job  status  step  train/loss  detail",
        "0    queued  -     -           submitted to Slurm as job 18_0, not started yet",
        "1    failed  -     -           Worker rank 1 failed: boom",  # failed after its latest submission
        "2    queued  -     -           submitted to Slurm as job 18_1, not started yet",
    ]

    # Job 0 starts as runner status reads the sweep: the row is the record it read, not half of each.
    from runner.sweeps import report

    def starting(folder, read=report.read_job):
        record = read(folder)
        if folder.name == "0":
            started = {"overrides": ["optimizer.lr=0.001"], "status": "running", "project_dir": str(folder),
                       "started_at": "2026-12-05T12:00:00.000+00:00"}  # fmt: skip
            (folder / "job.json").write_text(json.dumps(started))
        return record

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(report, "read_job", starting)  # collect()'s read, after which the job writes its start
        assert status([str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "0    queued  -     -           submitted to Slurm as job 18_0, not started yet"
    )


def _grid_sweep(folder, task: list[str]) -> None:
    """The multirun.yaml the resumable sweeper saves for a grid sweep of ``task`` (the typed overrides)."""
    OmegaConf.save(
        OmegaConf.create({"hydra": {
            "sweeper": {"_target_": "hydra_plugins.runner_sweeper.resumable.ResumableSweeper", "params": None},
            "overrides": {"task": task},
        }}),
        folder / "multirun.yaml",
    )  # fmt: skip


def test_a_figure_title_is_wrapped_to_fit_its_figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from runner.sweeps.report import fitted_title

    title = "Sweep 10-49-55: eval/accuracy per parameter, and every job's train/loss"  # one swept key: one panel wide
    for wrap in (False, True):
        figure = plt.figure(figsize=(4.5, 7.5))
        text = fitted_title(title, figure) if wrap else title
        shown = figure.suptitle(text)
        figure.canvas.draw()
        box = shown.get_window_extent()
        fits = box.x0 >= 0 and box.x1 <= figure.bbox.width
        plt.close(figure)
        assert fits == wrap, text  # as given it is clipped at both edges; wrapped it fits


def test_a_moved_sweep_is_read_from_its_own_folders_never_from_the_project_dir_its_records_name(tmp_path):
    import shutil

    objective = {"name": "eval/accuracy", "direction": "maximize"}
    original = tmp_path / "original"
    done = _job(original / "0", ["optimizer.lr=0.1"], "finished", objective=objective)
    (done / "metrics.json").write_text(json.dumps({"eval/accuracy": 0.75, "step": 5}))
    moved = tmp_path / "moved"
    shutil.move(original, moved)
    elsewhere = tmp_path / "elsewhere"  # where the record says the job ran: someone else's folder now
    elsewhere.mkdir()
    (elsewhere / "metrics.json").write_text(json.dumps({"eval/accuracy": 0.01, "secret": 1.0}))
    (original / "0").mkdir(parents=True)
    (original / "0" / "metrics.json").write_text(json.dumps({"eval/accuracy": 0.02}))
    record = json.loads((moved / "0" / "job.json").read_text())
    assert record["project_dir"] == str(original / "0")
    [job] = report.collect(moved)
    assert (job.status, job.metrics) == ("finished", {"eval/accuracy": 0.75, "step": 5})
    (moved / "0" / "job.json").write_text(json.dumps({**record, "project_dir": str(elsewhere)}))
    [job] = report.collect(moved)
    assert job.metrics == {"eval/accuracy": 0.75, "step": 5}


def test_interpolations_in_a_sweeps_files_stay_text(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNER_TEST_SECRET", "hunter2")
    _grid_sweep(tmp_path, ["optimizer.lr=0.1,${oc.env:RUNNER_TEST_SECRET}", "seed=${oc.env:RUNNER_TEST_SECRET}"])
    job = tmp_path / "0" / ".hydra"
    job.mkdir(parents=True)
    (job / "overrides.yaml").write_text("- optimizer.lr=0.1\n- seed=${oc.env:RUNNER_TEST_SECRET}\n")
    jobs = report.collect(tmp_path)
    escaped = r"$\{oc.env\:RUNNER_TEST_SECRET\}"  # as Hydra's grid writes a job's value: text, not resolved
    assert [(job.name, job.status, job.overrides) for job in jobs] == [
        ("0", "interrupted", ["optimizer.lr=0.1", "seed=${oc.env:RUNNER_TEST_SECRET}"]),
        ("1", "pending", [f"optimizer.lr={escaped}", f"seed={escaped}"]),
    ]
    monkeypatch.delenv("RUNNER_TEST_SECRET")  # resolving it now would fail: nothing does
    assert [job.overrides for job in report.collect(tmp_path)][1] == jobs[1].overrides


def test_records_of_the_wrong_shape_are_read_as_none_and_a_job_as_far_as_it_can_be(tmp_path):
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "job.json").write_text("[1]")
    assert read_job(tmp_path / "0") is None
    finished = _job(tmp_path / "1", ["seed=1"], "finished", objective="eval/accuracy", wall_time_s="long", error=3)
    (finished / "metrics.json").write_text("{cut short")
    hydra = tmp_path / "2" / ".hydra"
    hydra.mkdir(parents=True)
    (hydra / "overrides.yaml").write_text("- [unclosed\n")
    (tmp_path / "multirun.yaml").write_text("hydra: [unclosed\n")
    jobs = report.collect(tmp_path)
    assert [(job.name, job.status, job.overrides, job.objective, job.metrics) for job in jobs] == [
        ("0", "interrupted", [], None, {}),
        ("1", "finished", ["seed=1"], None, {}),
        ("2", "interrupted", [], None, {}),
    ]
    assert (jobs[1].wall_time_s, jobs[1].error) == (None, "")
