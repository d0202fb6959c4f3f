"""The command lines of ``runner launch``, ``runner config`` and ``runner env``: Accelerate's flag names.

Each setting is a flag named as its key (``--num_processes``, also spelled ``--num-processes``);
``runner launch``'s script and everything after it belong to the script.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from runner.launch.settings import (
    SETTINGS,
    LaunchError,
    LaunchSettings,
    config_file_path,
    parse_setting,
    read_config_file,
)


class _Parser(argparse.ArgumentParser):
    """Errors are one sentence (LaunchError), not a usage dump; remembers the flags that take a value."""

    value_flags: set[str]

    def error(self, message: str):
        message = re.sub(r"^argument ([^/:]+)\S*: expected one argument$", r"\1 needs a value", message)
        no_value = r"^argument ([^/:]+)\S*: ignored explicit argument '(.*)'$"  # --cpu=1
        message = re.sub(no_value, r"\1 takes no value: write \1, not \1=\2", message)
        raise LaunchError(f"{message}; see `{self.prog} --help`")

    def add_argument(self, *names, **options):
        if options.get("action") in (None, "store"):
            self.value_flags = {*getattr(self, "value_flags", ()), *names}
        return super().add_argument(*names, **options)


DESCRIPTIONS = {
    "launch": "Start a plain script that uses runner.engine's Accelerator on several processes, as `accelerate "
    "launch` does; everything after the script goes to the script. Flags win over the config file. "
    "--num_processes counts the processes of every machine, as in Accelerate.",
    "config": "Write the config file that `runner launch` reads: on a terminal with no flags it asks for each "
    "value, else it writes the defaults with the flags given.",
    "env": "Print what a bug report needs: versions, the machine, and the launch config in use.",
}


def build_parser(command: str) -> _Parser:
    """The flags of ``runner launch``, ``runner config`` (every setting, --config_file) or ``runner env``."""
    script = " script.py [script arguments]" if command == "launch" else ""
    parser = _Parser(
        prog=f"runner {command}",
        usage=f"runner {command} [flags]{script}",
        description=DESCRIPTIONS[command],
        allow_abbrev=False,
    )
    parser.add_argument(
        "--config_file", "--config-file", metavar="FILE",
        help="the launch config file (default: $RUNNER_CONFIG_FILE, else "
        "${XDG_CONFIG_HOME:-~/.config}/runner/launch.yaml)",
    )  # fmt: skip
    if command == "env":
        return parser
    for key, setting in SETTINGS.items():
        names = [setting.flag] + (["--use_cpu"] if key == "use_cpu" else [])
        names += [name.replace("_", "-") for name in names if "_" in name]
        if setting.kind is bool:
            parser.add_argument(*names, dest=key, action="store_const", const=True, help=setting.question)
        else:
            default = f" (default: {setting.unset or getattr(LaunchSettings(), key)})"
            parser.add_argument(*names, dest=key, metavar=setting.metavar, help=setting.question + default)
    if command == "launch":
        parser.add_argument(
            "--multi_gpu", "--multi-gpu", action="store_true",
            help="accepted, as in Accelerate; the number of processes decides",
        )  # fmt: skip
        parser.add_argument("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    return parser


def parse_settings_flags(parser: _Parser, argv: list[str]) -> tuple[argparse.Namespace, dict]:
    """The namespace and the checked setting values given as flags (--help prints and exits here).

    Raises:
        LaunchError: A flag the command does not take, or a bad value.
    """
    namespace, unknown = parser.parse_known_args(argv)
    if unknown:
        after = " (words after the script go to the script)" if parser.prog == "runner launch" else ""
        raise LaunchError(f"{unknown[0]} is not a flag of {parser.prog}{after}; see `{parser.prog} --help`")
    flags = {
        key: parse_setting(key, getattr(namespace, key), where=SETTINGS[key].flag, text=True)
        for key in SETTINGS
        if getattr(namespace, key, None) is not None  # runner env takes no setting
    }
    return namespace, flags


def read_launch_config(named: str | None) -> tuple[Path | None, dict]:
    """The config file in use and its values: ``--config_file``'s (which must exist), else the default if present."""
    path = config_file_path(named)
    if named is not None and not path.is_file():
        raise LaunchError(f"--config_file {named} is not a file; write it with `runner config --config_file {named}`")
    return (path, read_config_file(path)) if path.is_file() else (None, {})


def split_at_script(argv: list[str], parser: _Parser) -> tuple[list[str], list[str]]:
    """The launcher's flags, and the script with its arguments: everything from the first word that is not a
    flag or a flag's value (or after ``--``), so the script's own flags never reach the launcher."""
    index = 0
    while index < len(argv):
        word = argv[index]
        if word == "--":
            return argv[:index], argv[index + 1 :]
        if not word.startswith("-") or word == "-":
            break
        index += 2 if word in parser.value_flags else 1
    return argv[:index], argv[index:]
