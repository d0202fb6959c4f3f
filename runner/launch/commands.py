"""``runner launch``, ``runner config``, ``runner env``: Accelerate's three commands for a plain engine script.

``runner/cli`` hands these over before anything of Hydra's is imported. Their flags are Accelerate's
(``--num_processes 2``, also ``--num-processes 2``: flags.py); a bad one is one sentence and exit
code 2, never a usage dump. What each command does is in its own module: script.py (launch),
configure.py (config), env_report.py (env); their settings and file are settings.py's.
"""

from __future__ import annotations

import sys

from runner.launch.settings import LaunchError

USAGE_ERROR = 2
COMMANDS = ("launch", "config", "env")


def command_of(argv: list[str]) -> str | None:
    """The command ``runner *argv`` names: its first word, exactly ``launch``, ``config`` or ``env``; else None.

    Only the whole first word counts, so a Hydra command line (``launch=1``, ``./launch``, ``--cfg job``,
    ``-m key=a,b``) is never taken for one.
    """
    return argv[0] if argv[:1] and argv[0] in COMMANDS else None


def run_command(command: str, argv: list[str]) -> int:
    """Run ``runner <command> *argv``; return its exit code."""
    from runner.launch import configure, env_report, script

    main = {"launch": script.main, "config": configure.main, "env": env_report.main}[command]
    try:
        return main(argv)
    except LaunchError as error:
        print(f"runner {command}: error: {error}.", file=sys.stderr)
        return USAGE_ERROR
