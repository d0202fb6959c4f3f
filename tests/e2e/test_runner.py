"""``python -m runner ...`` end to end, on slices of the real MNIST test split."""

import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

import runner
from runner.engine import load_checkpoint_in_model
from runner.models import MnistCNN
from tests.e2e.conftest import metrics, mnist_args, run_cli, run_cli_refusals
from tests.shared_data import MNIST


def scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _written_at(path) -> int:
    return path.stat().st_mtime_ns


def test_default_experiment_on_one_process(tmp_path):
    run = tmp_path / "run"
    result = run_cli(*mnist_args(), "trainer.max_steps=20", f"hydra.run.dir={run}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert {p.name for p in run.iterdir()} >= {".hydra", "run.log", "logs", "checkpoints", "model", "metrics.json"}
    assert (run / ".hydra" / "config.yaml").is_file() and (run / "model" / "model.safetensors").is_file()
    summary = metrics(run)
    assert summary["step"] == 20 and summary["eval/accuracy"] > 0.5  # it learned: chance is 0.1
    logged = scalars(run / "logs")
    assert [step for step, _ in logged["train/loss"]] == [10, 20]
    assert logged["eval/accuracy"] == [(20, summary["eval/accuracy"])]
    assert {"train/lr", "train/samples_per_second"} <= set(logged)
    log = (run / "run.log").read_text()
    assert "step 20/20" in log
    phases = re.search(r"Start-up: first optimizer step [\d.]+ s after the command \((.*)\)", log).group(1)
    assert [part.rsplit(" ", 2)[0] for part in phases.split(", ")] == [
        "python start and imports", "compose and validate the config", "import and build the targets",
        "check the data", "check the command line", "compose with Hydra", "import torch", "validate and check data",
        "start workers", "process group", "build and prepare", "first optimizer step",
    ]  # fmt: skip
    total = float(re.search(r"Start-up: first optimizer step ([\d.]+) s", log).group(1))
    assert abs(sum(float(part.rsplit(" ", 2)[1]) for part in phases.split(", ")) - total) < 0.07  # rounding alone
    # The first line says where the run goes, before the config's targets are imported (seconds, with torchmetrics).
    assert re.fullmatch(
        r"\[[\d:, -]+\]\[runner\]\[INFO\] - Run folder: " + re.escape(str(run)), result.stdout.splitlines()[0]
    )
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["checkpoint_0"]
    manifest = json.loads((run / "checkpoints" / "checkpoint_0" / "manifest.json").read_text())
    assert (manifest["step"], manifest["epoch"], len(manifest["config_sha256"])) == (20, 0, 64)
    fresh = MnistCNN()
    load_checkpoint_in_model(fresh, run / "model", strict=True)  # the final model, into a plain model
    saved = load_file(run / "model" / "model.safetensors")
    assert all(torch.equal(fresh.state_dict()[k], saved[k]) for k in saved)
    # Its closing lines, its picture, its times.
    closing = [line.split("[INFO] - ", 1)[1] for line in result.stdout.splitlines()[-4:]]
    finished = r"Finished at step 20 in [\d.]+ s: eval/accuracy=[\d.]+, eval/loss=[\d.]+, train/loss=[\d.]+\."
    assert re.fullmatch(finished, closing[0]), closing
    assert closing[1:] == [
        f"Run folder: {run}; newest checkpoint: checkpoint_0 (step 20).",
        f"Curves: {run / 'curves.png'} (runner report {run} redraws them).",
        f"Evaluate it with `runner eval {run}`; train it further with `runner resume={run} trainer.max_steps=<more "
        "steps>`.",
    ]
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    times = json.loads((run / "metrics.json").read_text())
    assert 0 < times["time_to_first_step_s"] < times["wall_time_s"] < 600
    (run / "curves.png").unlink()
    redrawn = run_cli("report", str(run), cwd=tmp_path)
    assert redrawn.returncode == 0 and redrawn.stdout == f"Wrote {run / 'curves.png'}\n", redrawn.stderr[-2000:]
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # runner eval: the newest checkpoint's model on the run's eval data gives the run's own final eval, exactly;
    # another split its own numbers; nothing the run wrote changes.
    files = [*(run / "checkpoints").rglob("*"), *(run / "model").iterdir()]
    written = {path: path.read_bytes() for path in files if path.is_file()}
    evaluated = run_cli("eval", str(run), cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    other = run_cli("eval", str(run), 'data.eval_split="test[9000:9100]"', cwd=tmp_path)
    assert other.returncode == 0, other.stderr[-3000:]
    first, second = (json.loads(path.read_text()) for path in sorted(run.glob("eval-*.json"), key=_written_at))
    checkpoint = str(run / "checkpoints" / "checkpoint_0")
    final = {k: v for k, v in summary.items() if k.startswith("eval/")}
    assert first == {"checkpoint": checkpoint, "step": 20, **final}
    assert second["step"] == 20 and second["eval/loss"] != first["eval/loss"]
    assert metrics(run) == summary and {p: p.read_bytes() for p in written} == written
    assert f"Evaluated {checkpoint} (step 20): eval/loss" in (run / "run.log").read_text()

    # Its launch record: one (runner eval writes none), with the command, the code, and the first batches read.
    (record,) = [json.loads(path.read_text()) for path in (run / "provenance").iterdir()]
    assert record["attempt"] == 1 and record["command"][:2] == ["runner", f"data.root={MNIST}"]
    assert record["resume"] is None and record["seed"] == 42 and record["overrides"][-1] == "trainer.max_steps=20"
    assert record["code"]["runner"]["version"] == runner.__version__ and record["code"]["repositories"] == {}
    assert record["launch"] | {"hosts": None} == {
        "world_size": 1, "processes_per_node": 1, "num_nodes": 1, "started_by": "runner", "device": "cpu",
        "mixed_precision": "no", "gradient_accumulation_steps": 1, "parallel": {"strategy": "none"}, "hosts": None,
    }  # fmt: skip
    assert record["data_order"]["first_batch"] == 0 and len(record["data_order"]["batches"]) == 4
    assert record["packages"]["torch"] == torch.__version__ and record["own_generators"] == []


def test_mnist_ddp_with_fp16_scales_its_loss_and_says_what_it_costs_on_the_cpu(tmp_path):
    # fp16 autocast runs torch's slow CPU kernels (~40-100x fp32): a few tiny steps show it works.
    run = tmp_path / "run"
    result = run_cli(
        "experiment=mnist_ddp", "trainer.mixed_precision=fp16", *mnist_args("test[:256]", "test[9800:]"),
        "data.batch_size=16", "trainer.max_steps=4", "trainer.eval_every_n_steps=4", f"hydra.run.dir={run}",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = metrics(run)
    assert summary["step"] == 4 and math.isfinite(summary["eval/loss"]) and 0 <= summary["eval/accuracy"] <= 1
    checkpoint = run / "checkpoints" / "checkpoint_0"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert {"random_states_0.pt", "random_states_1.pt", "scaler.pt"} <= set(manifest["files"])
    scaler = torch.load(checkpoint / "scaler.pt", weights_only=True)
    assert scaler["scale"] > 0 and scaler["_growth_tracker"] >= 0  # the loss scaler ran and was saved
    assert result.stderr.count("mixed_precision='fp16' on the CPU runs torch's slow CPU fp16 kernels") == 2  # per rank
    log = (run / "run.log").read_text()
    assert "distributed_type=MULTI_CPU, num_processes=2" in log and "mixed_precision=fp16" in log
    assert "rank 1" not in log  # only rank 0 writes the run's log
    # The workers were forked from the preloaded server, in the environment of the launch: the launching process's
    # phases, stamped after the server started, reached them.
    phases = re.search(r"Start-up: first optimizer step [\d.]+ s after the command \((.*)\)", log).group(1)
    assert [part.rsplit(" ", 2)[0] for part in phases.split(", ")][:6] == [
        "python start and imports", "compose and validate the config", "import and build the targets",
        "check the data", "check the command line", "compose with Hydra",
    ]  # fmt: skip
    assert "start workers" in phases


def test_multirun_of_two_ddp_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli(
        "-m", "experiment=mnist_ddp", "optimizer.lr=1e-3,3e-3", *mnist_args("test[:512]", "test[9800:]"),
        "trainer.max_steps=3", f"hydra.sweep.dir={sweep}", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for job, lr in (("0", "0.001"), ("1", "0.003")):
        overrides = (sweep / job / ".hydra" / "overrides.yaml").read_text()
        assert f"optimizer.lr={lr}" in overrides
        assert metrics(sweep / job)["step"] == 3
        assert (sweep / job / "checkpoints" / "checkpoint_0" / "random_states_1.pt").is_file()
    assert (sweep / "multirun.yaml").is_file()

    # runner runs: the sweep is one row (its two jobs finished, the better one's accuracy), and --expand shows both.
    accuracy = {job: f"{metrics(sweep / job)['eval/accuracy']:.4g}" for job in ("0", "1")}
    listed = run_cli("runs", str(tmp_path), cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr[-3000:]
    rows = [re.split(r" {2,}", row.strip()) for row in listed.stdout.splitlines()]
    assert rows[0] == ["folder", "experiment", "status", "step", "objective", "last", "best", "duration", "resumes"]
    best = max(accuracy.values(), key=float)
    assert len(rows) == 2 and rows[1][:7] == ["sweep", "mnist_ddp", "2 finished", "-", "eval/accuracy", "-", best]
    expanded = run_cli("runs", "--expand", str(tmp_path), cwd=tmp_path)
    rows = [re.split(r" {2,}", row.strip()) for row in expanded.stdout.splitlines()]
    assert [row[:7] + row[8:] for row in rows[2:]] == [
        [f"sweep/{job}", "mnist_ddp", "finished", "3/3", "eval/accuracy", accuracy[job], accuracy[job], "0"]
        for job in ("0", "1")
    ]

    # runner diff: the one override that tells the jobs apart, the same code and packages, where the curves part.
    job0, job1 = sweep / "0", sweep / "1"
    compared = run_cli("diff", str(job0), str(job1), cwd=tmp_path)
    assert compared.returncode == 1, compared.stderr[-3000:]  # as diff's: 1, they differ
    lines = compared.stdout.splitlines()
    assert lines[2] == "config: 1 key differs" and {"code: same", "packages: same"} <= set(lines)
    assert re.fullmatch(r"  optimizer\.lr +0\.001 \(optimizer\.lr=0\.001\) +0\.003 \(optimizer\.lr=0\.003\)", lines[4])
    diverged = re.search(r"^metrics: first differ at step (\d+) \((\S+)\)$", compared.stdout, flags=re.MULTILINE)
    assert diverged, compared.stdout
    step, tag = int(diverged.group(1)), diverged.group(2)
    curves = scalars(job0 / "logs")[tag], scalars(job1 / "logs")[tag]
    assert [value for at, value in curves[0] if at < step] == [value for at, value in curves[1] if at < step]
    assert dict(curves[0])[step] != dict(curves[1])[step]
    report = json.loads(run_cli("diff", "--json", str(job0), str(job1), cwd=tmp_path).stdout)
    assert report["metrics"]["first_divergence"]["step"] == step and report["same"] is False


def test_resume_from_a_checkpoint_then_a_run_folder_matches_an_uninterrupted_run(tmp_path):
    common = [*mnist_args("test[:1000]", "test[9800:]"), "scheduler=constant", "trainer.checkpoint_every_n_steps=5"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert run_cli(*common, "trainer.max_steps=20", f"hydra.run.dir={full}", cwd=tmp_path).returncode == 0
    # The interrupted run writes its checkpoints in the background; resuming them is still exact.
    cut_run = run_cli(
        *common, "trainer.async_checkpoint=true", "trainer.max_steps=10", f"hydra.run.dir={cut}", cwd=tmp_path
    )
    assert cut_run.returncode == 0, cut_run.stderr[-3000:]

    resumed = run_cli(f"resume={cut}/checkpoints/checkpoint_1", "trainer.max_steps=15", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    again = run_cli(f"resume={cut}", "trainer.max_steps=20", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    # total_limit=3 rotated checkpoint_0 away; checkpoint_2 (resumed from) is kept.
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2", "checkpoint_3"]
    assert not (tmp_path / "outputs").exists()  # resuming wrote into the resumed run's folder only

    assert metrics(cut) == metrics(full)  # step, epoch, eval loss and accuracy, and the logged train loss
    expected, got = load_file(full / "model" / "model.safetensors"), load_file(cut / "model" / "model.safetensors")
    assert all(torch.equal(expected[k], got[k]) for k in expected)  # bit-identical to the uninterrupted run
    overrides = (cut / "checkpoints" / "checkpoint_3" / "overrides.yaml").read_text()
    assert "trainer.max_steps=20" in overrides and "trainer.max_steps=10" not in overrides
    log = (cut / "run.log").read_text()
    assert "Resumed at step 10" in log and "Resumed at step 15" in log


def test_mnist_fsdp_checkpoints_are_sharded_and_resume_exactly(tmp_path):
    # runner check-resume: 6 steps straight; 3 steps, stopped as if preempted, then resumed to 6, sharded checkpoints
    # written in the background (torch.distributed.checkpoint.async_save); both kept for the checks below.
    common = ["experiment=mnist_fsdp", *mnist_args("test[:1024]", "test[9800:]"), "scheduler=constant",
              "trainer.checkpoint_every_n_steps=3", "trainer.async_checkpoint=true"]  # fmt: skip
    kept = tmp_path / "check"
    checked = run_cli("check-resume", *common, "--steps", "6", "--cut", "3", "--dir", str(kept), cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr[-3000:]
    assert checked.stdout.splitlines() == [
        "resume is exact: the resumed run matches the straight one bit for bit (weights, optimizer, scheduler, RNG "
        "states, registered objects, data position, every batch read, every logged value and the final metrics).",
        f"The runs are kept in {kept}.",
    ]
    assert checked.stderr.splitlines()[-1].startswith("runner check-resume: 3/3: done in ")
    full, cut = kept / "straight", kept / "cut"
    assert "Resumed at step 3" in (cut / "run.log").read_text()

    manifest = json.loads((cut / "checkpoints" / "checkpoint_0" / "manifest.json").read_text())
    assert {"model/__0_0.distcp", "model/__1_0.distcp", "optimizer/.metadata"} <= set(manifest["files"])
    assert metrics(cut) == metrics(full)
    expected, got = load_file(full / "model" / "model.safetensors"), load_file(cut / "model" / "model.safetensors")
    assert all(torch.equal(expected[k], got[k]) for k in expected)  # bit-identical to the uninterrupted run
    plain = MnistCNN()
    load_checkpoint_in_model(plain, full / "model", strict=True)  # the gathered model is a plain one

    # runner eval of the sharded checkpoint: on the run's 2 processes its own final eval exactly, on 1 the same
    # up to the order of the loss's sum.
    for extra in ([], ["trainer.num_processes=1"]):
        evaluated = run_cli("eval", str(full), *extra, cwd=tmp_path)
        assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    two, one = (json.loads(path.read_text()) for path in sorted(full.glob("eval-*.json"), key=_written_at))
    final = {k: v for k, v in metrics(full).items() if k.startswith("eval/")}
    assert {k: two[k] for k in final} == final and two["step"] == one["step"] == 6
    assert one["eval/accuracy"] == final["eval/accuracy"]
    assert math.isclose(one["eval/loss"], final["eval/loss"], rel_tol=1e-6)

    # What check-resume sets itself, or cannot check, is refused before anything runs, and nothing is kept. (A
    # temporary folder of a short path: the forkserver's socket lies in it, and a socket's path is at most 107 bytes.)
    temporary = Path(tempfile.mkdtemp(prefix="refused-"))
    refused = run_cli_refusals(
        [["check-resume", "--steps", "4", "--cut", "4"], ["check-resume", "resume=outputs/x"],
         ["check-resume", "-m", "optimizer.lr=1e-3,1e-2"], ["check-resume", *common, "trainer.max_step=3"],
         ["check-resume", "--dir", str(kept)]],
        cwd=tmp_path, env={"TMPDIR": str(temporary)},
    )  # fmt: skip
    left = list(temporary.glob("runner-check-resume-*"))
    shutil.rmtree(temporary)
    assert [result["returncode"] for result in refused] == [2, 2, 2, 2, 2], [result["stderr"] for result in refused]
    assert [result["stderr"].strip().splitlines()[-1] for result in refused] == [
        "runner: error: --cut 4: cut between step 1 and step 3 (--steps is 4).",
        "runner: error: resume=outputs/x: check-resume sets resume itself (it resumes its own interrupted run); "
        "leave it out.",
        "runner: error: -m: check-resume checks one run, not a sweep; check one job's overrides instead.",
        "runner: error: trainer.max_step is not a key of 'trainer' (did you mean 'trainer.max_steps'?); `python -m "
        "runner --cfg job` lists every key.",
        f"runner: error: --dir {kept}: {kept} exists; name a new folder, so that no run is overwritten.",
    ]
    assert left == []


def test_typo_in_a_key_exits_2_with_one_sentence_and_creates_nothing(tmp_path):
    result = run_cli("trainer.max_step=3", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "runner: error: trainer.max_step is not a key of 'trainer' (did you mean 'trainer.max_steps'?); "
        "`python -m runner --cfg job` lists every key."
    )
    assert list(tmp_path.iterdir()) == []


def test_missing_data_exits_2_naming_the_files_and_the_flag(tmp_path):
    result = run_cli(f"data.root={tmp_path / 'nowhere'}", "data.download=false", cwd=tmp_path)
    assert result.returncode == 2
    assert "train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz" in result.stderr
    assert "data.download=true" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_a_wrong_resume_path_exits_2(tmp_path):
    result = run_cli(f"resume={tmp_path / 'nope'}", cwd=tmp_path)
    assert result.returncode == 2
    assert re.fullmatch(r"runner: error: resume=.*nope does not exist; pass a run folder .*\n", result.stderr)


def test_a_failing_worker_fails_the_run_with_its_error(tmp_path):
    (tmp_path / "flaky_recipe.py").write_text(
        "def train(cfg, accelerator):\n"
        "    if accelerator.process_index == 1:\n"
        "        raise RuntimeError('the GPU caught fire')\n"
        "    accelerator.wait_for_everyone()\n"
    )
    result = run_cli(
        "experiment=mnist_ddp", "recipe=flaky_recipe", *mnist_args(), f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1
    assert "runner: error: Worker rank 1 failed: RuntimeError: the GPU caught fire" in result.stderr
    # The run's folder keeps the failed rank's error with its traceback, and the console says where the run is.
    log = (tmp_path / "run" / "run.log").read_text()
    assert "[runner][ERROR] - Failed: Worker rank 1 failed: RuntimeError: the GPU caught fire\nTraceback" in log
    assert "flaky_recipe.py\", line 3, in train\n    raise RuntimeError('the GPU caught fire')" in log
    assert f"- Run folder: {tmp_path / 'run'}; newest checkpoint: no complete checkpoint." in result.stdout
    # The console shows the failed rank's own traceback, not torch's log of whichever rank its agent saw first.
    assert "flaky_recipe.py\", line 3, in train\n    raise RuntimeError('the GPU caught fire')" in result.stderr
    assert "elastic/multiprocessing/api.py" not in result.stderr


def test_user_mistakes_found_before_launch_exit_2_without_a_traceback(tmp_path):
    for overrides, message in [
        (
            ['data.eval_split="test[20000:]"'],
            "split='test[20000:]', download=True) failed: Split 'test[20000:]' selects none of MNIST's 10000 test "
            "images.",
        ),
        (["data.train_split=validation"], "MNIST has no split 'validation'"),
        (["trainer.mixed_precision=fp8"], "trainer.mixed_precision='fp8' needs an NVIDIA GPU"),
    ]:
        result = run_cli("experiment=mnist_ddp", *mnist_args(), *overrides, cwd=tmp_path)
        assert result.returncode == 2, (overrides, result.stderr[-2000:])
        assert message in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_help_and_cfg_job(tmp_path):
    helped = run_cli("-X", "importtime", "-m", "runner", "--help", cwd=tmp_path, module=False)
    assert helped.returncode == 0
    assert (
        "experiment: mnist, mnist_ddp, mnist_fsdp" in helped.stdout and "parallel:   ddp, fsdp, none" in helped.stdout
    )
    imported = [line.rsplit("|", 1)[-1].strip() for line in helped.stderr.splitlines() if "|" in line]
    assert "hydra" in imported and not [m for m in imported if m.split(".")[0] == "torch"]
    named = run_cli("--help", "--config-name", "config", cwd=tmp_path)  # the config named: the same help
    assert named.returncode == 0 and named.stdout == helped.stdout, named.stderr[-2000:]
    shown = run_cli("--cfg", "job", "experiment=mnist_ddp", "trainer.mixed_precision=bf16", cwd=tmp_path)
    assert shown.returncode == 0
    assert "num_processes: 2" in shown.stdout and "mixed_precision: bf16" in shown.stdout
    assert list(tmp_path.iterdir()) == []


def test_torchrun_ranks_join_one_group_and_one_run_folder(tmp_path):
    result = run_cli(
        "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "runner",
        "experiment=mnist_ddp", *mnist_args("test[:512]", "test[9800:]"), "trainer.max_steps=3",
        cwd=tmp_path, module=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(runs) == 1, runs
    assert metrics(runs[0])["step"] == 3
    assert json.loads((runs[0] / "checkpoints" / "checkpoint_0" / "manifest.json").read_text())["world_size"] == 2
    assert (runs[0] / ".hydra" / "config.yaml").is_file()
    (record,) = [json.loads(path.read_text()) for path in (runs[0] / "provenance").iterdir()]  # rank 0's, once
    launch = record["launch"]
    assert (launch["started_by"], launch["world_size"], len(launch["hosts"])) == ("torchrun", 2, 2)


def test_recipe_can_be_a_users_own_module(tmp_path):
    (tmp_path / "my_recipe.py").write_text(
        "import json, pathlib\n"
        "def train(cfg, accelerator):\n"
        "    out = pathlib.Path(accelerator.project_dir) / 'mine.json'\n"
        "    out.write_text(json.dumps({'seed': cfg.seed, 'world': accelerator.num_processes}))\n"
        "    return 0.5\n"
    )
    run = tmp_path / "run"
    result = run_cli("recipe=my_recipe", "seed=7", *mnist_args(), f"hydra.run.dir={run}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((run / "mine.json").read_text()) == {"seed": 7, "world": 1}
    missing = run_cli("recipe=not_a_module", cwd=tmp_path)
    assert missing.returncode == 2 and "recipe='not_a_module' is neither a built-in recipe" in missing.stderr


def test_damaged_checkpoints_and_other_models_get_one_sentence(tmp_path):
    run = tmp_path / "run"
    common = [*mnist_args("test[:512]", "test[9800:]"), "trainer.checkpoint_every_n_steps=2"]
    assert run_cli(*common, "trainer.max_steps=4", f"hydra.run.dir={run}", cwd=tmp_path).returncode == 0
    newest = run / "checkpoints" / "checkpoint_1"
    weights = newest / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    weights.write_bytes(bytes(data))

    refused = run_cli(f"resume={newest}", cwd=tmp_path)
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
    assert "model.safetensors does not match its xxh3_128 digest in the manifest" in refused.stderr

    fallback = run_cli(f"resume={run}", "trainer.max_steps=6", cwd=tmp_path)
    assert fallback.returncode == 0, fallback.stderr[-3000:]
    log = (run / "run.log").read_text()
    assert "Skipping checkpoint_1" in fallback.stdout + fallback.stderr
    assert "Resumed at step 2" in log and metrics(run)["step"] == 6

    other = run_cli(f"resume={run}", "model.hidden=64", "trainer.max_steps=8", cwd=tmp_path)
    assert other.returncode == 1 and "Traceback" not in other.stderr
    assert re.search(
        r"runner: error: .*model.safetensors does not fit the prepared model \(size mismatch", other.stderr
    )


def test_a_run_folder_takes_one_run_at_a_time_and_a_dead_runs_lock_is_taken_over(tmp_path):
    from runner.launch.lock import LOCK_NAME, RunLock

    run = tmp_path / "run"
    holder = RunLock(run).acquire()  # a live run (this test process) writes the folder
    refused = run_cli(*mnist_args(), "trainer.max_steps=1", f"hydra.run.dir={run}", cwd=tmp_path)
    assert refused.returncode == 1
    message = refused.stderr.strip()
    assert message.startswith(f"runner: error: {run} is being written by another run (pid {os.getpid()} on ")
    assert message.endswith("wait for it to finish, or give this run another folder.")
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]  # Hydra wrote nothing into the folder
    holder.release()

    (run / LOCK_NAME).write_text('{"pid": 999999, "host": "gone", "since": 0}')  # left by a run that died
    taken = run_cli(*mnist_args(), "trainer.max_steps=1", f"hydra.run.dir={run}", cwd=tmp_path)
    assert taken.returncode == 0, taken.stderr[-3000:]
    assert "Taking over" in taken.stderr and "pid 999999 on gone" in taken.stderr
    assert (run / LOCK_NAME).read_text() == ""  # released at the end of the run
