"""Every benchmark runs (its --quick mode) through bench/all.py, so none of them rots. No timing is asserted here.

One test per benchmark, so that none takes the whole minute they take together.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
_spec = importlib.util.spec_from_file_location("bench_all", BENCH / "all.py")  # bench/ is scripts, not a package
_all = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_all)
BENCHMARKS = _all.BENCHMARKS  # what `python bench/all.py` runs


def test_bench_all_runs_every_benchmark_named_here():
    scripts = {path.stem for path in BENCH.glob("*.py")} - {"all", "common"}
    assert set(BENCHMARKS) == scripts
    listed = subprocess.run([sys.executable, str(BENCH / "all.py"), "--help"], capture_output=True, text=True)
    assert f"default: all of {', '.join(BENCHMARKS)}" in " ".join(listed.stdout.split())
    refused = subprocess.run([sys.executable, str(BENCH / "all.py"), "--quick", "nope"], capture_output=True, text=True)
    assert refused.returncode == 2 and "no benchmark named nope; the benchmarks are overhead, step" in refused.stderr


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_runs_and_reports_its_ratios(tmp_path, name):
    result = subprocess.run(
        [sys.executable, str(BENCH / "all.py"), "--quick", "--json-dir", str(tmp_path), name],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    reports = {path.stem: json.loads(path.read_text()) for path in tmp_path.glob("*.json")}
    assert set(reports) == {name}
    report = reports[name]
    assert report["ratios"], name
    for label, ratio in report["ratios"].items():
        assert ratio["ratio"] > 0 and ratio["met"] in (True, False, None), (name, label)
        assert f"  {name:<11} {label:<44} " in result.stdout  # the summary lists every ratio
    assert all(value >= 0 for value in report["values"].values()), name
    assert "Ratios against the baselines:" in result.stdout
    if name in ("overhead", "memory"):
        assert "engine / raw" in report["ratios"]
    if name == "checkpoint":
        assert report["values"]["parameters"] == 16 * (512 * 512 + 512)
    if name == "trackers":  # every tracker beside none, in the helper process, and all four on a thread too
        assert {label for label in report["ratios"] if label.startswith("cnn: ")} == {
            f"cnn: {tracker} / none"
            for tracker in ("none (again)", "tensorboard", "csv", "mlflow", "wandb", "all", "all (thread)")
        }
        assert {label for label, ratio in report["ratios"].items() if ratio["target"]} == {
            f"cnn: {tracker} / none" for tracker in ("tensorboard", "csv", "mlflow", "wandb", "all")
        }  # the target is the runner's default: the trackers in their helper process
        helpers = ("tensorboard", "csv", "mlflow", "wandb", "all")
        handing = {label for label in report["values"] if label.endswith(" handing over, CPU us/step")}
        assert handing == {f"cnn: {tracker} handing over, CPU us/step" for tracker in helpers}  # not on a thread
        assert all(report["values"][f"cnn: {tracker} log() us/call"] > 0 for tracker in (*helpers, "none"))
        assert "cnn: quartiles of the rounds' ratios to none: none (again) " in result.stdout
    if name == "startup":
        assert report["values"]["--help imports torch"] == 0  # --help never imports torch
        assert report["values"]["rejected override imports torch"] == 0
        assert {label for label in report["ratios"] if "last line to exit" in label} == {
            f"{command}: last line to exit / plain script's" for command in ("python -m runner", "experiment=mnist_ddp")
        }  # a run's end, beside a plain script's that imports as much
        assert {label for label in report["ratios"] if "first line" in label} == {
            f"{command}: first line / import torch's line" for command in ("python -m runner", "experiment=mnist_ddp")
        }  # a run's first line, beside a script's that imports torch and prints


def test_paired_ratio_cancels_the_machines_drift(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_common", BENCH / "common.py")
    common = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_common", common)  # its dataclass looks its module up there
    spec.loader.exec_module(common)
    baseline = [1.0, 1.2, 0.9, 1.5, 1.1]  # the machine's pace moving from round to round
    assert common.paired_ratio([1.01 * x for x in baseline], baseline) == pytest.approx((1.01, 1.01, 1.01))
    ratio, low, high = common.paired_ratio([1.0, 1.3, 0.9, 1.5, 1.0], baseline)
    assert (ratio, low, high) == pytest.approx((1.0, 0.9545, 1.0417), abs=1e-4)
    assert common.paired_ratio([2.0], [1.0]) == (2.0, 2.0, 2.0)
    with pytest.raises(ValueError):  # rounds left out on one side would pair the wrong rounds
        common.paired_ratio([1.0, 1.0], [1.0])
