"""The settings of ``runner launch``: their keys, their checks, and the YAML file ``runner config`` writes.

A setting has one name everywhere: the key in the file is the flag without its dashes
(``--num_processes`` / ``num_processes:``), as in Accelerate. Values come from three places, each
overriding the one before: the defaults here, the config file, the command line. Each value is
checked where it comes from, so an error names the flag, or the key and the file, in one sentence;
:func:`resolve` then checks the combinations. Nothing here imports torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

CONFIG_FILE_ENV = "RUNNER_CONFIG_FILE"  # the default config file's path, when set
MIXED_PRECISION_CHOICES = ("no", "fp16", "bf16", "fp8")
DEFAULT_MULTI_MACHINE_PORT = 29500  # Accelerate's and torchrun's default with several machines


class LaunchError(ValueError):
    """A setting, flag or config file that ``runner launch`` cannot use; one sentence."""


@dataclass(frozen=True)
class LaunchSettings:
    """What ``runner launch`` starts, as ``accelerate launch`` takes it."""

    num_processes: int | None = None  # in all, over every machine; None: one per GPU (per --gpu_ids), 1 on the CPU
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None  # machine 0's address; needed with several machines
    main_process_port: int | None = None  # None: a free port on one machine, 29500 with several
    mixed_precision: str = "no"
    gpu_ids: str | None = None  # "0,1" (CUDA_VISIBLE_DEVICES) or "all"; None: every visible GPU
    use_cpu: bool = False
    max_restarts: int = 0


@dataclass(frozen=True)
class Setting:
    key: str
    kind: type  # int, str or bool
    expects: str  # completes "must be ..." in an error
    question: str  # what `runner config` asks
    optional: bool = False  # null allowed
    valid: Callable[[Any], bool] = lambda value: True
    unset: str = ""  # what null means, for --help and the prompt
    metavar: str = "N"  # for --help

    @property
    def flag(self) -> str:
        return "--cpu" if self.key == "use_cpu" else f"--{self.key}"


def _gpu_ids_valid(value: str) -> bool:
    return value == "all" or all(part.strip().isdigit() for part in value.split(","))


SETTINGS = {
    setting.key: setting
    for setting in (
        Setting(
            "num_processes", int, "a whole number of at least 1", "How many processes in all, over every machine",
            optional=True, valid=lambda n: n >= 1, unset="one per GPU, or 1 on the CPU",
        ),
        Setting("num_machines", int, "a whole number of at least 1", "How many machines", valid=lambda n: n >= 1),
        Setting(
            "machine_rank", int, "a whole number from 0", "The rank of this machine",
            valid=lambda n: n >= 0, metavar="RANK",
        ),
        Setting(
            "main_process_ip", str, "a host name or IP address", "The address of machine 0",
            optional=True, valid=lambda text: bool(text.strip()), unset="needed with several machines", metavar="HOST",
        ),
        Setting(
            "main_process_port", int, "a port number from 1 to 65535", "The port on machine 0",
            optional=True, valid=lambda n: 1 <= n <= 65535, metavar="PORT",
            unset=f"a free port; {DEFAULT_MULTI_MACHINE_PORT} with several machines",
        ),
        Setting(
            "mixed_precision", str, f"one of {', '.join(MIXED_PRECISION_CHOICES)}", "Mixed precision",
            valid=lambda text: text in MIXED_PRECISION_CHOICES, metavar="{" + ",".join(MIXED_PRECISION_CHOICES) + "}",
        ),
        Setting(
            "gpu_ids", str, "GPU numbers separated by commas (0,1) or all", "Which GPUs, by number (0,1) or all",
            optional=True, valid=_gpu_ids_valid, unset="all", metavar="IDS",
        ),
        Setting("use_cpu", bool, "true or false", "Run on the CPU only, even with GPUs"),
        Setting(
            "max_restarts", int, "a whole number from 0", "Restarts of every process after a failure",
            valid=lambda n: n >= 0,
        ),
    )
}  # fmt: skip

_TRUE, _FALSE = ("1", "true", "yes", "y", "on"), ("0", "false", "no", "n", "off")


def parse_setting(key: str, value: Any, *, where: str, text: bool) -> Any:
    """``value`` for setting ``key``, checked (``text``: typed on a command line or at a prompt).

    Raises:
        LaunchError: ``where`` (the flag, or the key and its file) must be ...
    """
    setting = SETTINGS[key]
    typed = _from_text(setting, value) if text and isinstance(value, str) else _from_yaml(setting, value)
    if typed is None and setting.optional:
        return None
    if type(typed) is not setting.kind or not setting.valid(typed):  # type(): True is not a whole number
        shown = value if text and isinstance(value, str) and value.strip() else _shown(value)
        raise LaunchError(f"{where} must be {setting.expects}, not {shown}")
    return typed.strip().replace(" ", "") if setting.key == "gpu_ids" else typed


def _from_text(setting: Setting, value: str) -> Any:
    value = value.strip()
    if setting.optional and value.lower() in ("", "none", "null"):
        return None
    if setting.kind is int:
        try:
            return int(value)
        except ValueError:
            return value
    if setting.kind is bool:
        return True if value.lower() in _TRUE else False if value.lower() in _FALSE else value
    return value


def _from_yaml(setting: Setting, value: Any) -> Any:
    # YAML 1.1 reads a bare `no` as false and `0` as a number; Accelerate's files say `mixed_precision: 'no'`,
    # but a hand-written file may not.
    if setting.key == "mixed_precision" and value is False:
        return "no"
    if setting.key == "gpu_ids" and type(value) is int:
        return str(value)
    return value


def _shown(value: Any) -> str:
    return "an empty value" if value == "" else repr(value)


def resolve(
    flags: Mapping[str, Any], *, file_values: Mapping[str, Any] | None = None, config_file: Path | None = None
) -> LaunchSettings:
    """The settings of a launch: the defaults, then the config file's values, then the flags given.

    ``flags`` and ``file_values`` hold checked values (:func:`parse_setting`), by key.

    Raises:
        LaunchError: A combination that cannot work, naming where each value came from.
    """
    where = {key: f"{key} in {config_file}" for key in file_values or {}}
    where.update({key: SETTINGS[key].flag for key in flags})
    settings = replace(LaunchSettings(), **{**(file_values or {}), **flags})
    check_combination(settings, lambda key: where.get(key, SETTINGS[key].flag))
    return settings


def check_combination(settings: LaunchSettings, where: Callable[[str], str]) -> None:
    """Raise LaunchError for settings that are each valid but do not fit together."""
    machines = settings.num_machines
    if settings.machine_rank >= machines:
        raise LaunchError(
            f"{where('machine_rank')} is {settings.machine_rank}, but there are {machines} machine(s) "
            f"({where('num_machines')}), numbered from 0; give each machine its own rank below {machines}"
        )
    if machines > 1 and settings.main_process_ip is None:
        raise LaunchError(
            f"{machines} machines ({where('num_machines')}) need the address of machine 0: pass "
            "--main_process_ip (the same on every machine)"
        )
    if settings.num_processes is not None and settings.num_processes % machines:
        raise LaunchError(
            f"{where('num_processes')} is {settings.num_processes}, the processes over all {machines} machines, "
            f"and must be a multiple of {where('num_machines')}"
        )
    gpus = gpu_count(settings)
    if gpus is not None and not settings.use_cpu and settings.num_processes is not None:
        if settings.num_processes // machines > gpus:
            raise LaunchError(
                f"{where('num_processes')} asks for {settings.num_processes // machines} process(es) per machine, "
                f"more than the {gpus} GPU(s) of {where('gpu_ids')}; name more GPUs or start fewer processes"
            )


def gpu_count(settings: LaunchSettings) -> int | None:
    """How many GPUs ``gpu_ids`` names; None when it names all of them (or is not set)."""
    if settings.gpu_ids in (None, "all"):
        return None
    return len(settings.gpu_ids.split(","))


def config_file_path(named: str | None = None) -> Path:
    """The launch config file: ``named`` (``--config_file``), else ``$RUNNER_CONFIG_FILE``, else
    ``${XDG_CONFIG_HOME:-~/.config}/runner/launch.yaml``."""
    if named:
        return Path(named).expanduser()
    if os.environ.get(CONFIG_FILE_ENV):
        return Path(os.environ[CONFIG_FILE_ENV]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base).expanduser() / "runner" / "launch.yaml"


def read_config_file(path: Path) -> dict[str, Any]:
    """The checked values the file sets, by key.

    Raises:
        LaunchError: The file cannot be read, is not a YAML mapping, or has an unknown key or a bad value.
    """
    import yaml

    fix = "fix it, or write it again with `runner config`"
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise LaunchError(f"cannot read the config file {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise LaunchError(f"the config file {path} is not UTF-8 text; {fix}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark is not None else ""
        raise LaunchError(f"the config file {path} is not valid YAML{line}; {fix}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise LaunchError(f"the config file {path} must be a mapping of settings (key: value), not {_shown(loaded)}")
    unknown = [str(key) for key in loaded if key not in SETTINGS]
    if unknown:
        are, them = ("is not a setting", "it") if len(unknown) == 1 else ("are not settings", "them")
        raise LaunchError(
            f"{', '.join(unknown)} in {path} {are} of runner launch; remove {them} (settings: {', '.join(SETTINGS)})"
        )
    values = {}
    for key, value in loaded.items():
        try:
            values[key] = parse_setting(key, value, where=f"{key} in {path}", text=False)
        except LaunchError as error:
            raise LaunchError(f"{error}; {fix}") from None
    return values


def render_config_file(settings: LaunchSettings) -> str:
    """The YAML ``runner config`` writes: every setting, in the order of :data:`SETTINGS`."""
    import yaml

    values = {key: getattr(settings, key) for key in SETTINGS}
    header = "# Read by `runner launch` (its flags win over these); written by `runner config`.\n"
    return header + yaml.safe_dump(values, sort_keys=False, default_flow_style=False)


def check_config_target(path: Path) -> None:
    """Raise LaunchError unless ``path`` can be a file: it is not a folder, and no folder above it is a file."""
    if path.is_dir():
        raise LaunchError(f"the config file {path} is a folder; name a file, such as {path / 'launch.yaml'}")
    blocking = next((folder for folder in path.parents if folder.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise LaunchError(f"cannot write the config file {path}: {blocking} is a file, not a folder; name another path")


def write_config_file(path: Path, settings: LaunchSettings) -> None:
    """Write :func:`render_config_file` to ``path``, creating its folders.

    Raises:
        LaunchError: ``path`` is a folder, a folder above it is a file, or it cannot be written.
    """
    from runner.files import write_text_atomically

    check_config_target(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, render_config_file(settings))
    except OSError as error:
        raise LaunchError(f"cannot write the config file {path}: {error.strerror or error}") from None
