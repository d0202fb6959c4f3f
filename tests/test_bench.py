"""The benchmarks run (their --quick mode), so they never rot. No timing is asserted here."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_checkpoint_benchmark_quick(tmp_path):
    out = tmp_path / "checkpoint.json"
    result = subprocess.run(
        [sys.executable, str(BENCH / "checkpoint.py"), "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["parameters"] == 16 * (512 * 512 + 512) and report["rounds"] == 2
    assert set(report["median_seconds"]) == {
        "save_state", "save_state_async", "save_file", "copy_save", "sha256",
        "load_state", "load_unverified", "load_file", "copy_load",
    }  # fmt: skip
    assert all(seconds > 0 for seconds in report["median_seconds"].values())
    assert "save_state / save_file" in result.stdout
