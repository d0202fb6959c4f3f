"""``resume=``: find the checkpoint a path means, decide once what the command resumes, rebuild that run's config.

The command line decides (:func:`from_command_line`: the checkpoint, verified; whose folder it is;
the run's own overrides, replayed first) and hands the :class:`Resume` down to the Hydra app, which
rebuilds the run's config from it (:func:`resumed_run`). A sweep job that finds an earlier attempt
of itself decides the same way, from its own folder (:func:`from_config`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from runner.config import CONFIG_GROUPS, TRUST_KEY, ConfigError
from runner.config import overrides as parsed
from runner.folders.layout import CONFIG_FILE, saved_overrides

if TYPE_CHECKING:
    from runner.engine.checkpoint import VerifiedCheckpoint

logger = logging.getLogger("runner")


@dataclass(frozen=True)
class Resume:
    """What a command resumes: the path as typed, the run folder and checkpoint it names, the overrides replayed."""

    path: str
    run_dir: Path
    checkpoint: Path
    replayed: tuple[str, ...]  # the run's own saved overrides, composed before the command's
    verified: VerifiedCheckpoint | None = None  # the checkpoint's files, hashed here: the workers take them as they are


def from_command_line(path: str, overrides: list[str], *, search_path: list[str]) -> Resume:
    """The resume ``resume=path`` asks for, checked before anything of the folder's config is composed.

    The checkpoint's files are verified against its manifest; a folder you did not write is refused
    unless the command trusts it (:func:`runner.folders.provenance.check_resumable`).

    Raises:
        ConfigError: No such checkpoint, a damaged one, an untrusted folder, or an override switching a group.
    """
    from runner.folders.provenance import check_resumable

    evaluates = str(parsed.value(overrides, "evaluate_only")).lower() == "true"  # runner eval's command line
    verb = "eval" if evaluates else "resume"
    run_dir, verified = find_verified_checkpoint(path, named=f"runner eval {path}" if evaluates else None)
    checkpoint = verified.folder
    # Before anything of the folder's config is composed, validated or imported: it may name code.
    check_resumable(checkpoint, path=path, overrides=overrides, search_path=search_path, command=verb)
    switched = [line for line, override in zip(overrides, parsed.parse(overrides), strict=True)
                if override.key_or_group in CONFIG_GROUPS]  # fmt: skip
    if switched:
        example = "trainer.max_steps=2000"
        if switched[0].lstrip("+~") == "parallel=ddp":  # continuing on several processes: DDP's options have defaults
            example = "parallel.strategy=ddp"
        raise ConfigError(
            f"resume= keeps the resumed run's config groups, but {switched[0]} switches one; change values "
            f"(e.g. {example}) or start a new run."
        )
    return Resume(path, run_dir, checkpoint, tuple(replayed_overrides(checkpoint)), verified)


def from_config(path: str, overrides: list[str], *, search_path: list[str]) -> Resume:
    """The resume of a config the command line did not decide: a sweep job's earlier attempt, in its own
    folder, or a config composed without the command line. Its files are verified here, once.

    Raises:
        ConfigError: No such checkpoint, or a folder you did not write that the overrides do not trust.
    """
    from runner.folders.provenance import check_resumable

    run_dir, verified = find_verified_checkpoint(path)  # past damaged ones, and not hashed again by the workers
    check_resumable(verified.folder, path=path, overrides=overrides, search_path=search_path)
    return Resume(path, run_dir, verified.folder, tuple(replayed_overrides(verified.folder)), verified)


def resumed_run(
    resume: Resume, task_overrides: list[str], composed: DictConfig | None = None
) -> tuple[DictConfig, list[str]]:
    """The resumed run's config with this command's new overrides, and the overrides it now stands for.

    ``task_overrides`` are those Hydra composed: the replayed ones first, then the command's own.
    ``composed``: the config Hydra composed from them, whose ``${...}`` say which saved values follow an
    overridden one (see :func:`resumed_config`).
    """
    given = parsed.without(task_overrides, "resume")
    replayed = list(resume.replayed)
    new = given[len(replayed) :] if given[: len(replayed)] == replayed else given
    cfg = resumed_config(resume.checkpoint, new, composed=composed)
    cfg.project.project_dir = str(resume.run_dir)
    cfg.resume = str(resume.checkpoint)
    if (change := schedule_change(resume.checkpoint, cfg)) is not None:
        logger.warning("%s.", change)
    if (branch := branches(resume.checkpoint)) is not None:
        logger.warning("%s.", branch)
    logger.info("Resuming %s from %s with new overrides %s", resume.run_dir, resume.checkpoint.name, new)
    return cfg, parsed.last_per_key(replayed + new)


def with_started_config_dirs(error: ConfigError, command) -> ConfigError:
    """``error``, a refused option of the resumed run's, with the config folders the run was started with and this
    command lacks (``--config-dir``, ``hydra.searchpath``): its own groups' options live there."""
    from runner.config.search_path import search_path_entries

    if " is not an option" not in str(error):
        return error
    entries = search_path_entries(list(command.overrides), config_dir=command.config_dir)
    given = {entry.removeprefix("file://") for entry in entries}
    missing = [folder for folder in started_config_dirs(command.resume.run_dir) if folder not in given]
    if not missing:
        return error
    flags = " ".join(f"--config-dir {folder}" for folder in missing)
    return ConfigError(f"{str(error).rstrip('.')}; the run was started with {flags}, so give it to this command too.")


def started_config_dirs(run_dir: Path) -> list[str]:
    """The config folders the run's first command added to conf/ (``--config-dir``, ``hydra.searchpath``), as its
    ``.hydra/hydra.yaml`` records them (read as plain YAML: nothing in it is resolved or called)."""
    import yaml

    record = run_dir / ".hydra" / "hydra.yaml"
    try:
        sources = yaml.safe_load(record.read_text())["hydra"]["runtime"]["config_sources"]
        own = [source for source in sources if source.get("provider") not in ("main", "hydra", "schema")]
        return [str(source["path"]) for source in own if source.get("schema") == "file"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return []  # no record (a run folder copied without it): nothing to add


def find_checkpoint(path: str, *, verify_checksums: bool = True, named: str | None = None) -> tuple[Path, Path]:
    """The run folder and checkpoint folder that ``resume=path`` names.

    ``path`` is a ``checkpoints/checkpoint_N`` folder, or a run folder (its newest intact checkpoint,
    skipping damaged ones with a warning). With ``verify_checksums`` the files are hashed here; without, only
    their sizes are checked. ``named``: how the refusals name the path as the user typed it (``resume=PATH``
    unless given).

    Raises:
        ConfigError: The path is missing, not a checkpoint or run folder, or has no intact checkpoint.
    """
    run_dir, checkpoint, _ = _find(path, verify_checksums=verify_checksums, named=named)
    return run_dir, checkpoint


def find_verified_checkpoint(path: str, *, named: str | None = None) -> tuple[Path, VerifiedCheckpoint]:
    """:func:`find_checkpoint`, its files hashed: the run folder, and the checkpoint as verified, which the workers
    load without hashing it again (``Accelerator.mark_verified``)."""
    run_dir, _, verified = _find(path, verify_checksums=True, named=named)
    assert verified is not None  # hashed, or refused
    return run_dir, verified


def _find(path: str, *, verify_checksums: bool, named: str | None) -> tuple[Path, Path, VerifiedCheckpoint | None]:
    from runner.engine.checkpoint import checkpoint_number, newest_intact_checkpoint
    from runner.engine.constants import CHECKPOINTS_DIR

    named = named or f"resume={path}"
    folder = Path(path).expanduser().resolve()
    if folder.is_file():
        raise ConfigError(
            f"{named} is a file, not a folder; pass a run folder or one of its checkpoints/checkpoint_N folders."
        )
    if not folder.is_dir():
        raise ConfigError(f"{named} does not exist; pass a run folder or one of its checkpoints/checkpoint_N folders.")
    if checkpoint_number(folder) is not None:
        verified = _check_intact(folder, named, verify_checksums=verify_checksums)
        return folder.parent.parent, folder, verified
    if not (folder / CHECKPOINTS_DIR).is_dir() and any(folder.glob("*.safetensors")):
        run = f" ({folder.parent})" if (folder.parent / CHECKPOINTS_DIR).is_dir() else ""  # a run's model/ folder
        raise ConfigError(
            f"{named} holds a model's weights ({next(folder.glob('*.safetensors')).name}) but no checkpoints, so it "
            f"is an exported model, not a run; pass the run it came from{run}, or one of its "
            f"{CHECKPOINTS_DIR}/checkpoint_N folders."
        )
    if not (folder / CHECKPOINTS_DIR).is_dir():
        raise ConfigError(
            f"{named} is neither a checkpoint folder (checkpoint_N) nor a run folder (it has no "
            f"{CHECKPOINTS_DIR}/ folder); pass one of those."
        )
    from runner.folders.provenance import check_unchanged

    # A checkpoint of yours changed since it was saved is damaged: passed over like one whose files do not match.
    newest, skipped = newest_intact_checkpoint(
        folder / CHECKPOINTS_DIR, verify_checksums=verify_checksums, check=check_unchanged
    )
    for checkpoint, error in skipped:
        logger.warning("Skipping %s: %s", checkpoint.name, error)
    if newest is not None:  # newest_intact_checkpoint checked it (and hashed it, with verify_checksums)
        verified = _check_intact(newest, named, verify_checksums=False, verified=verify_checksums)
        return folder, newest, verified
    raise ConfigError(f"{named} has no complete checkpoint in {folder / CHECKPOINTS_DIR}; start a new run instead.")


def _check_intact(
    checkpoint: Path, named: str, *, verify_checksums: bool, verified: bool = False
) -> VerifiedCheckpoint | None:
    """Refuse a damaged checkpoint, or one not written by the runner. Returns it as verified where its files were
    hashed (here with ``verify_checksums``, or already: ``verified``), else None."""
    from runner.engine.checkpoint import VerifiedCheckpoint, read_manifest
    from runner.engine.checkpoint.errors import CheckpointError

    try:
        manifest = read_manifest(checkpoint, verify_checksums=verify_checksums)
    except CheckpointError as error:
        raise ConfigError(f"{named}: {error}") from None
    if not (checkpoint / CONFIG_FILE).is_file():
        raise ConfigError(
            f"{named}: {checkpoint} has no {CONFIG_FILE}, so it was not written by `python -m runner`; "
            "load it from your own script with accelerator.load_state()."
        )
    return VerifiedCheckpoint.of(checkpoint, manifest) if verify_checksums or verified else None


def replayed_overrides(checkpoint: Path) -> list[str]:
    """The saved overrides a resume replays: all but ``resume=``, ``trust_resume=`` and Hydra's own (``hydra.*``,
    ``hydra/...``), which belong to the command that typed them."""

    saved = saved_overrides(checkpoint)
    return [o for o in parsed.without(saved, "resume", TRUST_KEY) if not parsed.is_hydra(o)]


def resumed_config(checkpoint: Path, new_overrides: list[str], *, composed: DictConfig | None = None) -> DictConfig:
    """The checkpointed run's own config with ``new_overrides`` (``key=value``) applied on top.

    The overrides are parsed with Hydra's grammar, exactly as on a fresh command line. The saved config is
    resolved, so a value that the run's config took from another key (``data.eval.split: ${data.eval_split}``)
    would not follow an override of that key; where ``composed`` (this command's composition) links a value to an
    overridden key, the link is put back, and the value follows.
    """
    from runner.config import RunnerConfig, upgrade_tracker_node

    saved = OmegaConf.load(checkpoint / CONFIG_FILE)
    upgrade_tracker_node(saved)
    cfg = OmegaConf.merge(OmegaConf.structured(RunnerConfig), saved)
    _fill_strategy_defaults(cfg)
    OmegaConf.set_struct(cfg, True)
    for override in parsed.parse(new_overrides):
        key = override.key_or_group
        try:
            OmegaConf.update(cfg, key, override.value(), merge=True)
        except Exception as error:  # omegaconf raises several types; the first line names the key
            reason = str(error).splitlines()[0]
            raise ConfigError(f"Cannot apply {key}={override.value()!r} to the resumed run: {reason}.") from None
    if composed is not None:
        _relink(cfg, composed, {override.key_or_group for override in parsed.parse(new_overrides)})
    return cfg


def _fill_strategy_defaults(cfg: DictConfig) -> None:
    """The keys of the run's parallel strategy that its saved config lacks (saved before they existed: FSDP's mesh
    keys), at their schema's defaults, so the run is settled here, whole, and its workers take it as it is."""
    from runner.config import OPTION_SCHEMAS

    schema = OPTION_SCHEMAS["parallel"].get(str(OmegaConf.select(cfg, "parallel.strategy")))
    if schema is None:
        return
    defaults = OmegaConf.to_container(OmegaConf.structured(schema))
    for key, value in defaults.items():
        if key not in cfg.parallel:
            OmegaConf.update(cfg, f"parallel.{key}", value, force_add=True)


_REFERENCE = re.compile(r"\$\{\s*([\w.\-]+)\s*\}")  # ${a.b}; a resolver's ${name:...} is not a key


def _relink(cfg: DictConfig, composed: DictConfig, overridden: set[str]) -> None:
    """Set back, in the resumed ``cfg``, every ``${...}`` of ``composed`` that refers to an ``overridden`` key."""

    def walk(node: Any, path: str) -> Iterator[tuple[str, str]]:
        if isinstance(node, dict):
            for key, value in node.items():
                yield from walk(value, f"{path}.{key}" if path else str(key))
        elif isinstance(node, list):
            for index, value in enumerate(node):
                yield from walk(value, f"{path}[{index}]")
        elif isinstance(node, str) and "${" in node:
            yield path, node

    raw = OmegaConf.to_container(composed, resolve=False)
    for path, text in walk(raw, ""):
        refers = _REFERENCE.findall(text)
        follows = any(ref == key or ref.startswith(f"{key}.") for ref in refers for key in overridden)
        if follows and path not in overridden and OmegaConf.select(cfg, path, default=_ABSENT) is not _ABSENT:
            OmegaConf.update(cfg, path, text, merge=False)


_ABSENT = object()


def check_extent(checkpoint: Path, cfg: DictConfig, *, path: str) -> None:
    """Refuse to resume a checkpoint that is already past the config's ``trainer.max_steps``.

    Raises:
        ConfigError: One sentence with the checkpoint's step and the fix.
    """
    from runner.engine.checkpoint import read_manifest
    from runner.engine.checkpoint.errors import CheckpointError

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
    if not cfg.get("evaluate_only") and final_step(checkpoint.parent.parent) == step and _same_length(checkpoint, cfg):
        raise ConfigError(
            f"resume={path}: the run is already done: {checkpoint.name} is its final checkpoint (step {step}) and its "
            "metrics.json is written; give a larger trainer.max_steps (or trainer.max_epochs) to train further, or "
            f"evaluate it with runner eval {path}."
        )


def _same_length(checkpoint: Path, cfg: DictConfig) -> bool:
    """Whether ``cfg`` trains as long as the run that saved ``checkpoint`` (its trainer.max_steps and max_epochs)."""
    saved = OmegaConf.load(checkpoint / CONFIG_FILE)
    return all(OmegaConf.select(saved, f"trainer.{key}") == cfg.trainer.get(key) for key in ("max_steps", "max_epochs"))


def final_step(run_dir: Path) -> int | None:
    """The step of the run's metrics.json, written once its training ended; None before that."""
    from runner.folders.layout import final_metrics

    step = final_metrics(run_dir).get("step")
    return step if isinstance(step, int) else None


def branches(checkpoint: Path) -> str | None:
    """A line saying that resuming ``checkpoint`` leaves a newer checkpoint of its run behind, and what becomes of
    the history after it; None when it is the run's newest intact checkpoint."""
    from runner.engine.checkpoint import checkpoints_dir, newest_intact_checkpoint, read_manifest

    newest, _ = newest_intact_checkpoint(checkpoints_dir(checkpoint.parent.parent), verify_checksums=False)
    if newest is None or newest == checkpoint:
        return None
    step = read_manifest(checkpoint, verify_checksums=False).get("step")
    later = read_manifest(newest, verify_checksums=False).get("step")
    if not isinstance(step, int) or not isinstance(later, int) or later <= step:
        return None
    return (
        f"Resuming {checkpoint.name} (step {step}), older than this run's {newest.name} (step {later}): the run goes "
        f"on from step {step} as a new branch; TensorBoard hides what was logged after step {step}, and the newer "
        "checkpoints stay in checkpoints/, numbered before those this resume saves"
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
