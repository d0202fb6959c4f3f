"""Every command line of the README composes and passes the checks as written, and its table of config groups lists
the options `runner --help` lists. (Running them is the end-to-end tests' part: tests/e2e/test_readme.py runs the
README's script and project; the others run the presets.)"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from runner.config import CONF_DIR, CONFIG_NAME, ConfigError, register_configs
from runner.config import overrides as parsed
from runner.config.check import check_overrides
from runner.config.search_path import search_path_overrides
from tests.e2e.test_readme import readme_project

register_configs()
README = Path(__file__).resolve().parents[3] / "README.md"
# What `runner VERB ...` dispatches to a command of its own (runner/cli/__init__.py, runner/launch/commands.py).
VERBS = {"launch", "config", "env", "export", "generate", "status", "eval", "report", "runs", "diff", "check-resume"}
PLACEHOLDER = re.compile(r"<[^>]*>")  # <shakespeare_hf run>, <run folder>: a value the reader fills in


def readme_command_lines() -> list[tuple[str, str | None]]:
    """The runner's command lines in the README's plain code blocks, as typed (continued lines joined, without a
    ``$ `` or a comment), each with the refusal the README shows under it (a ``runner: error: ...`` line), if any."""
    found, fence, pending = [], None, ""
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            fence, pending = (line[3:] if fence is None else None), ""
            continue
        if fence != "":
            continue
        if line.startswith("runner: error: ") and found:
            found[-1] = (found[-1][0], line.removeprefix("runner: error: "))
            continue
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1]
            continue
        pending = ""
        command = re.split(r"\s+#\s", line.removeprefix("$ "), maxsplit=1)[0].strip()
        if re.match(r"(python -m runner(\s|$)|runner\s|torchrun\s.*-m runner\s)", command):
            found.append((command, None))
    return found


def runner_arguments(command: str) -> list[str]:
    """The words after ``runner`` / ``python -m runner`` / ``torchrun ... -m runner``, placeholders filled in."""
    words = shlex.split(PLACEHOLDER.sub("x", command))
    if words[0] == "runner":
        return words[1:]
    return words[words.index("runner") + 1 :]


COMMANDS = readme_command_lines()


def test_the_readme_holds_the_commands_this_test_reads():
    assert len(COMMANDS) >= 40, COMMANDS  # the Examples block alone holds 29
    assert ("python -m runner -m hydra/launcher=slurm experiment=mnist_ddp", None) in COMMANDS
    assert sum(refusal is not None for _, refusal in COMMANDS) >= 1


@pytest.mark.parametrize(("command", "refusal"), COMMANDS)
def test_each_readme_command_composes_and_passes_the_checks(command, refusal, tmp_path, monkeypatch, request):
    arguments = runner_arguments(command)
    if arguments and arguments[0] in VERBS:
        return  # a command of its own: its end-to-end test runs it (tests/e2e, tests/unit/cli)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # commands for larger machines than this one pass as well
    config_dir = None
    if "--config-dir" in arguments or any(word.startswith("hydra.searchpath=") for word in arguments):
        for path, text in readme_project().items():  # the README's own project, written as it shows it
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_text(text)
        monkeypatch.chdir(tmp_path)
        monkeypatch.syspath_prepend(str(tmp_path))  # as the runner imports a project from its working directory
        request.addfinalizer(_forget_mylab)  # this project's modules, for no other test to import by mistake
        _forget_mylab()
    if "--config-dir" in arguments:
        config_dir = str(tmp_path / arguments[arguments.index("--config-dir") + 1])
    flags = {"-m", "--multirun", "--help", "--cfg", "job", "--config-dir", "./conf"}
    overrides = [word for word in arguments if word not in flags]
    if refusal is not None:  # the README shows how the runner refuses it: so it must, in those words
        with pytest.raises(ConfigError) as refused:
            check_overrides(overrides, config_dir=config_dir)
        assert str(refused.value) == refusal
        return
    check_overrides(overrides, config_dir=config_dir, targets=False)  # a ConfigError, one sentence, if refused
    # Hydra's own overrides (a launcher, a sweeper: hparams_search sets Hydra's sweeper) compose too, each sweep at its
    # first value.
    if not any(parsed.is_hydra(o) or o.startswith("hparams_search=") for o in overrides):
        return
    first = [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" if o.is_sweep_override() else o.input_line
             for o in parsed.parse(overrides)]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(CONFIG_NAME, overrides=[*first, *search_path_overrides([], config_dir=config_dir)],
                      return_hydra_config=True)  # fmt: skip
    assert cfg.hydra.job.name


def _forget_mylab() -> None:
    for name in [name for name in sys.modules if name.split(".")[0] == "mylab"]:
        del sys.modules[name]


def test_the_config_groups_table_lists_what_runner_help_lists():
    helped = subprocess.run([sys.executable, "-m", "runner", "--help"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(README.parent)})  # fmt: skip
    assert helped.returncode == 0, helped.stderr[-2000:]
    listed = dict(re.findall(r"^  (\w+):\s+([\w, ]+?)(?:\s+\(.*\))?$", helped.stdout, flags=re.M))
    section = README.read_text().split("### Config groups", 1)[1].split("\n\n", 2)[1]
    table = {}
    for row in section.splitlines()[2:]:
        group, options = row.split("|")[1:3]
        table[group.strip().strip("`")] = sorted(re.findall(r"`(\w+)`", options))
    helped_groups = {group: sorted(options.split(", ")) for group, options in listed.items() if group in table or
                     group == "hparams_search"}  # fmt: skip
    assert table == helped_groups
