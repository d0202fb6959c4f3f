"""The README's examples run as written: the engine script (one process, and two under torchrun) and
the user project of "Your own model and data"."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
# A file of the README's user project: its path in backquotes and a colon, then its block.
PROJECT_FILE = re.compile(r"`(\w[\w/]*\.(?:py|yaml))`:\n\n```(?:python|yaml)\n(.*?)```", flags=re.S)


def readme_script() -> str:
    text = PROJECT_FILE.sub("", README.read_text())
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 1, "the README should hold exactly one python script besides the project's files"
    return blocks[0]


def readme_project() -> dict[str, str]:
    """The files of the README's user project, by path."""
    return dict(PROJECT_FILE.findall(README.read_text()))


def test_readme_user_project_trains_from_its_own_folder(tmp_path):
    files = readme_project()
    assert set(files) == {
        "mylab/models.py", "mylab/data.py", "conf/model/tiny_mlp.yaml", "conf/data/blobs.yaml",
        "conf/experiment/blobs.yaml",
    }  # fmt: skip
    for name, text in {**files, "mylab/__init__.py": ""}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    command = [shutil.which("runner"), "--config-dir", "./conf", "experiment=blobs", "trainer.max_steps=40",
               "trainer.eval_every_n_steps=20", "hydra.run.dir=run"]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert summary["step"] == 40 and summary["eval/accuracy"] >= 0.95, summary


@pytest.mark.parametrize("nproc", [1, 2])
def test_readme_script_runs(tmp_path, nproc):
    script = tmp_path / "script.py"
    script.write_text(readme_script())
    command = [sys.executable, str(script)]
    if nproc > 1:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(script),
        ]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("epoch")]
    assert len(lines) == 3  # printed by the main process only
    assert all(line.endswith("over 512 samples") for line in lines)
    errors = [float(re.search(r"error ([\d.]+)", line).group(1)) for line in lines]
    assert errors[-1] < errors[0]
    project = tmp_path / "outputs" / "readme"
    assert sorted(p.name for p in (project / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2"]
    assert (project / "checkpoints" / "checkpoint_2" / f"random_states_{nproc - 1}.pt").is_file()
    assert (project / "model" / "model.safetensors").is_file()
