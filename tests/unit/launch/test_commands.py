"""runner launch / config / env read their command line: Accelerate's flag spellings, the script and its own
arguments untouched, the config file under the flags, and a bad flag as one sentence with exit code 2. runner/cli
hands them over before anything of Hydra's (or torch) is imported."""

import subprocess
import sys
from pathlib import Path

import pytest

from runner.launch.commands import command_of, run_command
from runner.launch.flags import build_parser, split_at_script
from runner.launch.script import read_script_command
from runner.launch.settings import LaunchSettings

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture()
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("train.py").write_text("print('hi')\n")
    return "train.py"


@pytest.mark.parametrize(
    ("argv", "flags", "rest"),
    [
        (["--num_processes", "2", "train.py", "--num_processes", "3"], ["--num_processes", "2"],
         ["train.py", "--num_processes", "3"]),
        (["--cpu", "--num-processes=2", "-m", "pkg.train", "-m", "x"], ["--cpu", "--num-processes=2", "-m"],
         ["pkg.train", "-m", "x"]),
        (["--mixed_precision", "bf16", "--", "-odd.py", "a"], ["--mixed_precision", "bf16"], ["-odd.py", "a"]),
        (["--num_processes"], ["--num_processes"], []),
    ],
)  # fmt: skip
def test_the_script_starts_at_the_first_word_that_is_not_a_flag_or_its_value(argv, flags, rest):
    assert split_at_script(argv, build_parser("launch")) == (flags, rest)


@pytest.mark.usefixtures("config_home")
def test_accelerate_flags_and_their_dashed_spellings(script):
    command = read_script_command(
        ["--num-processes", "4", "--num_machines", "2", "--machine-rank", "1", "--main_process_ip", "10.0.0.1",
         "--main-process-port", "29501", "--mixed_precision", "fp16", "--gpu_ids", "0,1", "--max_restarts", "2",
         "--multi_gpu", script, "--lr", "3e-4"]
    )  # fmt: skip
    assert command.settings == LaunchSettings(
        num_processes=4, num_machines=2, machine_rank=1, main_process_ip="10.0.0.1", main_process_port=29501,
        mixed_precision="fp16", gpu_ids="0,1", max_restarts=2,
    )  # fmt: skip
    assert command.worker_arguments() == ["-u", "train.py", "--lr", "3e-4"]
    assert command.config_file is None


@pytest.mark.usefixtures("config_home")
def test_a_module_runs_with_python_m():
    command = read_script_command(["--cpu", "-m", "mylab.train", "--epochs", "1"])
    assert command.settings.use_cpu and command.module
    assert command.worker_arguments() == ["-u", "-m", "mylab.train", "--epochs", "1"]


def test_the_default_file_is_read_and_flags_win_over_it(script, config_home):
    (config_home / "runner").mkdir(parents=True)
    (config_home / "runner" / "launch.yaml").write_text("num_processes: 2\nmixed_precision: bf16\nuse_cpu: true\n")
    command = read_script_command(["--mixed_precision", "fp16", script])
    assert command.settings == LaunchSettings(num_processes=2, mixed_precision="fp16", use_cpu=True)
    assert command.config_file == config_home / "runner" / "launch.yaml"


def test_config_file_wins_over_the_default_file(script, config_home, tmp_path):
    (config_home / "runner").mkdir(parents=True)
    (config_home / "runner" / "launch.yaml").write_text("num_processes: 2\n")
    (tmp_path / "mine.yaml").write_text("max_restarts: 1\n")
    command = read_script_command(["--config_file", str(tmp_path / "mine.yaml"), script])
    assert command.settings == LaunchSettings(max_restarts=1)


def test_runner_config_file_names_the_default_file(script, config_home, tmp_path, monkeypatch):
    (tmp_path / "team.yaml").write_text("num_processes: 3\n")
    monkeypatch.setenv("RUNNER_CONFIG_FILE", str(tmp_path / "team.yaml"))
    assert read_script_command([script]).settings.num_processes == 3


@pytest.mark.usefixtures("config_home")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "no script given: runner launch [flags] script.py [script arguments]."),
        (["--cpu"], "no script given: runner launch [flags] script.py [script arguments]."),
        (["missing.py"], "the script missing.py is not a file; give the path of the Python script (or -m module)."),
        (["--num_processes", "0", "train.py"], "--num_processes must be a whole number of at least 1, not 0."),
        (["--mixed_precision", "fp32", "train.py"], "--mixed_precision must be one of no, fp16, bf16, fp8, not fp32."),
        (["--num_processes"], "--num_processes needs a value; see `runner launch --help`."),
        (["--debug", "train.py"], "--debug is not a flag of runner launch (words after the script go to the script); "
                                  "see `runner launch --help`."),
        (["--num_machines", "2", "--machine_rank", "2", "--main_process_ip", "h", "train.py"],
         "--machine_rank is 2, but there are 2 machine(s) (--num_machines), numbered from 0; give each machine its "
         "own rank below 2."),
        (["--num_machines", "2", "train.py"], "2 machines (--num_machines) need the address of machine 0: pass "
                                              "--main_process_ip (the same on every machine)."),
        (["--config_file", "nope.yaml", "train.py"],
         "--config_file nope.yaml is not a file; write it with `runner config --config_file nope.yaml`."),
        (["--cpu=1", "train.py"], "--cpu takes no value: write --cpu, not --cpu=1; see `runner launch --help`."),
    ],
)  # fmt: skip
def test_a_bad_command_line_is_one_sentence_and_exit_code_2(script, capsys, argv, message):
    assert run_command("launch", argv) == 2
    captured = capsys.readouterr()
    assert captured.err == f"runner launch: error: {message}\n"
    assert captured.out == ""


def test_a_bad_config_file_is_exit_code_2(script, config_home, capsys):
    (config_home / "runner").mkdir(parents=True)
    (config_home / "runner" / "launch.yaml").write_text("num_gpus: 2\n")
    assert run_command("launch", [script]) == 2
    assert capsys.readouterr().err.startswith(
        f"runner launch: error: num_gpus in {config_home / 'runner' / 'launch.yaml'} is not a setting of runner launch"
    )


def test_config_and_env_refuse_flags_they_do_not_take(config_home, capsys):
    assert run_command("config", ["--module"]) == 2
    assert (
        capsys.readouterr().err
        == "runner config: error: --module is not a flag of runner config; see `runner config --help`.\n"
    )
    assert run_command("env", ["--cpu"]) == 2
    assert capsys.readouterr().err == "runner env: error: --cpu is not a flag of runner env; see `runner env --help`.\n"


_IMPORTS = """
import sys
import runner.cli
sys.argv = ["runner", *sys.argv[1:]]
try:
    runner.cli.main()
except SystemExit as stop:
    print("exit", stop.code, sorted(m for m in ("torch", "hydra", "omegaconf") if m in sys.modules))
"""


@pytest.mark.parametrize("command", ["launch", "config", "env"])
def test_help_is_the_usage_and_imports_neither_torch_nor_hydra(command):
    done = subprocess.run(
        [sys.executable, "-c", _IMPORTS, command, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.startswith(f"usage: runner {command} [flags]")
    assert done.stdout.splitlines()[-1] == "exit 0 []"
    assert done.stderr == ""


def test_a_refused_launch_imports_neither_torch_nor_hydra(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", _IMPORTS, "launch", "--num_processes", "0", "train.py"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.stdout.splitlines()[-1] == "exit 2 []"
    assert done.stderr == "runner launch: error: --num_processes must be a whole number of at least 1, not 0.\n"


def test_runner_help_lists_the_script_commands():
    done = subprocess.run(
        [sys.executable, "-m", "runner", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    usage = done.stdout.split("Config groups")[0]
    assert "runner launch [--num_processes N ...] script.py [args]" in usage
    assert "runner config | runner env" in usage
    # Each tracker preset's keys, as conf/tracker/ and runner.config's schemas have them.
    from runner.config import MLflowTrackerConfig, WandBTrackerConfig

    trackers, where = done.stdout.split("Trackers:")[1].split("`python -m runner --cfg job")[0].split("They run in")
    assert (
        where.split()
        == "a helper process (trainer.tracker_process=true, on Linux); false keeps them in the training's.".split()
    )
    listed = {line.split()[0]: line for line in trackers.replace("\n" + " " * 15, " ").splitlines()[1:] if line}
    assert list(listed) == ["tensorboard", "csv", "mlflow", "wandb", "your"]
    for name, schema in (("mlflow", MLflowTrackerConfig), ("wandb", WandBTrackerConfig)):
        assert all(f"{key}" in listed[name] for key in schema.__dataclass_fields__), listed[name]


@pytest.mark.parametrize(
    "argv",
    [["launch=1"], ["./launch"], ["launch.py"], ["--cfg", "job", "env"], ["-m", "config=a,b"], ["Launch"],
     ["env=prod", "launch"], []],
)  # fmt: skip
def test_a_hydra_command_line_is_not_taken_for_a_command(argv, monkeypatch):
    assert command_of(argv) is None

    class HydraPath(Exception):
        pass

    def refuse(*_):
        raise AssertionError(f"{argv} was taken for a command")

    def hydra_path(*_):
        raise HydraPath

    import runner.cli

    monkeypatch.setattr("runner.launch.commands.run_command", refuse)
    monkeypatch.setattr("runner.cli.command_line.parse_arguments", hydra_path)
    monkeypatch.setattr(runner.cli, "import_from_working_directory", lambda: None)
    monkeypatch.setattr(runner.cli, "quiet_plugin_schema_warning", lambda: None)
    monkeypatch.setattr("sys.argv", ["runner", *argv])
    with pytest.raises(HydraPath):
        runner.cli.main()


@pytest.mark.parametrize("command", ["launch", "config", "env"])
def test_the_first_word_alone_names_a_command(command):
    assert command_of([command, "--help"]) == command
