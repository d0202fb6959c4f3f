"""``runner diff``: two runs (a sweep's jobs, a checkpoint) compared section by section, on folders built here."""

import copy
import json
import os
from pathlib import Path

import pytest
import yaml

from runner.cli.diff import main
from runner.engine.checkpoint.manifest import write_manifest
from runner.folders.launch_record import PROVENANCE_DIR

CONFIG = {
    "trainer": {"max_steps": 3},
    "data": {"root": "/data", "train": {"_target_": "runner.data.MNIST", "root": "${data.root}"}},
    "project": {"project_dir": None},
    "optimizer": {"_target_": "torch.optim.AdamW", "lr": 0.001, "betas": [0.9, 0.999]},
    "seed": 42,
}
RECORD = {
    "format": 1,
    "attempt": 1,
    "started_at": "2026-01-01T10:00:00+00:00",
    "overrides": [],
    "code": {
        "runner": {"version": "0.1.0", "root": "/src/runner", "commit": "a" * 40, "dirty": False, "diff_sha256": None},
        "repositories": {},
    },
    "packages": {"numpy": "2.1.0", "torch": "2.13.0"},
    "platform": {"python": "3.11.7", "torch": "2.13.0", "cuda": None, "devices": [], "cpu_threads": 8},
    "launch": {"world_size": 1, "device": "cpu", "mixed_precision": "no", "hosts": ["node1"]},
    "environment": {"PYTHONHASHSEED": "0"},
    "data_order": {"first_batch": 0, "digest": "d" * 64, "batches": ["b0", "b1", "b2", "b3"]},
}
SCALARS = {"train/loss": [(1, 2.0), (2, 1.5), (3, 1.25)], "train/samples_per_second": [(1, 100.0)]}
METRICS = {"step": 3, "train/loss": 1.25, "eval/accuracy": 0.5, "wall_time_s": 9.0, "time_to_first_step_s": 2.0}
FOLDERS = "pass a run folder, a sweep job's folder or a checkpoint folder"


def write_scalars(logs: Path, scalars: dict[str, list[tuple[int, float]]]) -> None:
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(logs))
    for tag, points in scalars.items():
        for step, value in points:
            summary = Summary(value=[Summary.Value(tag=tag, simple_value=value)])
            writer.add_event(Event(step=step, wall_time=0.0, summary=summary))
    writer.close()


def make_run(folder: Path, *, config=None, overrides=(), record=RECORD, scalars=SCALARS, metrics=METRICS) -> Path:
    """A run folder as a run leaves it: .hydra/, its launch record, TensorBoard scalars and metrics.json."""
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config or CONFIG, sort_keys=False))
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
    (folder / "run.log").write_text("")
    if record is not None:
        (folder / PROVENANCE_DIR).mkdir()
        (folder / PROVENANCE_DIR / "attempt_1.json").write_text(json.dumps({**record, "overrides": list(overrides)}))
    if scalars:
        write_scalars(folder / "logs", scalars)
    if metrics is not None:
        (folder / "metrics.json").write_text(json.dumps(metrics))
    return folder


def make_checkpoint(run: Path, *, step: int, config: dict, overrides=()) -> Path:
    """``run/checkpoints/checkpoint_0`` saved at ``step``, with the resolved config a checkpoint carries."""
    folder = run / "checkpoints" / "checkpoint_0"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (folder / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
    (folder / "random_states_0.pt").write_bytes(b"state")
    contents = {"models": 0, "optimizers": 0, "schedulers": 0, "custom_objects": 0, "dataloaders": 0,
                "scaler": False, "gradients": False}  # fmt: skip
    write_manifest(folder, world_size=1, iteration=0, state_format="safetensors", contents=contents,
                   metadata={"step": step})  # fmt: skip
    return folder


def changed(base: dict, **values) -> dict:
    """A deep copy of ``base`` with dotted keys set (``optimizer__lr=0.01`` sets optimizer.lr)."""
    found = copy.deepcopy(base)
    for dotted, value in values.items():
        *parents, name = dotted.split("__")
        node = found
        for parent in parents:
            node = node[parent]
        node[name] = value
    return found


def diff(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(arg) for arg in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_two_runs_one_override_name_the_key_with_its_override_and_the_first_diverging_step(tmp_path, capsys):
    a = make_run(tmp_path / "a")
    b = make_run(
        tmp_path / "b",
        config=changed(CONFIG, optimizer__lr=0.01),
        overrides=["optimizer.lr=0.01"],
        scalars={"train/loss": [(1, 2.0), (2, 1.75), (3, 1.5)], "eval/loss": [(3, 1.0)]},
        metrics={**METRICS, "train/loss": 1.5, "wall_time_s": 8.0},
    )
    code, out, err = diff(capsys, a, b)
    assert (code, err) == (1, "")
    assert out == (
        f"a: {a} (run; 1 launch)\n"
        f"b: {b} (run; 1 launch)\n"
        "config: 1 key differs\n"
        "  key           a                b\n"
        "  optimizer.lr  0.001 (default)  0.01 (optimizer.lr=0.01)\n"
        "code: same\n"
        "packages: same\n"
        "hardware and launch: same\n"
        "environment: same\n"
        "data order: same (4 batches from batch 0, digest dddddddddddd)\n"
        "metrics: first differ at step 2 (train/loss)\n"
        "  not compared: train/samples_per_second (speed and time, which differ between any two runs)\n"
        "  tag         step  a    b     b - a  relative\n"
        "  train/loss  2     1.5  1.75  +0.25  +16.7%\n"
        "  only b logged: eval/loss\n"
        "  final values (metrics.json):\n"
        "    metric      a     b\n"
        "    train/loss  1.25  1.5\n"
    )


def test_added_and_removed_keys_name_the_group_override_or_the_added_key(tmp_path, capsys):
    a = make_run(tmp_path / "a")
    optimizer = {"_target_": "torch.optim.SGD", "lr": 0.001}  # optimizer=sgd: no betas
    config = changed(CONFIG, optimizer=optimizer, trainer__compile_mode="max-autotune")
    b = make_run(tmp_path / "b", config=config, overrides=["optimizer=sgd", "+trainer.compile_mode=max-autotune"])
    code, out, _ = diff(capsys, a, b)
    assert code == 1
    assert (
        "config: 3 keys differ\n"
        "  key                   a                            b\n"
        "  optimizer._target_    torch.optim.AdamW (default)  torch.optim.SGD (optimizer=sgd)\n"
        "  optimizer.betas       [0.9, 0.999] (default)       (absent) (optimizer=sgd)\n"
        "  trainer.compile_mode  (absent)                     max-autotune (+trainer.compile_mode=max-autotune)\n"
    ) in out
    rows = json.loads(diff(capsys, a, b, "--json")[1])["config"]["differences"]
    assert rows[2] == {
        "key": "trainer.compile_mode", "change": "added", "a": None, "b": "max-autotune",
        "a_set_by": "(default)", "b_set_by": "+trainer.compile_mode=max-autotune",
    }  # fmt: skip
    assert [row["change"] for row in rows] == ["changed", "removed", "added"]


def test_code_packages_launch_and_environment_differences_from_the_launch_records(tmp_path, capsys):
    a = make_run(tmp_path / "a")
    record = changed(RECORD, packages={"numpy": "2.1.0", "torch": "2.14.0", "xxhash": "3.5.0"})
    record["code"]["runner"].update(commit="b" * 40, dirty=True, diff_sha256="c" * 64)
    record["launch"].update(world_size=2, hosts=["node1", "node2"])
    record["environment"] = {"PYTHONHASHSEED": "0", "CUDA_VISIBLE_DEVICES": "0,1"}
    b = make_run(tmp_path / "b", record=record)
    code, out, _ = diff(capsys, a, b)
    assert code == 1
    assert (
        "code: 3 fields differ\n"
        "  field               a             b\n"
        "  runner.commit       aaaaaaaaaaaa  bbbbbbbbbbbb\n"
        "  runner.diff_sha256  -             cccccccccccc\n"
        "  runner.dirty        false         true\n"
        "packages: 2 packages differ\n"
        "  package  a       b\n"
        "  torch    2.13.0  2.14.0\n"
        "  xxhash   -       3.5.0\n"
        "hardware and launch: 2 fields differ\n"
        "  field              a          b\n"
        '  launch.hosts       ["node1"]  ["node1", "node2"]\n'
        "  launch.world_size  1          2\n"
        "environment: 1 variable differs\n"
        "  variable              a  b\n"
        "  CUDA_VISIBLE_DEVICES  -  0,1\n"
    ) in out
    report = json.loads(diff(capsys, a, b, "--json")[1])
    assert report["code"]["differences"][0] == {"name": "runner.commit", "a": "a" * 40, "b": "b" * 40}
    assert report["config"]["same"] and report["metrics"]["same"] and not report["same"]


def test_data_order_names_the_first_batch_read_differently(tmp_path, capsys):
    a = make_run(tmp_path / "a")
    order = {"first_batch": 0, "digest": "e" * 64, "batches": ["b0", "b1", "x2", "x3"]}
    b = make_run(tmp_path / "b", record=changed(RECORD, data_order=order))
    code, out, _ = diff(capsys, a, b)
    assert code == 1
    assert (
        "data order: differs from batch 2\n"
        "     first batch  batches  digest\n"
        "  a  0            4        dddddddddddd\n"
        "  b  0            4        eeeeeeeeeeee\n"
    ) in out
    assert json.loads(diff(capsys, a, b, "--json")[1])["data_order"]["first_different_batch"] == 2


def test_sweep_jobs_as_json(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    jobs = []
    for number, lr in enumerate(("0.001", "0.003")):
        overrides = [f"optimizer.lr={lr}"]
        job = make_run(sweep / str(number), config=changed(CONFIG, optimizer__lr=float(lr)), overrides=overrides,
                       scalars={"train/loss": [(1, 2.0), (2, 1.5 + number)]})  # fmt: skip
        (job / "job.json").write_text(json.dumps({"status": "finished", "overrides": overrides}))
        jobs.append(job)
    code, out, _ = diff(capsys, *jobs, "--json")
    report = json.loads(out)
    assert code == 1 and report["a"]["kind"] == f"job 0 of sweep {sweep}" and report["b"]["launches"] == 1
    assert report["config"]["differences"] == [{
        "key": "optimizer.lr", "change": "changed", "a": 0.001, "b": 0.003,
        "a_set_by": "optimizer.lr=0.001", "b_set_by": "optimizer.lr=0.003",
    }]  # fmt: skip
    assert report["metrics"]["first_divergence"] == {
        "tag": "train/loss", "step": 2, "a": 1.5, "b": 2.5, "difference": 1.0, "relative": 1 / 1.5,
    }  # fmt: skip
    assert [report[name]["same"] for name in ("code", "packages", "launch", "environment", "data_order")] == [True] * 5


def test_a_checkpoint_is_compared_with_its_config_and_the_metrics_up_to_its_step(tmp_path, capsys):
    a = make_run(tmp_path / "a")
    longer = {"train/loss": [*SCALARS["train/loss"], (4, 1.0), (5, 0.5)]}  # the same up to step 3
    b = make_run(tmp_path / "b", scalars=longer, metrics={**METRICS, "step": 5, "train/loss": 0.5})
    resolved = changed(CONFIG, data__train__root="/data", project__project_dir=str(b))  # as a checkpoint saves it
    checkpoint = make_checkpoint(b, step=3, config=resolved)
    code, out, err = diff(capsys, a, checkpoint)
    assert (code, err) == (0, "")
    assert out == (
        f"a: {a} (run; 1 launch)\n"
        f"b: {checkpoint} (checkpoint at step 3 of run {b}; 1 launch)\n"
        "config: same\n"
        "  not compared: project.project_dir (where each run writes)\n"
        "code: same\n"
        "packages: same\n"
        "hardware and launch: same\n"
        "environment: same\n"
        "data order: same (4 batches from batch 0, digest dddddddddddd)\n"
        "state: not compared\n"
        "  a is a run, not a checkpoint: name checkpoints (<run>/checkpoints/checkpoint_N) to compare their states\n"
        "metrics: same\n"
        "  not compared: train/samples_per_second (speed and time, which differ between any two runs)\n"
        f"  {b}/metrics.json is of step 5, not the checkpoint's 3: final metrics not compared\n"
    )
    assert diff(capsys, a, b)[1].splitlines()[-8:] == [  # the run itself: it went on to step 5, which a never logged
        "metrics: first differ at step 4 (train/loss)",
        "  not compared: train/samples_per_second (speed and time, which differ between any two runs)",
        "  tag         step  a  b    b - a  relative",
        "  train/loss  4     -  1.0  -      -",
        "  final values (metrics.json):",
        "    metric      a     b",
        "    step        3     5",
        "    train/loss  1.25  0.5",
    ]


def test_a_value_taken_from_another_key_is_named_with_that_keys_override(tmp_path, capsys):
    a = make_run(tmp_path / "a", config=changed(CONFIG, data__root="/a"), overrides=["data.root=/a"])
    b = make_run(tmp_path / "b", config=changed(CONFIG, data__root="/b"), overrides=["data.root=/b"])
    resolved = changed(CONFIG, data__root="/b", data__train__root="/b", project__project_dir=str(b))
    checkpoint = make_checkpoint(b, step=3, config=resolved, overrides=["data.root=/b"])
    assert diff(capsys, a, checkpoint)[1].splitlines()[2:6] == [
        "config: 2 keys differ",
        "  key              a                  b",
        "  data.root        /a (data.root=/a)  /b (data.root=/b)",
        "  data.train.root  /a (data.root=/a)  /b (data.root=/b)",  # ${data.root} in a, resolved in the checkpoint
    ]
    assert diff(capsys, a, b)[1].splitlines()[2:5] == [  # both keep ${data.root}: only data.root differs
        "config: 1 key differs",
        "  key        a                  b",
        "  data.root  /a (data.root=/a)  /b (data.root=/b)",
    ]


def test_a_resume_that_changed_what_the_first_launch_recorded_is_named(tmp_path, capsys):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    checkpoint = make_checkpoint(b, step=3, config=CONFIG)  # saved now: before the resume below
    resume = changed(RECORD, attempt=2, started_at="2099-01-01T10:00:00+00:00", packages={"torch": "2.14.0"})
    (b / PROVENANCE_DIR / "attempt_2.json").write_text(json.dumps(resume))
    code, out, _ = diff(capsys, a, b)
    assert code == 0  # the first launches are compared
    assert "packages: same\n  b: launch 2 (a resume) differs from its first launch\n" in out
    assert out.splitlines()[1] == f"b: {b} (run; 2 launches)"
    out = diff(capsys, a, checkpoint)[1]  # the checkpoint was saved before the resume: its launch is the first
    assert out.splitlines()[1] == f"b: {checkpoint} (checkpoint at step 3 of run {b}; 1 launch)"
    assert "launch 2" not in out


def test_identical_runs_are_the_same_in_every_section_and_exit_0(tmp_path, capsys):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    code, out, _ = diff(capsys, a, b)
    assert code == 0
    assert out.splitlines()[2:] == [
        "config: same",
        "code: same",
        "packages: same",
        "hardware and launch: same",
        "environment: same",
        "data order: same (4 batches from batch 0, digest dddddddddddd)",
        "metrics: same",
        "  not compared: train/samples_per_second (speed and time, which differ between any two runs)",
    ]
    report = json.loads(diff(capsys, a, b, "--json")[1])
    sections = [name for name in report if name not in ("a", "b", "same", "state")]
    assert report["same"] is True and all(report[name]["same"] for name in sections)
    assert report["state"]["same"] is None  # two runs: no checkpoint's state is compared


def test_runs_without_launch_records_still_compare_config_and_metrics(tmp_path, capsys):
    a = make_run(tmp_path / "a", record=None)
    b = make_run(tmp_path / "b", record=None, config=changed(CONFIG, seed=7), overrides=["seed=7"])
    code, out, _ = diff(capsys, a, b)
    assert code == 1
    assert out.splitlines()[2:12] == [
        "config: 1 key differs",
        "  key   a             b",
        "  seed  42 (default)  7 (seed=7)",
        "code: not compared",
        f"  no launch record in {a}",
        f"  no launch record in {b}",
        "packages: not compared",
        f"  no launch record in {a}",
        f"  no launch record in {b}",
        "hardware and launch: not compared",
    ]
    assert "metrics: same" in out


def test_a_missing_folder_a_folder_that_is_no_run_and_a_link_are_refused_in_one_sentence(tmp_path, capsys):
    a = make_run(tmp_path / "a")
    assert diff(capsys, a, tmp_path / "gone") == (
        2, "", f"runner: error: {tmp_path / 'gone'} is not a folder; {FOLDERS}.\n"
    )  # fmt: skip
    (tmp_path / "notes").mkdir()
    assert diff(capsys, tmp_path / "notes", a) == (2, "", (
        f"runner: error: {tmp_path / 'notes'} is neither a run (.hydra/, run.log, checkpoints/, provenance/) nor a "
        f"checkpoint (checkpoints/checkpoint_N with its manifest.json); {FOLDERS}.\n"
    ))  # fmt: skip
    b = make_run(tmp_path / "b")
    os.symlink(tmp_path / "elsewhere.json", b / "metrics.json.link")
    assert diff(capsys, a, b) == (2, "", (
        f"runner: error: {b / 'metrics.json.link'} is a symbolic link (to {tmp_path / 'elsewhere.json'}); a run "
        "folder holds no links, so remove it or copy the run with links resolved (cp -rL).\n"
    ))  # fmt: skip


@pytest.mark.parametrize("argv", [[], ["one"], ["one", "two", "three"]])
def test_a_command_line_without_two_folders_prints_the_usage_and_exits_2(argv, capsys):
    assert diff(capsys, *argv) == (2, "", "usage: runner diff [--json] RUN_A RUN_B\n")


def test_an_unknown_option_is_named_with_the_usage_and_exits_2(capsys):
    assert diff(capsys, "--color", "one", "two") == (
        2, "", "runner: error: --color is not an option of runner diff; usage: runner diff [--json] RUN_A RUN_B\n"
    )  # fmt: skip


def test_help_says_what_each_section_compares_and_the_exit_status(capsys):
    code, out, _ = diff(capsys, "--help")
    assert code == 0 and out.startswith("usage: runner diff [--json] RUN_A RUN_B\n\n    runner diff ")
    assert "Exit status, as diff's: 0 when nothing differs, 1 when something does, 2 for a bad folder" in out


def make_state_checkpoint(run: Path, number: int, *, step: int, weight: list[float]) -> Path:
    """``run/checkpoints/checkpoint_<number>`` saved at ``step``: a model of one tensor and one process's RNG state,
    in the files a real checkpoint holds."""
    import torch
    from safetensors.torch import save_file

    folder = run / "checkpoints" / f"checkpoint_{number}"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(CONFIG, sort_keys=False))
    (folder / "overrides.yaml").write_text(yaml.safe_dump([]))
    save_file({"weight": torch.tensor(weight)}, str(folder / "model.safetensors"))
    torch.save({"seed": torch.tensor([7])}, folder / "random_states_0.pt")
    contents = {"models": 1, "optimizers": 0, "schedulers": 0, "custom_objects": 0, "dataloaders": 0,
                "scaler": False, "gradients": False}  # fmt: skip
    write_manifest(folder, world_size=1, iteration=number, state_format="safetensors", contents=contents,
                   metadata={"step": step, "epoch": 0})  # fmt: skip
    return folder


def test_two_checkpoints_of_different_steps_differ_in_position_and_state(tmp_path, capsys):
    run = make_run(tmp_path / "run", scalars={"train/loss": [(1, 2.0), (2, 1.5), (3, 1.25), (4, 1.0)]})
    early = make_state_checkpoint(run, 0, step=2, weight=[0.0, 1.0, 2.0, 3.0])
    late = make_state_checkpoint(run, 1, step=4, weight=[0.0, 1.0, 2.5, 3.0])
    code, out, err = diff(capsys, early, late)
    assert (code, err) == (1, "")
    lines = out.splitlines()
    state = lines.index("state: 2 differences")
    assert lines[state + 1 : state + 3] == [
        "  position: step: 2 vs 4",
        "  model weights: weight: 1 of 4 values differ, by up to 0.5 (first at index 2: 2.0 vs 2.5)",
    ]
    assert lines[state + 3 :] == [  # what the later checkpoint's run logged after the earlier one is not counted
        "metrics: same",
        "  steps after 2, where the earlier checkpoint was saved, are not compared",
        f"  {run}/metrics.json is of step 3, not the checkpoint's 2: final metrics not compared",
        f"  {run}/metrics.json is of step 3, not the checkpoint's 4: final metrics not compared",
    ]
    report = json.loads(diff(capsys, early, late, "--json")[1])
    assert report["state"]["differences"][0] == {"what": "position", "where": "step", "detail": "2 vs 4"}
    assert report["state"]["same"] is False and report["same"] is False
    again = make_state_checkpoint(tmp_path / "copy", 0, step=2, weight=[0.0, 1.0, 2.0, 3.0])
    assert "state: same" in diff(capsys, early, again)[1]


def test_a_damaged_checkpoint_gets_one_line_in_the_state_section(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    first = make_state_checkpoint(run, 0, step=2, weight=[0.0, 1.0])
    second = make_state_checkpoint(run, 1, step=2, weight=[0.0, 1.0])
    damaged = bytearray((second / "model.safetensors").read_bytes())
    damaged[-1] ^= 0xFF  # the same size: only its digest tells
    (second / "model.safetensors").write_bytes(bytes(damaged))
    code, out, err = diff(capsys, first, second)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    state = lines.index("state: not compared")
    assert lines[state + 1].startswith(f"  not compared: {second}") and "model.safetensors" in lines[state + 1]
    assert lines[state + 2] == "metrics: same"


def test_a_corrupt_first_record_is_named_and_a_later_one_is_never_taken_for_the_first(tmp_path, capsys):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    (a / PROVENANCE_DIR / "attempt_1.json").write_text("{not json")
    (a / PROVENANCE_DIR / "attempt_2.json").write_text(json.dumps({**RECORD, "attempt": 2, "resume": str(a)}))
    (b / PROVENANCE_DIR / "attempt_1.json").unlink()
    (b / PROVENANCE_DIR / "attempt_2.json").write_text(json.dumps({**RECORD, "attempt": 2, "resume": str(b)}))
    code, out, err = diff(capsys, a, b)
    assert (code, err) == (0, "")
    assert (
        "code: not compared\n"
        f"  {a / PROVENANCE_DIR / 'attempt_1.json'} is not JSON\n"
        f"  no record of the first launch of {b}: its records begin with a resume (attempt_2.json)\n"
    ) in out
    assert "data order: not compared\n" in out


def test_a_record_of_the_wrong_types_is_read_as_data(tmp_path, capsys):
    record = changed(RECORD, code={"runner": {}, "repositories": {"/src/lab": {"packages": [1, "lab"], "commit": 3}}})
    a = make_run(tmp_path / "a", record=record)
    b = make_run(tmp_path / "b", record=changed(record, code__repositories={"/src/lab": {"packages": {"x": 1}}}))
    code, out, err = diff(capsys, a, b)
    assert (code, err) == (1, "")
    assert "code: 1 field differs\n  field       a  b\n  lab.commit  3  -\n" in out  # named by its one package


def test_one_side_reading_fewer_of_the_same_batches_is_said_so(tmp_path, capsys):
    a = make_run(tmp_path / "a")
    fewer = {"first_batch": 0, "digest": "e" * 64, "batches": ["b0", "b1", "b2"]}
    b = make_run(tmp_path / "b", record=changed(RECORD, data_order=fewer))
    code, out, _ = diff(capsys, a, b)
    assert code == 0
    assert "data order: same as far as both read, from batch 0; b read fewer batches (3 vs 4)\n" in out
    assert json.loads(diff(capsys, a, b, "--json")[1])["data_order"]["fewer_batches"] == "b"


def test_json_writes_values_that_are_not_finite_as_strings(tmp_path, capsys):
    a = make_run(tmp_path / "a", scalars={"train/loss": [(1, 2.0), (2, float("nan"))]})
    b = make_run(tmp_path / "b", scalars={"train/loss": [(1, 2.0), (2, float("inf"))]},
                 metrics={**METRICS, "train/loss": float("-inf")})  # fmt: skip
    code, out, _ = diff(capsys, a, b, "--json")

    def refuse(constant: str):
        raise AssertionError(f"{constant} is not JSON")

    report = json.loads(out, parse_constant=refuse)
    assert code == 1
    assert report["metrics"]["first_divergence"] == {
        "tag": "train/loss", "step": 2, "a": "NaN", "b": "Infinity", "difference": "NaN", "relative": None,
    }  # fmt: skip
    assert report["metrics"]["final"] == [{"metric": "train/loss", "a": 1.25, "b": "-Infinity"}]
