"""runner check-resume's reasons: from the differences found and the runs' launch records, why a resume drifts."""

from omegaconf import OmegaConf

from runner.cli.check_resume import Finding, Verdict, _cause, _data_findings, _hydra_flags


def _record(*, batches=(), first=0, world=1, device="cpu", generators=()):
    order = {"first_batch": first, "batches": list(batches), "digest": "d"} if batches else None
    return {"launch": {"world_size": world, "device": device, "gradient_accumulation_steps": 2},
            "data_order": order, "own_generators": list(generators)}  # fmt: skip


def _records(straight, *cut):
    return {"straight": [straight], "cut": list(cut)}


LOSS_AT_3 = Finding("logged train/loss: step 3: 1.0 vs 2.0", False, 3, "logged", "logged train/loss")


def test_the_first_batch_read_differently_is_found_before_the_cut_and_after_the_resume():
    straight = _record(batches="abcdefgh")
    same = _records(straight, _record(batches="abcd"), _record(batches="efgh", first=4))
    assert _data_findings(same, cut_step=2, accumulation=2) == []
    drifted = _records(straight, _record(batches="abXd"), _record(batches="efYh", first=4))
    found = _data_findings(drifted, cut_step=2, accumulation=2)
    assert [(f.before_cut, f.step, f.sentence) for f in found] == [
        (True, 2, "before the cut, the interrupted run read other training data at step 2 (batch 2) than the "
                  "straight run"),
        (False, 4, "after the resume, the resumed run read other training data at step 4 (batch 6) than the "
                   "straight run"),
    ]  # fmt: skip


def test_each_reason_is_told_from_where_the_runs_first_differ(tmp_path):
    rng = {"key": "data.train", "class": "lab.Noisy", "attribute": "rng", "type": "random.Random"}
    held = {"key": "model", "class": "lab.Net", "attribute": "drop.generator", "type": "torch.Generator"}
    plain = _records(_record(), _record(), _record())
    before = Finding("before the cut ...", True, 2, "data")
    assert "the dataset's order or contents are not stable" in _cause([before], plain, tmp_path, cut_step=2)
    computed = Finding("logged train/loss: step 1 ...", True, 1, "logged")
    on_cpu = _cause([computed], plain, tmp_path, cut_step=2)
    assert on_cpu.startswith("two runs of the same config read the same data but computed different values before "
                             "any resume: a random draw not seeded from `seed`")  # fmt: skip
    on_gpu = _cause([computed], _records(_record(device="cuda"), _record(), _record()), tmp_path, cut_step=2)
    assert "non-deterministic ops on this device (torch.use_deterministic_algorithms(True)" in on_gpu
    after = Finding("after the resume ...", False, 3, "data")
    told = _cause([after], _records(_record(generators=[rng]), _record(), _record()), tmp_path, cut_step=2)
    assert "data.train (lab.Noisy) keeps a random.Random of its own at .rng, which no checkpoint saves" in told
    assert "the data position or a dataset's own state is not restored" in _cause([after], plain, tmp_path,
                                                                                   cut_step=2)  # fmt: skip
    model_held = _cause([LOSS_AT_3], _records(_record(generators=[held]), _record(), _record()), tmp_path, cut_step=2)
    assert model_held.startswith("model (lab.Net) keeps a torch.Generator of its own at .drop.generator, which no ")
    assert "register_for_checkpointing" in _cause([LOSS_AT_3], plain, tmp_path, cut_step=2)
    moved = _records(_record(world=2), _record(world=2), _record(world=1))
    assert _cause([LOSS_AT_3], moved, tmp_path, cut_step=2).startswith(
        "the resume ran on 1 process and the straight run on 2: another process count shards the data"
    )


def test_an_evaluation_that_differs_alone_names_the_runs_metric(tmp_path):
    (tmp_path / ".hydra").mkdir()
    metrics = {"metrics": {"accuracy": {"_target_": "lab.Accuracy"}, "f1": {"_target_": "lab.RunningF1"}}}
    OmegaConf.save(OmegaConf.create(metrics), tmp_path / ".hydra" / "config.yaml")
    evaluated = Finding("logged eval/f1: step 4 ...", False, 4, "logged", "logged eval/f1")
    told = _cause([evaluated], _records(_record(), _record(), _record()), tmp_path, cut_step=2)
    assert told == ("the weights and the training losses match but an evaluation after the resume does not: "
                    "metrics.f1 (lab.RunningF1) keeps state from one evaluation to the next (reset() must clear all "
                    "of it), and a resumed run starts it afresh.")  # fmt: skip


def test_the_report_leads_with_the_first_difference_and_the_resume_keeps_the_config_flags():
    assert Verdict([], None).report().startswith("resume is exact: ")
    unchecked = Verdict([], None, ("a run saved no final checkpoint, so the weights were not compared",)).report()
    assert unchecked == ("resume is exact in all that was compared, but a run saved no final checkpoint, so the "
                         "weights were not compared.")  # fmt: skip
    report = Verdict([LOSS_AT_3, Finding("metrics.json eval/loss: 1 vs 2", False, None, "metrics")], "why so").report()
    assert report.splitlines() == ["resume is not exact: logged train/loss: step 3: 1.0 vs 2.0", "why: why so",
                                   "also different:", "  metrics.json eval/loss: 1 vs 2"]  # fmt: skip
    assert _hydra_flags(["--config-dir", "conf", "experiment=x", "-cn=other", "-m"]) == [
        "--config-dir", "conf", "-cn=other"]  # fmt: skip
