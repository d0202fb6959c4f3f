"""runner config writes the file runner launch reads: from its flags (over the defaults), or, on a terminal with no
flags, from the answers to its questions (Enter keeps the default; a bad answer is asked again)."""

import io

import pytest

from runner.launch.configure import main
from runner.launch.settings import LaunchSettings, read_config_file, resolve


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _written(path):
    return resolve({}, file_values=read_config_file(path))


def test_from_flags_over_the_defaults_into_the_default_file(config_home, capsys):
    assert main(["--num_processes", "2", "--mixed-precision", "bf16", "--cpu"]) == 0
    path = config_home / "runner" / "launch.yaml"
    assert _written(path) == LaunchSettings(num_processes=2, mixed_precision="bf16", use_cpu=True)
    out = capsys.readouterr().out
    assert out.startswith(f"Wrote the launch config to {path}")
    assert "num_processes: 2\n" in out


def test_from_flags_replaces_the_file_there(tmp_path, config_home):
    path = tmp_path / "launch.yaml"
    path.write_text("max_restarts: 3\n")
    assert main(["--config_file", str(path), "--max_restarts", "1"]) == 0
    assert _written(path) == LaunchSettings(max_restarts=1)


def test_without_a_terminal_and_flags_it_writes_the_defaults(tmp_path, config_home, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["--config_file", str(tmp_path / "launch.yaml")]) == 0
    assert _written(tmp_path / "launch.yaml") == LaunchSettings()


def _answering(monkeypatch, answers):
    asked = []

    def answer(prompt):
        asked.append(prompt)
        return answers.pop(0)

    monkeypatch.setattr("sys.stdin", _Terminal())
    monkeypatch.setattr("builtins.input", answer)
    return asked


def test_on_a_terminal_it_asks_each_value_with_its_default(tmp_path, config_home, monkeypatch, capsys):
    # One machine: no questions about its rank or machine 0's address; a bad answer is asked again.
    asked = _answering(monkeypatch, ["", "two", "2", "", "0,1", "fp32", "fp16", ""])
    assert main(["--config_file", str(tmp_path / "launch.yaml")]) == 0
    assert asked == [
        "How many machines? [1]: ",
        "How many processes in all, over every machine? [one per GPU, or 1 on the CPU]: ",
        "How many processes in all, over every machine? [one per GPU, or 1 on the CPU]: ",
        "Run on the CPU only, even with GPUs? [no]: ",
        "Which GPUs, by number (0,1) or all? [all]: ",
        "Mixed precision? [no]: ",
        "Mixed precision? [no]: ",
        "Restarts of every process after a failure? [0]: ",
    ]
    assert _written(tmp_path / "launch.yaml") == LaunchSettings(num_processes=2, gpu_ids="0,1", mixed_precision="fp16")
    out = capsys.readouterr().out
    assert "the answer must be a whole number of at least 1, not two; try again.\n" in out
    assert "the answer must be one of no, fp16, bf16, fp8, not fp32; try again.\n" in out


def test_several_machines_are_asked_for_this_ones_rank_and_machine_0(tmp_path, config_home, monkeypatch):
    asked = _answering(monkeypatch, ["2", "1", "host-a", "", "16", "y", "bf16", "2"])
    assert main(["--config_file", str(tmp_path / "launch.yaml")]) == 0
    assert "The rank of this machine? [0]: " in asked
    assert not any(prompt.startswith("Which GPUs") for prompt in asked)  # on the CPU
    assert _written(tmp_path / "launch.yaml") == LaunchSettings(
        num_processes=16, num_machines=2, machine_rank=1, main_process_ip="host-a", mixed_precision="bf16",
        use_cpu=True, max_restarts=2,
    )  # fmt: skip


def test_stopping_at_a_question_writes_nothing(tmp_path, config_home, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", _Terminal())

    def end_of_input(prompt):
        raise EOFError

    monkeypatch.setattr("builtins.input", end_of_input)
    assert main(["--config_file", str(tmp_path / "launch.yaml")]) == 1
    assert not (tmp_path / "launch.yaml").exists()
    assert "was not written" in capsys.readouterr().err


@pytest.mark.usefixtures("config_home")
def test_settings_that_do_not_fit_are_refused_before_writing(tmp_path):
    from runner.launch.settings import LaunchError

    with pytest.raises(LaunchError, match=r"^2 machines \(--num_machines\) need the address of machine 0"):
        main(["--config_file", str(tmp_path / "launch.yaml"), "--num_machines", "2"])
    assert not (tmp_path / "launch.yaml").exists()


@pytest.mark.parametrize("make", ["file above", "folder"])
def test_a_path_that_cannot_be_a_file_is_exit_code_2_before_any_question(tmp_path, config_home, monkeypatch, capsys,
                                                                         make):  # fmt: skip
    from runner.launch.commands import run_command

    (tmp_path / "afile").write_text("")
    (tmp_path / "adir").mkdir()
    named = tmp_path / ("afile/c.yaml" if make == "file above" else "adir")
    asked = _answering(monkeypatch, [])
    assert run_command("config", ["--config_file", str(named)]) == 2
    assert asked == []
    expected = (
        f"cannot write the config file {named}: {tmp_path / 'afile'} is a file, not a folder; name another path"
        if make == "file above"
        else f"the config file {named} is a folder; name a file, such as {named / 'launch.yaml'}"
    )
    assert capsys.readouterr().err == f"runner config: error: {expected}.\n"
