"""Every bad input: one sentence naming the key or file, the documented exit code, nothing overwritten."""

import hashlib
import json
import os
import shutil
import socket

from runner.launch.lock import RunLock
from tests.e2e.conftest import MNIST, mnist_args, run_cli, run_cli_refusals
from tests.unit.engine.checkpoint.checkpoint_edits import rewrite_manifest


def _fingerprint(run):
    """Every file of the run's checkpoints with its sha256, and the checkpoint folders that exist."""
    files = sorted(p for p in (run / "checkpoints").rglob("*") if p.is_file())
    return {p.relative_to(run).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def test_each_bad_input_gets_one_sentence_and_its_exit_code_and_changes_nothing(tmp_path):
    run = tmp_path / "run"
    common = [*mnist_args("test[:512]", "test[9800:]"), "trainer.checkpoint_every_n_steps=2"]
    assert run_cli(*common, "trainer.max_steps=4", f"hydra.run.dir={run}", cwd=tmp_path).returncode == 0
    before = _fingerprint(run)
    assert len(before) > 10

    not_a_checkpoint = tmp_path / "notes"
    not_a_checkpoint.mkdir()
    (not_a_checkpoint / "todo.txt").write_text("nothing to resume")
    (not_a_checkpoint / "latest").symlink_to(run)  # a folder of notes may hold links; it is still no run
    corrupted = tmp_path / "copy"
    shutil.copytree(run, corrupted)
    optimizer = corrupted / "checkpoints" / "checkpoint_1" / "optimizer.bin"
    optimizer.write_bytes(optimizer.read_bytes()[:-10] + bytes(10))  # same size, other bytes
    truncated = tmp_path / "truncated"  # a data file cut short (a download that died half-way)
    truncated.mkdir()
    shutil.copy(MNIST / "t10k-labels-idx1-ubyte.gz", truncated)
    (truncated / "t10k-images-idx3-ubyte.gz").write_bytes((MNIST / "t10k-images-idx3-ubyte.gz").read_bytes()[:5000])
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    with socket.socket() as unused:  # a port nobody serves
        unused.bind(("127.0.0.1", 0))
        closed = unused.getsockname()[1]
    at_run = f"hydra.run.dir={run}"

    swept = tmp_path / "optimizer.lr=0.1"
    cases = [
        # (arguments, exit code, what the one sentence must say)
        ([f"resume={run}", "trainer.max_step=9"], 2, "trainer.max_step is not a key of 'trainer' (did you mean "
         "'trainer.max_steps'?)"),
        ([f"resume={run}", "trainer.max_steps=abc"], 2, "trainer.max_steps=abc is not valid"),
        ([f"resume={run}", "trainer.mixed_precision=fp17"], 2, "trainer.mixed_precision='fp17' is not supported "
         "(did you mean 'fp16'?)"),
        ([*common, "trainer.num_processes=2", at_run], 2, "trainer.num_processes=2 with trainer.num_nodes=1 needs a "
         "parallel strategy; add parallel=ddp or parallel=fsdp"),
        (["data.root=" + str(tmp_path / "nowhere"), "data.download=false", at_run], 2, "are not in "
         f"{tmp_path / 'nowhere'}"),
        ([f"data.root={truncated}", 'data.train_split="test[:100]"', 'data.eval_split="test[100:200]"',
          f"hydra.run.dir={tmp_path / 'other'}"], 1, f"{truncated / 't10k-images-idx3-ubyte.gz'} cannot be read"),
        ([f"resume={tmp_path / 'missing'}"], 2, str(tmp_path / "missing")),
        ([f"resume={not_a_checkpoint}"], 2, f"resume={not_a_checkpoint} is neither a checkpoint folder "
         "(checkpoint_N) nor a run folder (it has no checkpoints/ folder); pass one of those."),  # not its link
        # Continuing on more processes: the strategy is a value on resume, not a group.
        ([f"resume={run}", "trainer.num_processes=2"], 2, "trainer.num_processes=2 with trainer.num_nodes=1 needs a "
         "parallel strategy; add parallel.strategy=ddp (or set trainer.num_processes=1)."),
        ([f"resume={run}", "trainer.num_processes=2", "parallel=ddp"], 2, "resume= keeps the resumed run's config "
         "groups, but parallel=ddp switches one; change values (e.g. parallel.strategy=ddp) or start a new run."),
        ([f"resume={corrupted}/checkpoints/checkpoint_1"], 2, "optimizer.bin does not match its xxh3_128 digest "
         "in the manifest (bytes 0-"),
        ([*common, "project.project_dir=/proc/runner-test"], 2, "project.project_dir=/proc/runner-test cannot be "
         "written"),
        ([*common, "parallel=ddp", "trainer.num_nodes=2", f"trainer.rdzv_endpoint=127.0.0.1:{port}",
          f"project.project_dir={tmp_path / 'shared'}"], 2, f"trainer.rdzv_endpoint=127.0.0.1:{port}: port {port} "
         "is already in use on this machine"),
        ([f"resume={run}"], 2, f"resume={run}: the run is already done: checkpoint_1 is its final checkpoint (step 4) "
         f"and its metrics.json is written; give a larger trainer.max_steps (or trainer.max_epochs) to train further, "
         f"or evaluate it with runner eval {run}."),
        ([f"resume={run}", "trainer.max_steps=3"], 2, f"resume={run}: checkpoint_1 is at step 4, already past "
         "trainer.max_steps=3; give a larger trainer.max_steps to train further"),
        ([f"resume={run / 'run.log'}"], 2, f"resume={run / 'run.log'} is a file, not a folder; pass a run folder"),
        ([*common, "parallel=ddp", "trainer.num_nodes=2", "trainer.node_rank=1", f"trainer.rdzv_endpoint=127.0.0.1:"
          f"{closed}", "trainer.rdzv_timeout=2", f"project.project_dir={tmp_path / 'node1'}"], 2,
         f"trainer.rdzv_endpoint=127.0.0.1:{closed}: nothing answered there within 2 s (trainer.rdzv_timeout); start "
         "node 0"),
        ([*common, "tracker=mlflow", f"tracker.mlflow.tracking_uri=http://127.0.0.1:{closed}",
          f"hydra.run.dir={tmp_path / 'mlflow_down'}"], 2, f"tracker.mlflow.tracking_uri=http://127.0.0.1:{closed} "
         "cannot be reached ([Errno 111] Connection refused); start the MLflow server or fix the address"),
        ([*common, "tracker=[tensorboard,wandb]", f"hydra.run.dir={tmp_path / 'wandb_online'}"], 2, "tracker=wandb "
         "in mode online needs a W&B login: run `wandb login` or set WANDB_API_KEY, or set tracker.wandb.mode=offline"),
    ]  # fmt: skip
    # Values refused before launch: nothing is written, not even the run folder.
    cores = os.cpu_count()
    before_launch = [
        (["model.channels=0"], "model: MnistCNN(channels=0, hidden=128, dropout=0.25) failed: channels=0 must be at "
         "least 1."),
        (["model.dropout=2"], "model: MnistCNN(channels=32, hidden=128, dropout=2.0) failed: dropout=2.0 must be at "
         "least 0 and below 1."),
        (["model.hidden=-5"], "failed: hidden=-5 must be at least 1."),
        (["optimizer.lr=-1"], "optimizer.lr=-1.0 must be a positive number, e.g. optimizer.lr=1e-3."),
        (["optimizer.lr=nan"], "optimizer.lr=nan must be a positive number"),
        (["optimizer.lr=0"], "optimizer.lr=0.0 must be a positive number (0 trains nothing)"),
        (["+optimizer.learning_rate=0.1"], "optimizer.learning_rate is not a parameter of torch.optim.AdamW; it takes "
         "params, lr, betas, eps, weight_decay, amsgrad, maximize, foreach, capturable, differentiable, fused (did you "
         "mean 'optimizer.lr'?)."),
        (["optimizer.betas=[1.5,0.9]"], "optimizer: AdamW(lr=0.001, betas=[1.5, 0.9], eps=1e-08, weight_decay=0.01) "
         "failed: Invalid beta parameter at index 0: 1.5; fix the optimizer.* keys."),
        (["model._target_=nosuch.Model"], "model._target_='nosuch.Model' does not import: there is no module named "
         "'nosuch'"),
        (["recipe=json"], "recipe='json' names the module json, which has no train(cfg, accelerator)"),
        (["seed=99999999999999999999"], "seed=99999999999999999999 must be between 0 and 2**63-1"),
        (["parallel=ddp", "trainer.num_processes=100000"], f"trainer.num_processes=100000 is more than this "
         f"machine's {cores} CPU cores"),
        (["scheduler.warmup_steps=-3"], "scheduler.warmup_steps=-3 must be at least 0."),
        (["scheduler.min_lr_ratio=5"], "scheduler.min_lr_ratio=5.0 must be between 0 and 1"),
        (["parallel=ddp", "parallel.bucket_cap_mb=-1"], "parallel.bucket_cap_mb=-1 must be positive"),
        (["project.iteration=-1"], "project.iteration=-1 must be at least 0."),
        (["seed=${model.nosuch}"], "seed cannot be resolved (Interpolation key 'model.nosuch' not found); set seed to "
         "a value, or give the config the key it refers to."),
    ]  # fmt: skip
    # A manifest rewritten with its digest recomputed (as whoever crafts a folder would): each field is checked.
    crafted = {
        "step": lambda manifest: manifest.update(step="ten"),
        "samples_seen": lambda manifest: manifest["dataloaders"][0].update(samples_seen=-64),
    }
    for field, edit in crafted.items():
        shutil.copytree(run, tmp_path / field)
        rewrite_manifest(tmp_path / field / "checkpoints" / "checkpoint_1", edit)
    refusals = cases + [
        ([*common, *arguments, f"hydra.run.dir={tmp_path / f'refused_{i}'}"], 2, sentence)
        for i, (arguments, sentence) in enumerate(before_launch)
    ]
    refusals += [
        ([f"resume={tmp_path / 'step' / 'checkpoints' / 'checkpoint_1'}"], 2, "manifest.json: step is 'ten', not a "
         "non-negative integer or null; the manifest is damaged, so load a different checkpoint."),
        ([f"resume={tmp_path / 'samples_seen' / 'checkpoints' / 'checkpoint_1'}"], 2, "manifest.json: "
         "dataloaders[0].samples_seen is -64, not a non-negative integer; the manifest is damaged"),
        # The verbs after training: the same rules, the same one sentence.
        (["generate", str(run), "prompt=x"], 2, f"{run} is not a language model run (recipe="),
        (["generate", str(run), "temprature=0.5"], 2, "'temprature=0.5' is not a setting (did you mean temperature?)"),
        (["generate", str(swept)], 2, f"{swept} is not a language model run (recipe=supervised"),  # read as a folder
        (["generate", str(tmp_path / "missing")], 2, f"{tmp_path / 'missing'} does not exist; pass a run folder"),
        (["eval", str(not_a_checkpoint)], 2, f"runner eval {not_a_checkpoint} is neither a checkpoint folder"),
        (["eval", str(run / "model")], 2, f"runner eval {run / 'model'} holds a model's weights (model.safetensors) "
         f"but no checkpoints, so it is an exported model, not a run; pass the run it came from ({run}), or one of "
         "its checkpoints/checkpoint_N folders."),
        (["eval"], 2, "runner eval needs a run or checkpoint folder first; usage: runner eval RUN_OR_CHECKPOINT"),
        (["eval", str(swept), "data.eval=null"], 2, "runner eval evaluates the run's data.eval, which is null; name "
         "the dataset to evaluate on the command line, e.g. 'data.eval={_target_:runner.data.MNIST,root:data,"
         "split:test}'."),
        ([*common, "evaluate_only=true", f"hydra.run.dir={tmp_path / 'refused_eval'}"], 2, "evaluate_only=true "
         "evaluates a run's checkpoint; use runner eval <run folder> (or add resume=<run folder>)."),
        (["export", str(run), "--to", str(run / "model")], 2, f"--to {run / 'model'} already holds files; give a new "
         "or empty folder (nothing was written)."),
        (["export", str(run), "--to", str(tmp_path / "exported"), "--merge-lora"], 2, f"--merge-lora: the model of "
         f"{run} is runner.models.MnistCNN, not runner.models.with_peft, so it has no adapters to merge; export it "
         "without --merge-lora."),
        (["export", str(corrupted / "checkpoints" / "checkpoint_1"), "--to", str(tmp_path / "exported")], 2,
         "optimizer.bin does not match its xxh3_128 digest in the manifest"),
    ]  # fmt: skip
    # Each is refused before a run starts: one Python process takes them all through the entry point (torch is
    # imported once), as a user's `runner` would.
    swept.symlink_to(run)  # a sweep job's folder named by its overrides: a folder, not a setting
    no_wandb_login = {"WANDB_API_KEY": "", "NETRC": str(tmp_path / "no-netrc")}
    results = run_cli_refusals([arguments for arguments, _, _ in refusals], cwd=tmp_path, env=no_wandb_login)
    for (arguments, code, sentence), result in zip(refusals, results, strict=True):
        _assert_one_sentence(arguments, result["returncode"], result["stderr"], code, sentence)
    busy.close()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(("refused_", "exported"))]  # nothing written

    # A checkpoint of another model is found out once the workers load it, as a user runs it.
    other_model = [f"resume={run}", "model.hidden=64", "trainer.max_steps=8"]
    result = run_cli(*other_model, cwd=tmp_path)
    sentence = "model.safetensors does not fit the prepared model"
    _assert_one_sentence(other_model, result.returncode, result.stderr, 1, sentence)

    # An edited manifest is damage like any other: a run folder resumes from the checkpoint before it.
    fallback = tmp_path / "edited"
    shutil.copytree(run, fallback)
    manifest_path = fallback / "checkpoints" / "checkpoint_1" / "manifest.json"
    edited = json.loads(manifest_path.read_text())
    edited["dataloaders"][0]["samples_seen"] += 1
    manifest_path.write_text(json.dumps(edited, indent=2))
    resumed = run_cli(f"resume={fallback}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"Skipping checkpoint_1: {manifest_path}: its digest does not match its content" in resumed.stderr
    assert f"Resuming {fallback} from checkpoint_0" in resumed.stdout  # the run's log
    assert json.loads((fallback / "metrics.json").read_text())["step"] == 4

    with RunLock(run):  # another run is writing the folder
        locked = run_cli(*common, "trainer.max_steps=6", at_run, cwd=tmp_path)
    assert locked.returncode == 1 and "is being written by another run" in locked.stderr

    assert _fingerprint(run) == before  # not a byte of the existing checkpoints changed, none was added


def _assert_one_sentence(arguments, returncode: int, stderr: str, code: int, sentence: str) -> None:
    lines = stderr.strip().splitlines()
    assert returncode == code, (arguments, stderr[-2000:])
    prefix = f"runner {arguments[0]}: error: " if arguments[0] in ("export", "generate") else "runner: error: "
    # (runner eval is resume=RUN evaluate_only=true: the runner's own sentences)
    assert lines and lines[-1].startswith(prefix) and sentence in lines[-1], (arguments, lines[-1:])
    assert "Traceback" not in stderr, arguments
