"""``runner check-resume [overrides]``: does this experiment resume exactly? Train, cut, resume, compare, bit for bit.

    runner check-resume experiment=mnist_ddp
    runner check-resume --config-dir ./conf experiment=mine --steps 12 --cut 5
    runner check-resume experiment=mnist_fsdp --resume-processes 1

Three runs of the experiment the overrides describe (as ``runner`` would run it), in a temporary folder: one
straight through ``--steps`` optimizer steps; one stopped at step ``--cut`` as a preemption stops a run (its
checkpoint saved, exit 75); and that one resumed to ``--steps`` (on as many processes, or ``--resume-processes``).
Then the straight run and the resumed one are compared bit for bit: the weights, the optimizer, the scheduler, the
loss scaler, every process's RNG states, every registered object, each loader's data position, every logged value
at every step, and the final metrics; and, batch by batch, the training data each read.

It prints ``resume is exact`` and exits 0, or the first thing that differs (which tensor or key, or the step where a
logged value first differs and by how much), why, where it can tell, and the other differences, and exits 1. The
reasons it tells: the two uninterrupted stretches differ already (a dataset without a stable order, unseeded
randomness, non-deterministic ops on this device), the resumed run reads other batches (the data position, or a
dataset's own random generator, which no checkpoint saves), an object keeps a random generator of its own, an
evaluation metric keeps state between evaluations, or another process count. The runs are removed when the resume is
exact and kept when it is not (``--keep`` keeps them always; ``--dir FOLDER`` puts them in a new folder of that
name instead, and keeps them), for ``runner diff``.

The runs log every step, to TensorBoard only (no tracker server is contacted), and digest every batch they read
(``RUNNER_DATA_DIGEST_BATCHES=all``); the cut is ``RUNNER_STOP_AT_STEP``. A bad override is the run's own sentence
and exit 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

USAGE = (
    "usage: runner check-resume [--steps N] [--cut K] [--resume-processes M] [--keep | --dir FOLDER] [overrides ...]"
)
DEFAULT_STEPS = 8
# What check-resume itself sets: the user may not.
_OWN_KEYS = ("resume", "hydra.run.dir", "hydra.sweep.dir", "trainer.max_steps", "evaluate_only")


class Refused(Exception):
    """One sentence for the user; exit 2."""


@dataclass
class Leg:
    """One of the three runs: its name, folder, command and environment, and how it ended."""

    name: str
    folder: Path
    argv: list[str]
    env: dict[str, str]
    log: Path
    returncode: int | None = None
    seconds: float = 0.0

    def run(self) -> int:
        """Run the command as ``runner ARGV`` would, forked from the runner's forkserver (torch, torchmetrics,
        Hydra and the runner imported once, for all three runs), its output into :attr:`log`."""
        import multiprocessing

        from runner.launch import preload
        from runner.training.startup import STARTUP_ENV

        started = time.perf_counter()
        env = {**self.env, STARTUP_ENV: f"command={time.time():.6f}"}  # its start-up record starts here, as a command's
        try:
            preload.start(extra=_LEG_PRELOAD)
            process = multiprocessing.get_context("forkserver").Process(
                target=_leg, args=(self.argv, env, str(self.log)), name=f"check-resume {self.name} run"
            )
            process.start()
        except OSError:  # no forkserver here (its socket's path under TMPDIR too long, say): a fresh interpreter
            fresh = {name: value for name, value in self.env.items() if name != STARTUP_ENV}  # from its own start
            with open(self.log, "w") as log:
                done = subprocess.run([sys.executable, "-m", "runner", *self.argv], env=fresh, stdout=log,
                                      stderr=subprocess.STDOUT, check=False)  # fmt: skip
            self.returncode = done.returncode
        else:
            process.join()
            self.returncode = process.exitcode
        self.seconds = time.perf_counter() - started
        return self.returncode

    def error_line(self) -> str:
        """The run's own last sentence: its ``runner: error:`` line, else the last line it printed."""
        lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("runner: error:")]
        return (errors or lines or ["(it printed nothing)"])[-1]


# What a run imports before its first step beyond the forkserver's own preload: the command line's and Hydra's.
_LEG_PRELOAD = ("hydra", "omegaconf", "runner.cli", "runner.cli.app", "runner.config.check", "tensorboard")


def _leg(argv: list[str], env: dict[str, str], log: str) -> None:
    """In a process forked from the forkserver: become ``runner ARGV`` run in ``env``, writing to ``log``, as a
    fresh interpreter would (the environment of the check, not the server's; this start method's children start
    their own as a plain run does; the thread count of ``OMP_NUM_THREADS``)."""
    import multiprocessing

    descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    os.environ.clear()
    os.environ.update(env)
    multiprocessing.set_start_method(None, force=True)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdecimal() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    sys.argv = ["runner", *argv]
    from runner.cli import main as runner

    runner()


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{USAGE}\n\n{__doc__.split(chr(10) * 2, 2)[2]}")
        return 0
    try:
        options, passed = _parse(argv)
    except Refused as error:
        print(f"runner: error: {error}", file=sys.stderr)
        return 2
    try:
        folder = _folder(options.dir)
    except Refused as error:
        print(f"runner: error: {error}", file=sys.stderr)
        return 2
    try:
        code = check(options, passed, folder)
    except Refused as error:
        print(f"runner: error: {error}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print(f"runner: check-resume interrupted; its runs are in {folder}", file=sys.stderr)
        return 130
    except Exception:
        print(f"runner: check-resume failed while comparing; its runs are in {folder}", file=sys.stderr)
        raise
    if options.dir is None and (code == 0 and not options.keep or code == 2):
        shutil.rmtree(folder, ignore_errors=True)
    return code


def _folder(named: str | None) -> Path:
    """A new temporary folder, or the new folder ``--dir`` names (with its parents)."""
    if named is None:
        return Path(tempfile.mkdtemp(prefix="runner-check-resume-"))
    folder = Path(named).expanduser().absolute()
    if folder.exists() or folder.is_symlink():
        raise Refused(f"--dir {named}: {folder} exists; name a new folder, so that no run is overwritten.")
    try:
        folder.mkdir(parents=True)
    except OSError as error:
        raise Refused(f"--dir {named}: {folder} cannot be made ({error.strerror}); name another folder.") from None
    return folder


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="runner check-resume", add_help=False)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--cut", type=int, default=None)
    parser.add_argument("--resume-processes", type=int, default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--dir", default=None)
    options, passed = _known_args(parser, argv)
    options.cut = options.steps // 2 if options.cut is None else options.cut
    if options.steps < 2:
        raise Refused(f"--steps {options.steps}: the check needs at least 2 steps (a cut and a step after it).")
    if not 1 <= options.cut < options.steps:
        raise Refused(f"--cut {options.cut}: cut between step 1 and step {options.steps - 1} (--steps is "
                      f"{options.steps}).")  # fmt: skip
    if options.resume_processes is not None and options.resume_processes < 1:
        raise Refused(f"--resume-processes {options.resume_processes}: give a process count of 1 or more.")
    from runner.config import ConfigError
    from runner.config import overrides as parsed

    for line in passed:
        if line in ("-m", "--multirun"):
            raise Refused(f"{line}: check-resume checks one run, not a sweep; check one job's overrides instead.")
        if line.startswith("-") or "=" not in line:
            continue
        try:
            key = parsed.key(line)
        except ConfigError as error:
            raise Refused(str(error)) from None
        if key in _OWN_KEYS:
            raise Refused(f"{line}: check-resume sets {key} itself ({_own_key_reason(key)}); leave it out.")
    return options, passed


def _known_args(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """check-resume's own options, and everything else (the run's overrides and Hydra's flags) as given."""
    try:
        return parser.parse_known_args(argv)
    except SystemExit:  # argparse printed its complaint (a count that is not a number, say)
        raise Refused(f"the options are {USAGE.removeprefix('usage: ')}") from None


def _own_key_reason(key: str) -> str:
    return {
        "trainer.max_steps": "from --steps",
        "resume": "it resumes its own interrupted run",
        "evaluate_only": "it trains",
    }.get(key, "its runs go to a temporary folder")


def check(options: argparse.Namespace, passed: list[str], folder: Path) -> int:
    """Run the three legs in ``folder`` and compare; returns the exit code."""
    env = {**os.environ, "RUNNER_DATA_DIGEST_BATCHES": "all", "PYTHONUNBUFFERED": "1"}
    env.pop("RUNNER_STOP_AT_STEP", None)
    common = [f"trainer.max_steps={options.steps}", "trainer.log_every_n_steps=1", "trainer.progress_bar=false",
              "tracker=tensorboard"]  # fmt: skip
    flags = _hydra_flags(passed)
    straight_dir, cut_dir = folder / "straight", folder / "cut"
    straight = Leg("straight", straight_dir, [*passed, *common, f"hydra.run.dir={straight_dir}"], env,
                   folder / "straight.log")  # fmt: skip
    cut = Leg("cut", cut_dir, [*passed, *common, f"hydra.run.dir={cut_dir}"],
              {**env, "RUNNER_STOP_AT_STEP": str(options.cut)}, folder / "cut.log")  # fmt: skip
    processes = [f"trainer.num_processes={options.resume_processes}"] if options.resume_processes else []
    resumed = Leg("resumed", cut_dir, [*flags, f"resume={cut_dir}", *processes], env, folder / "resumed.log")

    from runner.training.preemption import EXIT_CODE

    _say(f"1/3: {options.steps} steps straight")
    if straight.run() != 0:
        return _leg_failed(straight, folder)
    _say(f"1/3: done in {straight.seconds:.1f} s; 2/3: the same run, stopped at step {options.cut} as if preempted")
    if cut.run() != EXIT_CODE:
        if cut.returncode == 0:
            print(f"runner: error: the run was to stop at step {options.cut} but finished without stopping there; "
                  f"its log: {cut.log}", file=sys.stderr)  # fmt: skip
            return 1
        return _leg_failed(cut, folder)
    _say(f"2/3: done in {cut.seconds:.1f} s; 3/3: resumed from its checkpoint to step {options.steps}"
        + (f" on {options.resume_processes} processes" if options.resume_processes else ""))  # fmt: skip
    if resumed.run() != 0:
        return _leg_failed(resumed, folder)
    _say(f"3/3: done in {resumed.seconds:.1f} s; comparing")
    verdict = compare(straight_dir, cut_dir, cut_step=options.cut)
    print(verdict.report())
    if not verdict.exact:
        print(f"The runs are kept in {folder}: compare them with runner diff {straight_dir} {cut_dir}")
    elif options.keep or options.dir is not None:
        print(f"The runs are kept in {folder}.")
    return 0 if verdict.exact else 1


_VALUED_FLAGS = ("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn")


def _hydra_flags(passed: list[str]) -> list[str]:
    """The flags that say where the configs are (``--config-dir conf``, ``-cd=conf``...): the resumed run needs them
    too, to compose the same config; the overrides it takes from its checkpoint."""
    flags = []
    for index, line in enumerate(passed):
        if line in _VALUED_FLAGS:
            flags += passed[index : index + 2]
        elif line.startswith(tuple(f"{flag}=" for flag in _VALUED_FLAGS)):
            flags.append(line)
    return flags


def _say(text: str) -> None:
    """A line of progress, on stderr (stdout carries the verdict)."""
    print(f"runner check-resume: {text}", file=sys.stderr, flush=True)


def _leg_failed(leg: Leg, folder: Path) -> int:
    """A run that failed: its own sentence (a bad override exits 2, as the run does), and where its log is."""
    line = leg.error_line()
    if leg.returncode == 2:
        print(line if line.startswith("runner: error:") else f"runner: error: {line}", file=sys.stderr)
        return 2
    print(f"runner: error: the {leg.name} run failed (exit code {leg.returncode}): {line.removeprefix('runner: ')}; "
          f"its log: {leg.log}", file=sys.stderr)  # fmt: skip
    return 1


# ---------------------------------------------------------------------------------------------- comparing
@dataclass
class Finding:
    """A difference, and when in the run it shows: ``before`` the cut (the two uninterrupted stretches differ), or
    after the resume, at ``step`` (None: in the final state, after the last step)."""

    sentence: str
    before_cut: bool
    step: int | None
    kind: str  # "data", "logged", "state", "metrics"
    what: str = ""


@dataclass
class Verdict:
    findings: list[Finding]
    cause: str | None
    unchecked: tuple[str, ...] = ()  # what could not be compared, and why

    @property
    def exact(self) -> bool:
        return not self.findings

    def report(self) -> str:
        if self.exact and not self.unchecked:
            return ("resume is exact: the resumed run matches the straight one bit for bit (weights, optimizer, "
                    "scheduler, RNG states, registered objects, data position, every batch read, every logged value "
                    "and the final metrics).")  # fmt: skip
        if self.exact:
            return "resume is exact in all that was compared, but " + "; ".join(self.unchecked) + "."
        first, rest = self.findings[0], self.findings[1:]
        lines = [f"resume is not exact: {first.sentence}"]
        if self.cause:
            lines.append(f"why: {self.cause}")
        if rest:
            lines.append("also different:")
            lines += [f"  {finding.sentence}" for finding in rest[:12]]
            if len(rest) > 12:
                lines.append(f"  and {len(rest) - 12} more")
        return "\n".join(lines)


def compare(straight: Path, cut: Path, *, cut_step: int) -> Verdict:
    """What differs between the straight run and the cut-and-resumed one, in the order it happened, and why."""
    from runner.engine.checkpoint import checkpoints_dir, newest_intact_checkpoint
    from runner.folders.launch_record import read_attempts
    from runner.folders.layout import LOGS_DIR, final_metrics
    from runner.folders.state_compare import checkpoint_differences, is_timing, logged_differences
    from runner.sweeps.report import read_scalars

    records = {"straight": read_attempts(straight), "cut": read_attempts(cut)}
    accumulation = _accumulation(records["straight"])
    findings: list[Finding] = []
    findings += _data_findings(records, cut_step=cut_step, accumulation=accumulation)
    for difference in logged_differences(read_scalars(straight / LOGS_DIR), read_scalars(cut / LOGS_DIR)):
        before = difference.step is not None and difference.step <= cut_step
        findings.append(Finding(f"{difference.sentence()} (straight vs resumed)", before, difference.step, "logged",
                                difference.what))  # fmt: skip
    unchecked = []
    if not _batches(records["straight"][0] if records["straight"] else None)[1]:
        unchecked.append("no batch was digested (the recipe does not hand its batches to the training loop's "
                         "micro_step), so the data each run read was not compared")  # fmt: skip
    ends = [newest_intact_checkpoint(checkpoints_dir(run), verify_checksums=False)[0] for run in (straight, cut)]
    if None in ends:
        unchecked.append("a run saved no final checkpoint, so the weights, optimizer, scheduler and RNG states were "
                         "not compared")  # fmt: skip
    else:
        for difference in checkpoint_differences(ends[0], ends[1]):
            findings.append(Finding(f"{difference.sentence()} (final checkpoints)", False, None, "state",
                                    difference.what))  # fmt: skip
    metrics = [{k: v for k, v in final_metrics(run).items() if not is_timing(k)} for run in (straight, cut)]
    for key in sorted(set(metrics[0]) | set(metrics[1])):
        if metrics[0].get(key) != metrics[1].get(key):
            findings.append(Finding(f"metrics.json {key}: {metrics[0].get(key)!r} vs {metrics[1].get(key)!r}", False,
                                    None, "metrics", key))  # fmt: skip
    findings.sort(key=lambda f: (not f.before_cut, f.step is None, f.step or 0, _KIND_ORDER.index(f.kind)))
    cause = _cause(findings, records, cut, cut_step=cut_step) if findings else None
    return Verdict(findings, cause, tuple(unchecked))


_KIND_ORDER = ("data", "logged", "state", "metrics")


def _accumulation(records: list[dict[str, Any]]) -> int:
    launch = records[0].get("launch") if records else None
    value = launch.get("gradient_accumulation_steps") if isinstance(launch, dict) else None
    return value if isinstance(value, int) and value > 0 else 1


def _batches(record: dict[str, Any] | None) -> tuple[int, list[str]]:
    order = record.get("data_order") if isinstance(record, dict) else None
    if not isinstance(order, dict):
        return 0, []
    return int(order.get("first_batch") or 0), list(order.get("batches") or [])


def _data_findings(records: dict[str, list[dict]], *, cut_step: int, accumulation: int) -> list[Finding]:
    """The first batch the cut run (before its cut), and the resumed run (after it), read differently from the
    straight run (rank 0's share of each step)."""
    straight = records["straight"][0] if records["straight"] else None
    _, reference = _batches(straight)
    findings = []
    for attempt in records["cut"][:2]:
        first, read = _batches(attempt)
        for offset, digest in enumerate(read):
            index = first + offset
            if index < len(reference) and digest != reference[index]:
                step = index // accumulation + 1
                before = attempt is records["cut"][0]
                run = "before the cut, the interrupted run" if before else "after the resume, the resumed run"
                findings.append(Finding(f"{run} read other training data at step {step} (batch {index}) than the "
                                        "straight run", before, step, "data"))  # fmt: skip
                break
    return findings


def _cause(findings: list[Finding], records: dict[str, list[dict]], cut: Path, *, cut_step: int) -> str | None:
    """Why the first difference happened, where the records tell."""
    first = findings[0]
    generators = [entry for attempts in records.values() for record in attempts[:1]
                  for entry in record.get("own_generators") or [] if isinstance(entry, dict)]  # fmt: skip
    held = _generator_sentence(generators)
    processes = _process_counts(records)
    if processes is not None:
        return (f"the resume ran on {_processes(processes[1])} and the straight run on {processes[0]}: another process "
                "count shards the data and sums the gradients differently, so only the state at the cut carries "
                "over exactly; check with the same count to test the resume itself.")  # fmt: skip
    if first.before_cut:
        kinds = {finding.kind for finding in findings if finding.before_cut}
        device = _device(records)
        if "data" in kinds:
            return ("two runs of the same config read different training data before any resume, so the dataset's "
                    "order or contents are not stable from one run to the next (files listed in the file system's "
                    "order, a shuffle or augmentation not seeded from `seed`)"
                    + (f"; {held}" if held else "") + ".")  # fmt: skip
        return ("two runs of the same config read the same data but computed different values before any resume: "
                + ("non-deterministic ops on this device (torch.use_deterministic_algorithms(True), and on CUDA "
                   "CUBLAS_WORKSPACE_CONFIG=:4096:8, make them repeatable), or " if device != "cpu" else "")
                + "a random draw not seeded from `seed` (the clock, os.urandom, a generator of its own)"
                + (f"; {held}" if held else "") + ".")  # fmt: skip
    if first.kind == "data":
        data_generators = _generator_sentence([entry for entry in generators if str(entry.get("key", "")).startswith(
            "data")])  # fmt: skip
        return ("the resumed run reads other batches than the uninterrupted one from its first step on: "
                + (f"{data_generators}, so its draws after the resume start over" if data_generators
                   else "the data position or a dataset's own state is not restored (give a stateful dataset "
                        "state_dict() and load_state_dict(), or derive its randomness from the sample index and "
                        "`seed`)")
                + ".")  # fmt: skip
    if held:
        return f"{held}; a resumed run draws from it afresh, so it takes other draws than the uninterrupted run."
    logged = [finding for finding in findings if finding.kind == "logged"]
    state = [finding for finding in findings if finding.kind == "state"]
    if (
        logged
        and all(finding.what.startswith("logged eval/") for finding in logged)
        and not any(finding.what.startswith(("model", "optimizer")) for finding in state)
    ):
        tags = {finding.what.removeprefix("logged eval/") for finding in logged}
        return (f"the weights and the training losses match but an evaluation after the resume does not: "
                f"{_metric_names(cut, tags)} keeps state from one evaluation to the next (reset() must clear all of "
                "it), and a resumed run starts it afresh.")  # fmt: skip
    if state and all(finding.what.startswith("RNG states") for finding in state) and not logged:
        return (
            "the resumed run's random generators end in another state though everything else matches: "
            "something draws a different number of random values after a resume (a draw made only on start)."
        )
    return (
        "the run keeps state the checkpoint does not hold: an object it changes while training that is not "
        "registered for checkpointing (accelerator.register_for_checkpointing, with state_dict() and "
        "load_state_dict())."
    )


def _generator_sentence(entries: list[dict]) -> str:
    seen, parts = set(), []
    for entry in entries:
        shown = (f"{entry.get('key')} ({entry.get('class')}) keeps a {entry.get('type')} of its own at "
                 f".{entry.get('attribute')}")  # fmt: skip
        if shown not in seen:
            seen.add(shown)
            parts.append(shown)
    if not parts:
        return ""
    return "; ".join(parts) + ", which no checkpoint saves"


def _processes(count: int) -> str:
    return f"{count} process" if count == 1 else f"{count} processes"


def _process_counts(records: dict[str, list[dict]]) -> tuple[int, int] | None:
    def world(record: dict | None) -> Any:
        launch = record.get("launch") if isinstance(record, dict) else None
        return launch.get("world_size") if isinstance(launch, dict) else None

    straight = world(records["straight"][0] if records["straight"] else None)
    resumed = world(records["cut"][1] if len(records["cut"]) > 1 else None)
    return (straight, resumed) if straight is not None and resumed is not None and straight != resumed else None


def _device(records: dict[str, list[dict]]) -> str:
    launch = records["straight"][0].get("launch") if records["straight"] else None
    return str(launch.get("device", "cpu")) if isinstance(launch, dict) else "cpu"


def _metric_names(run: Path, logged: set[str]) -> str:
    """The config's metrics logged as ``eval/<name>`` for a name in ``logged`` (else all of them), as ``metrics.<name>
    (<class>)``, from the run's record of its config (read as data)."""
    from runner.folders.foreign_config import plain_config
    from runner.folders.layout import HYDRA_DIR

    config = plain_config(run / HYDRA_DIR / "config.yaml")
    metrics = config.get("metrics") if isinstance(config, dict) else None
    if not isinstance(metrics, dict) or not metrics:
        return "an evaluation metric"
    chosen = {name: node for name, node in metrics.items() if name in logged} or metrics
    named = [f"metrics.{name} ({node.get('_target_')})" if isinstance(node, dict) else f"metrics.{name}"
             for name, node in chosen.items()]  # fmt: skip
    return named[0] if len(named) == 1 else "one of " + ", ".join(named)
