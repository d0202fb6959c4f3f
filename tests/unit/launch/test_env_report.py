"""runner env prints what a bug report needs: the versions (from installed metadata), the machine, the variables
that change a launch, and the launch config in use."""

from importlib import metadata

import torch

import runner
from runner.launch.env_report import environment_report, main


def _lines(report):
    return dict(line[2:].split(": ", 1) for line in report.splitlines() if line.startswith("- "))


def test_versions_machine_and_no_launch_config(config_home, monkeypatch):
    monkeypatch.setenv("RUNNER_MIXED_PRECISION", "fp16")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    lines = _lines(environment_report())
    assert lines["runner version"] == runner.__version__
    build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build of torch"
    assert lines["torch version"] == f"{torch.__version__} ({build})"
    assert lines["CUDA available"] == str(torch.cuda.is_available())
    assert lines["GPUs"].split(":")[0] == str(torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert int(lines["CPUs"]) >= 1
    assert f"hydra-core {metadata.version('hydra-core')}" in lines["Packages"]
    assert "RUNNER_MIXED_PRECISION=fp16" in lines["Environment"]
    path = config_home / "runner" / "launch.yaml"
    assert lines["Launch config"] == f"none (no file at {path}; `runner config` writes one)"


def test_the_launch_config_in_use_and_whether_launch_takes_it(tmp_path, config_home, capsys):
    path = config_home / "runner" / "launch.yaml"
    path.parent.mkdir(parents=True)
    path.write_text("# mine\nnum_processes: 2\nmixed_precision: bf16\n")
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Copy and paste the text below into your bug report.\n")
    assert out.endswith(f"- Launch config: {path}\n    num_processes: 2\n    mixed_precision: bf16\n")
    (tmp_path / "bad.yaml").write_text("num_gpus: 2\n")
    report = environment_report(str(tmp_path / "bad.yaml"))
    assert f"- Launch config: {tmp_path / 'bad.yaml'} (runner launch refuses it: num_gpus in " in report
    assert report.endswith("\n    num_gpus: 2")


def test_a_launch_config_that_is_not_utf_8_is_reported_not_raised(tmp_path, config_home):
    path = tmp_path / "latin.yaml"
    path.write_bytes("num_processes: 2  # r\xe9glage\n".encode("latin-1"))
    report = environment_report(str(path))
    assert f"- Launch config: {path} (runner launch refuses it: the config file {path} is not UTF-8 text; " in report
    assert report.endswith("\n    num_processes: 2  # r\ufffdglage")
