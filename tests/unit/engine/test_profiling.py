import json

import pytest
import torch
from torch import nn

from runner.engine import Accelerator
from runner.engine.utils import ProfileKwargs


def _run_steps(accelerator: Accelerator, steps: int, handler: ProfileKwargs | None = None) -> torch.profiler.profile:
    model = nn.Linear(4, 2)
    with accelerator.profile(handler) as profiler:
        for _ in range(steps):
            model(torch.ones(1, 4))
            profiler.step()
    return profiler


def _recorded_steps(trace_file) -> list[str]:
    events = json.loads(trace_file.read_text())["traceEvents"]
    return sorted({event["name"] for event in events if event.get("name", "").startswith("ProfilerStep#")})


def test_profile_records_the_model_ops_and_writes_no_trace_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    profiler = _run_steps(Accelerator(), steps=1)
    assert {"aten::linear", "aten::addmm"} <= {event.key for event in profiler.key_averages()}
    assert list(tmp_path.iterdir()) == []


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events:UserWarning")
def test_the_handler_in_kwargs_handlers_schedules_and_writes_the_trace(tmp_path):
    ready = []
    handler = ProfileKwargs(
        schedule_option={"wait": 1, "warmup": 1, "active": 2, "repeat": 1},
        on_trace_ready=lambda profiler: ready.append(profiler.step_num),
        output_trace_dir=tmp_path / "traces",
    )
    accelerator = Accelerator(kwargs_handlers=[handler])
    assert accelerator.profile_handler is handler
    _run_steps(accelerator, steps=6)
    assert ready == [4]  # one cycle: steps 0 (wait), 1 (warmup), 2 and 3 (active), saved as step 4 begins
    assert _recorded_steps(tmp_path / "traces" / "profile_0.json") == ["ProfilerStep#2", "ProfilerStep#3"]


def test_a_handler_given_to_profile_wins_and_a_relative_folder_is_the_working_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    accelerator = Accelerator(kwargs_handlers=[ProfileKwargs(output_trace_dir=tmp_path / "unused")])
    _run_steps(accelerator, steps=1, handler=ProfileKwargs(output_trace_dir="traces"))
    assert [path.name for path in tmp_path.iterdir()] == ["traces"]
    assert (tmp_path / "traces" / "profile_0.json").stat().st_size > 0


def test_a_schedule_that_recorded_nothing_warns_and_writes_no_trace(tmp_path):
    handler = ProfileKwargs(schedule_option={"wait": 5, "warmup": 1, "active": 1}, output_trace_dir=tmp_path / "traces")
    with pytest.warns(UserWarning, match="profile\\(\\) recorded no step, so it writes no trace"):
        _run_steps(Accelerator(), steps=2, handler=handler)
    assert not (tmp_path / "traces").exists()


@pytest.mark.parametrize(
    ("settings", "sentence"),
    [
        ({"activities": ["cpu", "gpu"]}, "ProfileKwargs.activities got 'gpu'; use any of 'cpu', 'cuda'"),
        (
            {"schedule_option": {"wait": 1, "warmup": 1}},
            "ProfileKwargs.schedule_option is missing 'active'; give wait, warmup, active (and optionally repeat",
        ),
        (
            {"schedule_option": {"wait": 1, "warmup": 1, "active": 1, "cycles": 2}},
            "ProfileKwargs.schedule_option has the unknown key 'cycles'; give wait, warmup, active",
        ),
    ],
)
def test_bad_settings_are_one_sentence_naming_the_field_and_the_accepted_values(settings, sentence):
    with pytest.raises(ValueError, match=sentence.replace("(", r"\(")):
        ProfileKwargs(**settings)
