"""The README's engine script runs as written, on one process and under torchrun on two."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_script() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1, "the README should hold exactly one python example"
    return blocks[0]


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
