"""The settings of runner launch: each value checked where it comes from (a flag, or a key and its file), the file
under the flags, the combinations that cannot work, and where the default file is."""

from dataclasses import fields
from pathlib import Path

import pytest

from runner.launch.settings import (
    SETTINGS,
    LaunchError,
    LaunchSettings,
    config_file_path,
    parse_setting,
    read_config_file,
    render_config_file,
    resolve,
    write_config_file,
)


def test_every_field_is_a_setting_in_order():
    assert tuple(SETTINGS) == tuple(field.name for field in fields(LaunchSettings))


@pytest.mark.parametrize(
    ("key", "text", "value"),
    [
        ("num_processes", "4", 4),
        ("num_processes", "none", None),
        ("machine_rank", " 0 ", 0),
        ("main_process_port", "29501", 29501),
        ("mixed_precision", "bf16", "bf16"),
        ("gpu_ids", "0, 1", "0,1"),
        ("gpu_ids", "all", "all"),
        ("use_cpu", "yes", True),
        ("use_cpu", "False", False),
        ("max_restarts", "3", 3),
    ],
)
def test_text_is_typed(key, text, value):
    assert parse_setting(key, text, where="--x", text=True) == value


@pytest.mark.parametrize(
    ("key", "text", "message"),
    [
        ("num_processes", "0", "--num_processes must be a whole number of at least 1, not 0"),
        ("num_processes", "two", "--num_processes must be a whole number of at least 1, not two"),
        ("num_machines", "1.5", "--num_machines must be a whole number of at least 1, not 1.5"),
        ("machine_rank", "-1", "--machine_rank must be a whole number from 0, not -1"),
        ("main_process_port", "70000", "--main_process_port must be a port number from 1 to 65535, not 70000"),
        ("mixed_precision", "fp32", "--mixed_precision must be one of no, fp16, bf16, fp8, not fp32"),
        ("gpu_ids", "0,a", "--gpu_ids must be GPU numbers separated by commas (0,1) or all, not 0,a"),
        ("use_cpu", "maybe", "--cpu must be true or false, not maybe"),
        ("max_restarts", "", "--max_restarts must be a whole number from 0, not an empty value"),
    ],
)
def test_a_bad_value_is_one_sentence_naming_the_flag(key, text, message):
    with pytest.raises(LaunchError) as error:
        parse_setting(key, text, where=SETTINGS[key].flag, text=True)
    assert str(error.value) == message


def test_a_file_value_must_have_its_type(tmp_path):
    # From a file, "2" is a string and True is not a number; a bare `no` (YAML's false) is Accelerate's 'no'.
    with pytest.raises(LaunchError, match=r"^num_processes in F must be a whole number of at least 1, not '2'$"):
        parse_setting("num_processes", "2", where="num_processes in F", text=False)
    with pytest.raises(LaunchError, match="not True"):
        parse_setting("max_restarts", True, where="max_restarts in F", text=False)
    assert parse_setting("mixed_precision", False, where="m", text=False) == "no"
    assert parse_setting("gpu_ids", 0, where="g", text=False) == "0"


def test_flags_win_over_the_file_and_the_file_over_the_defaults():
    settings = resolve({"num_processes": 4}, file_values={"num_processes": 2, "mixed_precision": "fp16"})
    assert settings == LaunchSettings(num_processes=4, mixed_precision="fp16")
    assert resolve({}) == LaunchSettings()


@pytest.mark.parametrize(
    ("flags", "file_values", "message"),
    [
        ({"num_machines": 2, "machine_rank": 2, "main_process_ip": "h"}, {},
         r"^--machine_rank is 2, but there are 2 machine\(s\) \(--num_machines\), numbered from 0"),
        ({"num_machines": 2}, {},
         r"^2 machines \(--num_machines\) need the address of machine 0: pass --main_process_ip"),
        ({"num_processes": 3}, {"num_machines": 2, "main_process_ip": "h"},
         r"^--num_processes is 3, the processes over all 2 machines, and must be a multiple of "
         r"num_machines in F\.yaml$"),
        ({"num_processes": 3, "gpu_ids": "0,1"}, {},
         r"^--num_processes asks for 3 process\(es\) per machine, more than the 2 GPU\(s\) of --gpu_ids"),
    ],
)  # fmt: skip
def test_settings_that_do_not_fit_together_name_where_each_came_from(flags, file_values, message):
    with pytest.raises(LaunchError, match=message):
        resolve(flags, file_values=file_values, config_file=Path("F.yaml"))


def test_on_the_cpu_gpu_ids_do_not_limit_the_processes():
    assert resolve({"num_processes": 3, "gpu_ids": "0", "use_cpu": True}).num_processes == 3


def test_the_file_is_the_one_named_else_runner_config_file_else_under_xdg_config_home(monkeypatch, tmp_path):
    monkeypatch.delenv("RUNNER_CONFIG_FILE", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert config_file_path() == tmp_path / "xdg" / "runner" / "launch.yaml"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert config_file_path() == tmp_path / "home" / ".config" / "runner" / "launch.yaml"
    monkeypatch.setenv("RUNNER_CONFIG_FILE", str(tmp_path / "mine.yaml"))
    assert config_file_path() == tmp_path / "mine.yaml"
    assert config_file_path("~/named.yaml") == tmp_path / "home" / "named.yaml"  # --config_file wins


def test_a_written_file_reads_back_as_the_same_settings(tmp_path):
    settings = LaunchSettings(
        num_processes=4, num_machines=2, machine_rank=1, main_process_ip="10.0.0.1", main_process_port=29501,
        mixed_precision="no", gpu_ids="0,1", use_cpu=False, max_restarts=2,
    )  # fmt: skip
    path = tmp_path / "new" / "launch.yaml"
    write_config_file(path, settings)
    assert "mixed_precision: 'no'" in path.read_text()  # quoted: a bare no is YAML's false
    assert resolve({}, file_values=read_config_file(path)) == settings
    assert render_config_file(settings).startswith("# Read by `runner launch`")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("num_processes: 2\nnum_gpus: 1\n",
         r"^num_gpus in {file} is not a setting of runner launch; remove it \(settings: num_processes,"),
        # Accelerate's own file: every key it does not share, in one sentence.
        ("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\nuse_cpu: false\n",
         r"^compute_environment, distributed_type in {file} are not settings of runner launch; remove them "
         r"\(settings: num_processes, .*, max_restarts\)$"),
        ("num_processes: two\n",
         r"^num_processes in {file} must be a whole number of at least 1, not 'two'; fix it, or write it again with "
         r"`runner config`$"),
        ("use_cpu: 1\n", r"^use_cpu in {file} must be true or false, not 1;"),
        ("num_processes: [\n", r"^the config file {file} is not valid YAML at line 2; fix it"),
        ("- 1\n", r"^the config file {file} must be a mapping of settings \(key: value\), not \[1\]$"),
    ],
)  # fmt: skip
def test_a_bad_file_is_one_sentence_naming_the_file_and_key(tmp_path, text, message):
    path = tmp_path / "launch.yaml"
    path.write_text(text)
    with pytest.raises(LaunchError, match=message.format(file=str(path).replace(".", r"\."))):
        read_config_file(path)


def test_a_file_that_is_not_utf_8_is_one_sentence_naming_it(tmp_path):
    path = tmp_path / "launch.yaml"
    path.write_bytes("mixed_precision: bf16  # r\xe9glage\n".encode("latin-1"))
    with pytest.raises(LaunchError) as error:
        read_config_file(path)
    assert str(error.value) == (
        f"the config file {path} is not UTF-8 text; fix it, or write it again with `runner config`"
    )


def test_a_file_is_not_written_over_a_folder_or_under_a_file(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(LaunchError) as error:
        write_config_file(tmp_path / "afile" / "c.yaml", LaunchSettings())
    assert str(error.value) == (
        f"cannot write the config file {tmp_path / 'afile' / 'c.yaml'}: {tmp_path / 'afile'} is a file, not a "
        "folder; name another path"
    )
    (tmp_path / "adir").mkdir()
    with pytest.raises(LaunchError) as error:
        write_config_file(tmp_path / "adir", LaunchSettings())
    assert str(error.value) == (
        f"the config file {tmp_path / 'adir'} is a folder; name a file, such as {tmp_path / 'adir' / 'launch.yaml'}"
    )


def test_an_empty_file_sets_nothing(tmp_path):
    (tmp_path / "launch.yaml").write_text("# nothing yet\n")
    assert read_config_file(tmp_path / "launch.yaml") == {}
