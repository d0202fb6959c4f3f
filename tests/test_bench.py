"""Every benchmark runs (its --quick mode), so none of them rots. No timing is asserted here."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_every_benchmark_runs_and_reports_its_ratios(tmp_path):
    result = subprocess.run(
        [sys.executable, str(BENCH / "all.py"), "--quick", "--json-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    reports = {path.stem: json.loads(path.read_text()) for path in tmp_path.glob("*.json")}
    assert set(reports) == {"overhead", "step", "startup", "checkpoint", "dataloader", "memory", "tokens"}
    for name, report in reports.items():
        assert report["ratios"], name
        for label, ratio in report["ratios"].items():
            assert ratio["ratio"] > 0 and ratio["met"] in (True, False, None), (name, label)
        assert all(value >= 0 for value in report["values"].values()), name
    checkpoint = reports["checkpoint"]["values"]
    assert checkpoint["parameters"] == 16 * (512 * 512 + 512)
    assert reports["startup"]["values"]["--help imports torch"] == 0  # --help never imports torch
    assert reports["startup"]["values"]["rejected override imports torch"] == 0
    assert "Ratios against the baselines:" in result.stdout and "engine / raw" in result.stdout
