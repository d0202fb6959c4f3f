"""runner.data.Mixture: sources drawn by weight, deterministic, resumed exactly from its state (through a prepared
loader's checkpoint too), each exhaustion rule, and one sentence for what cannot be mixed."""

import collections
import json

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from runner.data import Mixture, Packed
from runner.engine import Accelerator
from runner.engine.checkpoint.errors import CheckpointError
from runner.engine.loaders.stream_states import shown
from tests.helpers import StatefulRange


class Tagged(StatefulRange):
    """(tag, i) for i in range(n): a stream with state that says where each sample came from."""

    def __init__(self, n: int, tag: str) -> None:
        super().__init__(n)
        self.tag = tag

    def __iter__(self):
        for index in super().__iter__():
            yield f"{self.tag}{index}"


def sources(*sizes: int) -> list[Tagged]:
    return [Tagged(size, "abc"[i]) for i, size in enumerate(sizes)]


def take(mixture, count: int) -> list:
    return list(zip(range(count), mixture, strict=False))


def test_draws_match_the_weights_and_are_the_same_for_a_seed_and_epoch():
    mixture = Mixture(sources(100, 100, 100), weights=[7, 2, 1], seed=3, exhausted="restart")
    drawn = [sample for _, sample in take(mixture, 10_000)]
    counts = collections.Counter(sample[0] for sample in drawn)
    expected = {"a": 7000, "b": 2000, "c": 1000}
    chi_square = sum((counts[tag] - n) ** 2 / n for tag, n in expected.items())
    assert chi_square < 13.82, counts  # 2 degrees of freedom, p = 0.001
    again = Mixture(sources(100, 100, 100), weights=[7, 2, 1], seed=3, exhausted="restart")
    assert [sample for _, sample in take(again, 10_000)] == drawn
    again.set_epoch(1)  # another epoch, another order
    assert [sample for _, sample in take(again, 100)] != drawn[:100]
    assert Mixture(sources(5, 5), seed=0, weights=[1, 0], exhausted="drop").__iter__().__next__() == "a0"


def test_each_rule_for_a_source_that_runs_out():
    stop = list(Mixture(sources(3, 50), seed=1, exhausted="stop"))
    assert sum(s[0] == "a" for s in stop) == 3 and stop[-1].startswith("b")  # ends when a, asked again, is out
    dropped = list(Mixture(sources(3, 5, 7), seed=1, exhausted="drop"))
    assert sorted(dropped) == sorted(
        [f"a{i}" for i in range(3)] + [f"b{i}" for i in range(5)] + [f"c{i}" for i in range(7)]
    )
    restarted = Mixture(sources(2, 1000), seed=1, exhausted="restart")
    firsts = [sample for _, sample in take(restarted, 40) if sample[0] == "a"]
    assert firsts[:6] == ["a0", "a1", "a0", "a1", "a0", "a1"]  # a begins again each time it runs out
    assert restarted.state_dict()["restarts"][0] >= 2


@pytest.mark.parametrize("rule", ["stop", "restart", "drop"])
def test_a_resumed_mixture_continues_exactly_reading_nothing_twice(rule):
    def build():
        return Mixture(sources(40, 30, 20), weights=[3, 2, 1], seed=5, exhausted=rule)

    uninterrupted = [sample for _, sample in take(build(), 150)]  # restart never ends: 150 samples of each
    for cut in (1, 37, 60):
        mixture = build()
        head = [sample for _, sample in take(mixture, cut)]
        state = json.loads(json.dumps(mixture.state_dict()))  # as the manifest keeps it
        resumed = build()
        resumed.load_state_dict(state)
        assert resumed.state_dict() == state  # loaded, not iterated yet
        rest = [sample for _, sample in take(resumed, 150 - cut)]
        assert head + rest == uninterrupted
        # each source read only for what it handed out after the cut (from its state, or anew once restarted)
        taken = collections.Counter(sample[0] for sample in rest)
        assert [source.reads for source in resumed.datasets] == [taken[tag] for tag in "abc"]


def test_map_style_sources_resume_by_index_and_a_prepared_loader_checkpoints_the_mixture(tmp_path):
    def build():
        return Mixture([list(range(100, 140)), Tagged(30, "b")], weights=[1, 1], seed=2, exhausted="drop")

    plain = [batch for batch in DataLoader(build(), batch_size=4, collate_fn=list)]
    accelerator = Accelerator(project_dir=tmp_path)
    loader = accelerator.prepare(DataLoader(build(), batch_size=4, collate_fn=list))
    iterator = iter(loader)
    head = [next(iterator) for _ in range(5)]
    accelerator.save_state(tmp_path / "saved")
    resumed = Accelerator(project_dir=tmp_path)
    mixture = build()
    resumed_loader = resumed.prepare(DataLoader(mixture, batch_size=4, collate_fn=list))
    resumed.load_state(tmp_path / "saved")
    assert head + list(resumed_loader) == plain
    assert mixture.datasets[1].reads == sum(str(s).startswith("b") for batch in plain[5:] for s in batch)


def test_the_yaml_form_builds_each_source():
    node = OmegaConf.create({
        "_target_": "runner.data.Mixture", "weights": [1, 1], "seed": 0, "exhausted": "drop",
        "datasets": [{"_target_": "tests.unit.data.test_mixture.Tagged", "n": 2, "tag": "a"},
                     {"_target_": "tests.unit.data.test_mixture.Tagged", "n": 2, "tag": "b"}],
    })  # fmt: skip
    assert sorted(instantiate(node)) == ["a0", "a1", "b0", "b1"]


@pytest.mark.parametrize(
    ("arguments", "sentence"),
    [
        ({"datasets": []}, "Mixture needs at least one dataset in datasets."),
        ({"datasets": [[1], [2]], "weights": [1]}, "Mixture has 2 datasets and 1 weights; give one weight per "
         "dataset."),
        ({"datasets": [[1], [2]], "weights": [1, -1]}, "Mixture's weights=[1.0, -1.0] must be non-negative numbers, "
         "not all 0."),
        ({"datasets": [[1]], "weights": [0]}, "Mixture's weights=[0.0] must be non-negative numbers, not all 0."),
        ({"datasets": [[1]], "exhausted": "repeat"}, "Mixture's exhausted='repeat' is not a rule; use one of stop, "
         "restart, drop."),
    ],
)  # fmt: skip
def test_what_cannot_be_mixed_is_one_sentence(arguments, sentence):
    with pytest.raises(ValueError) as refused:
        Mixture(**arguments)
    assert str(refused.value) == sentence
    with pytest.raises(ValueError, match=r"^Mixture's dataset 0 \(list\) is empty\.$"):
        list(Mixture([[], [1, 2]], exhausted="restart"))


def test_weights_the_draws_cannot_use_are_one_sentence_when_the_mixture_is_built():
    for weights in ([float("inf"), 1], [1e308, 1e308]):
        with pytest.raises(ValueError) as refused:
            Mixture(sources(3, 3), weights=weights)
        assert str(refused.value) == (
            f"Mixture's weights={[float(w) for w in weights]} must be finite, and so must their sum; scale them down "
            "(only their ratios matter)."
        )
    with pytest.raises(ValueError) as refused:
        Mixture(sources(3, 3), weights=["a", 1])
    assert str(refused.value) == "Mixture's weights=['a', 1.0] must be numbers."
    assert Mixture(sources(3, 3), weights=[1e307, 1e307]).weights == [1e307, 1e307]  # large but summable


# ------------------------------------------------------------------------ a saved state from someone else
FIX = "the checkpoint's stream state is not one this data can have: resume from another checkpoint or start a new run."


def mixed(exhausted: str = "stop") -> Mixture:
    """A stream with state, and a map-style list of 30 (its position: the count taken)."""
    return Mixture([Tagged(40, "a"), list(range(30))], weights=[1, 1], seed=1, exhausted=exhausted)


def saved_state() -> dict:
    mixture = mixed()
    take(mixture, 10)
    return json.loads(json.dumps(mixture.state_dict()))


def test_saved_state_is_a_real_one_to_edit():
    state = saved_state()
    assert {key: value for key, value in state.items() if key != "rng"} == {
        "epoch": 0, "started": True, "active": [0, 1], "taken": [5, 5], "restarts": [0, 0],
        "sources": [{"next": 5}, None],
    }  # fmt: skip
    assert state["rng"][0] == 3 and len(state["rng"][1]) == 625


@pytest.mark.parametrize(
    ("edit", "sentence"),
    [
        ({"epoch": "1"}, "state.epoch: '1' is not an epoch"),
        ({"rng": "x"}, "state.rng: 'x' is not the state of the mixture's random draws"),
        ({"rng": [3, [0] * 625, None]}, "state.rng: [3, [0, 0, 0, 0, ...], None] is not the state of the mixture's "
         "random draws"),
        ({"rng": [3, [1] * 624 + [625], None]}, "state.rng: [3, [1, 1, 1, 1, ...], None] is not the state of the "
         "mixture's random draws"),
        ({"active": [0]}, "state.active: [0] leaves sources out, which exhausted='stop' never does"),
        ({"active": [1, 0]}, "state.active: [1, 0] is not a list of sources in order"),
        ({"active": [0, 2]}, "state.active: [0, 2] names a source this mixture of 2 lacks"),
        ({"taken": [5, 30_000]}, "state.taken[1]: 30000 samples taken, but source 1 holds 30"),
        ({"taken": [5, -1]}, "state.taken[1]: -1 is not a count of samples"),
        ({"taken": [5]}, "state.taken: [5] is not a list of one entry for each of the 2 sources"),
        ({"restarts": [1, 0]}, "state.restarts[0]: 1, where exhausted='stop' restarts no source"),
        ({"restarts": [0, "x"]}, "state.restarts[1]: 'x' is not a count of restarts"),
        ({"sources": [None, {"next": 3}]}, "state.sources[1]: {'next': 3}, but source 1 (list) has no state"),
        ({"sources": "abc"}, "state.sources: 'abc' is not a list of one entry for each of the 2 sources"),
    ],
)  # fmt: skip
def test_an_edited_state_is_one_sentence_naming_its_field(edit, sentence):
    with pytest.raises(CheckpointError) as refused:
        mixed().load_state_dict({**saved_state(), **edit})
    assert str(refused.value) == f"{sentence}; {FIX}"


def test_a_state_that_is_no_mixtures_is_refused_and_a_packed_sources_state_is_checked_by_it():
    started = "epoch, started, rng, active, taken, restarts, sources"
    for state, keys in (
        ("abc", "epoch, started"),
        ({"epoch": 0}, "epoch, started"),
        ({**saved_state(), "x": 1}, started),
    ):
        with pytest.raises(CheckpointError) as refused:
            mixed().load_state_dict(state)
        assert str(refused.value) == f"state: {shown(state)} is not Mixture's state ({keys}); {FIX}"
    mixture = Mixture([Packed([[1, 2, 3]] * 9, block_size=2), [7] * 9], seed=1)
    take(mixture, 6)
    state = json.loads(json.dumps(mixture.state_dict()))
    state["sources"][0].update(carry=[1] * 300, positions=list(range(300)))
    with pytest.raises(CheckpointError) as refused:
        Mixture([Packed([[1, 2, 3]] * 9, block_size=2), [7] * 9], seed=1).load_state_dict(state)
    assert str(refused.value) == (
        "state.sources[0].carry: 300 tokens carried over, where packing leaves fewer than block_size=2 (or the rest "
        f"of one document, which these are not); {FIX}"
    )
