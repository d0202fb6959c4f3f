"""``runner config``: write the file ``runner launch`` reads, as ``accelerate config`` does.

On a terminal with no setting flags it asks for each value (Enter keeps the default shown);
otherwise it writes the defaults with the flags given over them. Either way it writes every setting
(replacing the file there, as Accelerate does) and prints where.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from runner.launch.flags import build_parser, parse_settings_flags
from runner.launch.settings import (
    SETTINGS,
    LaunchError,
    LaunchSettings,
    check_config_target,
    config_file_path,
    parse_setting,
    render_config_file,
    resolve,
    write_config_file,
)

# The order of the questions: the machines first, since the rest depends on them.
QUESTIONS = (
    "num_machines", "machine_rank", "main_process_ip", "main_process_port",
    "num_processes", "use_cpu", "gpu_ids", "mixed_precision", "max_restarts",
)  # fmt: skip
MULTI_MACHINE_KEYS = ("machine_rank", "main_process_ip", "main_process_port")


def main(argv: list[str]) -> int:
    """``runner config [--config_file F] [flags]``; returns the exit code."""
    namespace, given = parse_settings_flags(build_parser("config"), argv)
    path = config_file_path(namespace.config_file)
    check_config_target(path)  # before any question is asked
    if given or not sys.stdin.isatty():
        settings = resolve(given)
    else:
        try:
            settings = ask_settings(input)
        except (EOFError, KeyboardInterrupt):
            print(f"\nrunner config: stopped; {path} was not written.", file=sys.stderr)
            return 1
    write_config_file(path, settings)
    print(f"Wrote the launch config to {path} (`runner launch` reads it; its flags win):\n")
    print(render_config_file(settings), end="")
    return 0


def ask_settings(ask: Callable[[str], str]) -> LaunchSettings:
    """Ask for each setting that applies (no machine rank or address on one machine, no GPUs on the CPU).

    Raises:
        LaunchError: Answers that are each valid but do not fit together.
    """
    answers: dict[str, Any] = {}
    for key in QUESTIONS:
        if key in MULTI_MACHINE_KEYS and answers["num_machines"] == 1:
            continue
        if key == "gpu_ids" and answers["use_cpu"]:
            continue
        answers[key] = _ask(key, ask)
    return resolve(answers)


def _ask(key: str, ask: Callable[[str], str]) -> Any:
    setting, default = SETTINGS[key], getattr(LaunchSettings(), key)
    shown = setting.unset if default is None else ("yes" if default else "no") if setting.kind is bool else default
    while True:
        answer = ask(f"{setting.question}? [{shown}]: ")
        if not answer.strip():
            return default
        try:
            return parse_setting(key, answer, where="the answer", text=True)
        except LaunchError as error:
            print(f"{error}; try again.")
