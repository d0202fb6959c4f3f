"""Find the checkpoint a ``resume=`` path means, and rebuild that run's config."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from runner.config import TRUST_KEY, ConfigError
from runner.engine.constants import CHECKPOINTS_DIR
from runner.layout import CONFIG_FILE, OVERRIDES_FILE

logger = logging.getLogger("runner")


def find_checkpoint(path: str, *, verify_checksums: bool = True) -> tuple[Path, Path]:
    """The run folder and checkpoint folder that ``resume=path`` names.

    ``path`` is a ``checkpoints/checkpoint_N`` folder, or a run folder (its newest intact checkpoint,
    skipping damaged ones with a warning).

    Raises:
        ConfigError: The path is missing, not a checkpoint or run folder, or has no intact checkpoint.
    """
    from runner.engine.checkpoint import checkpoint_number, newest_intact_checkpoint

    folder = Path(path).expanduser().resolve()
    if folder.is_file():
        raise ConfigError(
            f"resume={path} is a file, not a folder; pass a run folder or one of its checkpoints/checkpoint_N folders."
        )
    if not folder.is_dir():
        raise ConfigError(
            f"resume={path} does not exist; pass a run folder or one of its checkpoints/checkpoint_N folders."
        )
    if checkpoint_number(folder) is not None:
        _check_intact(folder, path, verify_checksums=verify_checksums)
        return folder.parent.parent, folder
    if not (folder / CHECKPOINTS_DIR).is_dir():
        raise ConfigError(
            f"resume={path} is neither a checkpoint folder (checkpoint_N) nor a run folder (it has no "
            f"{CHECKPOINTS_DIR}/ folder); pass one of those."
        )
    newest, skipped = newest_intact_checkpoint(folder / CHECKPOINTS_DIR)
    for checkpoint, error in skipped:
        logger.warning("Skipping %s: %s", checkpoint.name, error)
    if newest is not None:
        _check_intact(newest, path, verify_checksums=False)  # newest_intact_checkpoint checked its files
        return folder, newest
    raise ConfigError(
        f"resume={path} has no complete checkpoint in {folder / CHECKPOINTS_DIR}; start a new run instead."
    )


def _check_intact(checkpoint: Path, path: str, *, verify_checksums: bool) -> None:
    from runner.engine.checkpoint import CheckpointError, read_manifest

    try:
        read_manifest(checkpoint, verify_checksums=verify_checksums)
    except CheckpointError as error:
        raise ConfigError(f"resume={path}: {error}") from None
    if not (checkpoint / CONFIG_FILE).is_file():
        raise ConfigError(
            f"resume={path}: {checkpoint} has no {CONFIG_FILE}, so it was not written by `python -m runner`; "
            "load it from your own script with accelerator.load_state()."
        )


def saved_overrides(checkpoint: Path) -> list[str]:
    """The command-line overrides the checkpointed run was composed with, as written (nothing resolved).

    Raises:
        ConfigError: The file is not a YAML list of strings.
    """
    path = checkpoint / OVERRIDES_FILE
    if not path.is_file():
        return []
    try:
        saved = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception:  # not YAML (OmegaConf and yaml raise several types)
        saved = None
    if not isinstance(saved, list) or not all(isinstance(override, str) for override in saved):
        raise ConfigError(f"{path} is not a list of overrides; the checkpoint is damaged, so resume another one.")
    return saved


def replayed_overrides(checkpoint: Path) -> list[str]:
    """The saved overrides a resume replays: all but ``resume=``, ``trust_resume=`` and Hydra's own (``hydra.*``,
    ``hydra/...``), which belong to the command that typed them."""

    def key(override: str) -> str:
        return override.split("=", 1)[0].lstrip("+~")

    return [o for o in saved_overrides(checkpoint) if key(o) not in ("resume", TRUST_KEY) and key(o)[:5] != "hydra"]


def resumed_config(checkpoint: Path, new_overrides: list[str]) -> DictConfig:
    """The checkpointed run's own config with ``new_overrides`` (``key=value``) applied on top.

    The overrides are parsed with Hydra's grammar, exactly as on a fresh command line.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from runner.config import RunnerConfig

    cfg = OmegaConf.merge(OmegaConf.structured(RunnerConfig), OmegaConf.load(checkpoint / CONFIG_FILE))
    OmegaConf.set_struct(cfg, True)
    for override in OverridesParser.create().parse_overrides(new_overrides):
        key = override.key_or_group
        try:
            OmegaConf.update(cfg, key, override.value(), merge=True)
        except Exception as error:  # omegaconf raises several types; the first line names the key
            reason = str(error).splitlines()[0]
            raise ConfigError(f"Cannot apply {key}={override.value()!r} to the resumed run: {reason}.") from None
    return cfg


def check_extent(checkpoint: Path, cfg: DictConfig, *, path: str) -> None:
    """Refuse to resume a checkpoint that is already past the config's ``trainer.max_steps``.

    Raises:
        ConfigError: One sentence with the checkpoint's step and the fix.
    """
    from runner.engine.checkpoint import CheckpointError, read_manifest

    try:
        step = read_manifest(checkpoint, verify_checksums=False).get("step")
    except CheckpointError as error:
        raise ConfigError(f"resume={path}: {error}") from None
    max_steps = cfg.trainer.max_steps
    if isinstance(step, int) and max_steps is not None and step > max_steps:
        raise ConfigError(
            f"resume={path}: {checkpoint.name} is at step {step}, already past trainer.max_steps={max_steps}; "
            "give a larger trainer.max_steps to train further (or resume an earlier checkpoint)."
        )


def schedule_change(checkpoint: Path, cfg: DictConfig) -> str | None:
    """A line saying the learning-rate schedule is rebuilt, when the resumed run's length changed."""
    saved = OmegaConf.select(OmegaConf.load(checkpoint / CONFIG_FILE), "trainer.max_steps")
    now = cfg.trainer.max_steps
    if cfg.scheduler is None or saved == now:
        return None
    return (
        f"trainer.max_steps is {now} now and was {saved} when the run started: the learning-rate schedule is "
        f"rebuilt for {now} steps, so the rates from here on follow the new length"
    )
