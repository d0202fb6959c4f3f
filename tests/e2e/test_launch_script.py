"""runner launch runs a plain engine script as accelerate launch does: the README's script on two ranks in bf16
(the precision from the launcher, not the script), python -m runner.launch with the config file under its flags and
the script's own arguments untouched, a failed rank's exit code and sentence, and refusals before anything starts."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_readme import readme_script

REPO = Path(__file__).resolve().parents[2]
# Appended to the README's script: what each rank saw, and the dtype inside and out of a prepared forward.
PROBE = """
import json, os
inner = {}
accelerator.unwrap_model(model)[0].register_forward_hook(lambda module, args, out: inner.update(dtype=str(out.dtype)))
model.eval()
with torch.no_grad():
    final = model(torch.randn(4, 16))
with open(f"probe_{accelerator.process_index}.json", "w") as file:
    json.dump({"num_processes": accelerator.num_processes, "process_index": accelerator.process_index,
               "mixed_precision": str(accelerator.mixed_precision), "inner": inner["dtype"], "final": str(final.dtype),
               "rank": os.environ["RANK"], "world_size": os.environ["WORLD_SIZE"]}, file)
"""
FAILING = """
import json, os, sys, time
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
         "RUNNER_MIXED_PRECISION", "RUNNER_USE_CPU")
with open(f"seen_{os.environ['RANK']}.part", "w") as file:
    json.dump({"argv": sys.argv[1:], **{name: os.environ.get(name) for name in names}}, file)
os.replace(f"seen_{os.environ['RANK']}.part", f"seen_{os.environ['RANK']}.json")  # whole, for rank 1 to wait on
if os.environ["RANK"] == "1":
    deadline = time.monotonic() + 60  # rank 0 records what it saw before the agent stops it
    while not os.path.exists("seen_0.json") and time.monotonic() < deadline:
        time.sleep(0.05)
    print("rank 1 fails on purpose", file=sys.stderr)
    sys.exit(3)
"""
# Rank 1 raises while rank 0 waits in a collective; rank 1 then lingers, so the agent sees rank 0 fail first (on the
# broken connection) and stops rank 1 before it exits.
RAISING = """
import atexit, os, time
import torch
import torch.distributed as dist
from runner.engine import Accelerator

if os.environ["RANK"] == "1":
    atexit.register(lambda: time.sleep(20))  # after the engine's handler has torn the group down: last in, first out
accelerator = Accelerator()
if accelerator.process_index == 1:
    raise ValueError("boom on rank 1")
dist.all_reduce(torch.ones(1))
"""


@pytest.fixture(autouse=True)
def _needs_mnist():
    """These tests need no MNIST (tests/e2e/conftest.py skips without it)."""


@pytest.fixture()
def env(tmp_path):
    """This repository importable wherever its editable install points; no launch config or engine defaults of
    the user's."""
    ours = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "PYTHONUNBUFFERED": "1"}  # fmt: skip
    # OMP_NUM_THREADS too: elastic_run sets it for the workers only when it is not set.
    dropped = ("RUNNER_CONFIG_FILE", "RUNNER_MIXED_PRECISION", "RUNNER_USE_CPU", "CUDA_VISIBLE_DEVICES",
               "OMP_NUM_THREADS")  # fmt: skip
    return {**{k: v for k, v in os.environ.items() if k not in dropped}, **ours}


def _runner(*args, cwd, env, timeout=120):
    runner = [shutil.which("runner")] if shutil.which("runner") else [sys.executable, "-m", "runner"]
    return subprocess.run([*runner, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_readme_script_runs_on_two_ranks_in_bf16_from_the_launcher(tmp_path, env):
    script = readme_script()
    assert '    mixed_precision="bf16",\n' in script
    # Ported as a script that leaves the precision to the launcher: Accelerator() reads it from runner launch.
    (tmp_path / "script.py").write_text(script.replace('    mixed_precision="bf16",\n', "") + PROBE)
    # On the CPU: this is about the launcher, and a machine with one GPU cannot give two ranks one each.
    result = _runner(
        "launch", "--cpu", "--num_processes", "2", "--mixed_precision", "bf16", "script.py", cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        probe = json.loads((tmp_path / f"probe_{rank}.json").read_text())
        assert probe == {
            "num_processes": 2, "process_index": rank, "mixed_precision": "bf16", "inner": "torch.bfloat16",
            "final": "torch.float32", "rank": str(rank), "world_size": "2",
        }  # fmt: skip
    epochs = [line for line in result.stdout.splitlines() if line.startswith("epoch")]
    assert len(epochs) == 3 and all(line.endswith("over 512 samples") for line in epochs)  # rank 0 prints, gathered
    project = tmp_path / "outputs" / "readme"
    assert (project / "checkpoints" / "checkpoint_2" / "random_states_1.pt").is_file()
    assert (project / "model" / "model.safetensors").is_file()


def test_python_m_runner_launch_reads_the_config_file_and_reports_the_failed_rank(tmp_path, env):
    (tmp_path / "job.py").write_text(FAILING)
    (tmp_path / "launch.yaml").write_text("num_processes: 2\nmixed_precision: fp16\nuse_cpu: true\n")
    command = [sys.executable, "-m", "runner.launch", "--config-file", "launch.yaml", "--mixed_precision", "bf16",
               "--gpu_ids", "0", "job.py", "--num_processes", "5", "-m", "x"]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr[-3000:]
    seen = [json.loads((tmp_path / f"seen_{rank}.json").read_text()) for rank in (0, 1)]
    for rank, worker in enumerate(seen):
        assert worker["argv"] == ["--num_processes", "5", "-m", "x"]  # the script's, untouched
        assert (worker["RANK"], worker["LOCAL_RANK"], worker["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert worker["MASTER_ADDR"] and int(worker["MASTER_PORT"]) > 0
        assert worker["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))  # elastic_run's, for 2
        assert (worker["RUNNER_MIXED_PRECISION"], worker["RUNNER_USE_CPU"]) == ("bf16", "1")  # the flag, the file
        assert worker["CUDA_VISIBLE_DEVICES"] == "0"
    assert "rank 1 fails on purpose\n" in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == "runner launch: error: worker rank 1 failed with exit code 3; its output is above."
    assert result.stderr.index("rank 1 fails on purpose") < result.stderr.index(last)


def test_runner_launch_names_the_rank_that_raised_not_the_peer_that_failed_first(tmp_path, env):
    (tmp_path / "job.py").write_text(RAISING)
    result = _runner("launch", "--cpu", "--num_processes", "2", "job.py", cwd=tmp_path, env=env)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Connection closed by peer" in result.stderr or "Connection reset by peer" in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == "runner launch: error: worker rank 1 failed (ValueError: boom on rank 1); its output is above."


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.py"], "the script missing.py is not a file; give the path of the Python script (or -m module)."),
        (["--num_gpus", "2", "missing.py"], "--num_gpus is not a flag of runner launch (words after the script go to "
                                            "the script); see `runner launch --help`."),
    ],
)  # fmt: skip
def test_refused_before_anything_starts(tmp_path, env, args, message):
    result = _runner("launch", *args, cwd=tmp_path, env=env, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"runner launch: error: {message}\n")
