"""runner.data.Mixture: sources drawn by weight, deterministic, resumed exactly from its state (through a prepared
loader's checkpoint too), each exhaustion rule, and one sentence for what cannot be mixed."""

import collections
import json

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from runner.data import Mixture
from runner.engine import Accelerator
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
