"""The Slurm launcher presets compose with Hydra's submitit plugin (jobs on a real cluster: test_slurm_cluster.py)."""

from tests.e2e.conftest import run_cli


def test_the_slurm_preset_composes_with_the_plugin(tmp_path):
    composed = run_cli("hydra/launcher=slurm", "hydra.launcher.partition=gpu", "--cfg", "hydra", cwd=tmp_path)
    assert composed.returncode == 0, composed.stderr[-3000:]
    launcher = composed.stdout.split("  launcher:\n", 1)[1]
    assert "SlurmLauncher" in launcher and "partition: gpu" in launcher and "signal_delay_s: 120" in launcher
    cpu = run_cli("hydra/launcher=slurm_cpu", "--cfg", "hydra", cwd=tmp_path)
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    launcher = cpu.stdout.split("  launcher:\n", 1)[1]
    assert "gpus_per_node: null" in launcher and "signal_delay_s: 120" in launcher and "max_num_timeout: 3" in launcher
