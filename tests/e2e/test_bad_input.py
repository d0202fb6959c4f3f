"""Every bad input: one sentence naming the key or file, the documented exit code, nothing overwritten."""

import hashlib
import shutil
import socket

from runner.lock import RunLock
from tests.e2e.conftest import MNIST, mnist_args, run_cli


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
    at_run = f"hydra.run.dir={run}"

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
        ([f"resume={not_a_checkpoint}"], 2, str(not_a_checkpoint)),
        ([f"resume={corrupted}/checkpoints/checkpoint_1"], 2, "optimizer.bin does not match its sha256 in the "
         "manifest (bytes 0-"),
        ([f"resume={run}", "model.hidden=64", "trainer.max_steps=8"], 1, "model.safetensors does not fit the "
         "prepared model"),
        ([*common, "project.project_dir=/proc/runner-test"], 2, "project.project_dir=/proc/runner-test cannot be "
         "written"),
        ([*common, "parallel=ddp", "trainer.num_nodes=2", f"trainer.rdzv_endpoint=127.0.0.1:{port}",
          f"project.project_dir={tmp_path / 'shared'}"], 2, f"trainer.rdzv_endpoint=127.0.0.1:{port}: port {port} "
         "is already in use on this machine"),
    ]  # fmt: skip
    for arguments, code, sentence in cases:
        result = run_cli(*arguments, cwd=tmp_path)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == code, (arguments, result.stderr[-2000:])
        assert lines and lines[-1].startswith("runner: error: ") and sentence in lines[-1], (arguments, lines[-1:])
        assert "Traceback" not in result.stderr, arguments
    busy.close()

    with RunLock(run):  # another run is writing the folder
        locked = run_cli(*common, "trainer.max_steps=6", at_run, cwd=tmp_path)
    assert locked.returncode == 1 and "is being written by another run" in locked.stderr

    assert _fingerprint(run) == before  # not a byte of the existing checkpoints changed, none was added
