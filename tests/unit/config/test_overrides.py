"""Every override the runner reads is read with Hydra's grammar, so it means what Hydra will compose."""

import pytest

from runner.config import ConfigError, overrides


@pytest.mark.parametrize(
    ("line", "name"),
    [
        ("trainer.max_steps=10", "trainer.max_steps"),
        ("+trainer.seed=1", "trainer.seed"),
        ("++trainer.seed=2", "trainer.seed"),
        ("~trainer.seed", "trainer.seed"),
        ("~trainer.seed=3", "trainer.seed"),
        ("model=resnet", "model"),
        ("+optimizer@trainer.optimizer=adamw", "optimizer"),
        ("hydra/launcher=joblib", "hydra/launcher"),
    ],
)
def test_key_is_the_key_or_group_without_its_prefix(line, name):
    assert overrides.key(line) == name


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('resume="/tmp/a b"', "/tmp/a b"),
        ("resume='/tmp/a b'", "/tmp/a b"),
        ("resume=/tmp/run", "/tmp/run"),
        ('data.train_split="test[:8000]"', "test[:8000]"),
        ("trainer.max_steps=10", "10"),
        ("optimizer.lr=1e-3", "0.001"),  # Hydra types a bare number: text gives that value
        ("model.sizes=[1,2]", "[1,2]"),
        ("project.name=", ""),
        ("x=${trainer.seed}", "${trainer.seed}"),  # an interpolation is kept for OmegaConf
        ("~resume", None),
        ("~resume=/tmp/run", None),
        ("optimizer.lr=1e-3,1e-4", None),
        ("optimizer.lr=choice(1e-3,1e-4)", None),
        ("trainer.seed=range(1,4)", None),
    ],
)
def test_text_unquotes_and_is_none_for_deletions_and_sweeps(line, expected):
    assert overrides.text(overrides.parse([line])[0]) == expected


def test_value_is_the_last_line_that_sets_the_key():
    lines = ["resume=/tmp/first", "trainer.max_steps=5", '+resume="/tmp/second run"']
    assert overrides.value(lines, "resume") == "/tmp/second run"
    assert overrides.value(lines, "trainer.max_steps") == "5"
    assert overrides.value(lines, "trainer.seed") is None
    assert overrides.value(["resume=/tmp/run", "~resume"], "resume") is None  # deleted last
    assert overrides.value(["trainer.max_steps=5"], "trainer") is None  # a key, not a prefix


def test_values_gives_each_key_its_last_value():
    lines = ["optimizer.lr=1e-3", "~resume", "trainer.seed=1,2", 'optimizer.lr="2e-3"']
    assert overrides.values(lines) == {"optimizer.lr": "2e-3", "resume": None, "trainer.seed": None}


def test_last_per_key_keeps_the_line_hydra_applies_in_its_place():
    lines = ["a=1", "b=2", "+a=3", "c=1", "~b", "d@pkg=x"]
    assert overrides.last_per_key(lines) == ["+a=3", "c=1", "~b", "d@pkg=x"]
    assert overrides.last_per_key([]) == []


def test_without_drops_every_line_of_the_named_keys():
    lines = ["resume=/tmp/run", "+trainer.seed=2", "~hydra.run.dir", "trainer.max_steps=4", "++resume=/tmp/other"]
    assert overrides.without(lines, "resume", "hydra.run.dir") == ["+trainer.seed=2", "trainer.max_steps=4"]
    assert overrides.without(lines) == lines


def test_sets_is_true_for_a_line_that_sets_or_deletes_exactly_that_key():
    assert overrides.sets(["trainer.max_steps=4", "~resume"], "resume")
    assert overrides.sets(["++trainer.seed=1"], "trainer.seed")
    assert not overrides.sets(["trainer.max_steps=4"], "trainer")
    assert not overrides.sets(["resume_from=/x"], "resume")
    assert not overrides.sets([], "resume")


@pytest.mark.parametrize(
    ("line", "configures_hydra"),
    [
        ("hydra.run.dir=/tmp/run", True),
        ("++hydra.job.chdir=false", True),
        ("hydra/launcher=joblib", True),
        ("hydra=custom", True),
        ("hydra_like=1", False),
        ("trainer.hydra=1", False),
        ("hydras.run=1", False),
    ],
)
def test_is_hydra_is_true_for_hydras_own_keys_and_groups(line, configures_hydra):
    assert overrides.is_hydra(line) is configures_hydra


def test_as_typed_keeps_each_value_as_it_was_written():
    lines = ["optimizer.lr=1e-3", "~resume", "+trainer.seed=0.10", "optimizer.lr=2e-3", 'project.name="my run"']
    assert overrides.as_typed(lines) == {"optimizer.lr": "2e-3", "trainer.seed": "0.10", "project.name": '"my run"'}
    assert overrides.as_typed(["optimizer.lr=1e-3"]) == {"optimizer.lr": "1e-3"}


@pytest.mark.parametrize(
    ("line", "hydras_reason"),
    [
        ("data.train_split=test[:8000]", "mismatched input '[' expecting <EOF>"),
        ("model.name=a=b", "mismatched input '=' expecting <EOF>"),
    ],
)
def test_a_line_hydra_cannot_read_is_one_sentence_with_the_fix(line, hydras_reason):
    with pytest.raises(ConfigError) as error:
        overrides.parse(["trainer.max_steps=4", line])
    assert str(error.value) == (
        f"Cannot parse the override {line!r} ({hydras_reason}); values with brackets, commas or spaces need inner "
        """quotes, e.g. 'data.train_split="test[:8000]"'."""
    )
    assert error.value.__cause__ is None and error.value.__suppress_context__


def test_the_fix_the_sentence_suggests_parses():
    assert overrides.value(['data.train_split="test[:8000]"'], "data.train_split") == "test[:8000]"


def test_plain_values_stay_bare_and_others_are_quoted():
    assert overrides.hydra_value("/tmp/outputs/2024-05-01_12-00-00") == "/tmp/outputs/2024-05-01_12-00-00"
    assert overrides.hydra_value("pkg://runner.conf") == "pkg://runner.conf"
    assert overrides.hydra_value("/tmp/a b") == '"/tmp/a b"'
    assert overrides.hydra_value('/tmp/say "hi"') == r'"/tmp/say \"hi\""'


@pytest.mark.parametrize(
    "path",
    [
        "/tmp/a b",
        "/tmp/it's",
        '/tmp/say "hi"',
        "/tmp/a'b\"c",
        "/tmp/x,y",
        "/tmp/test[:8000]",
        "/tmp/a=b",
        "/tmp/{a}",
        "/tmp/$HOME",
        "/tmp/#1",
        "/tmp/tab\there",
        " leading and trailing ",
        "~/outputs",
        "ends with a backslash\\",
        '/tmp/backslash then quote\\"',
        "",
    ],
)
def test_hydra_value_round_trips_through_hydras_grammar(path):
    assert overrides.text(overrides.parse([f"hydra.run.dir={overrides.hydra_value(path)}"])[0]) == path


@pytest.mark.parametrize("path", ["/tmp/back\\slash", "C:\\runs\\one\\"])
def test_hydra_value_round_trips_a_backslash_inside_a_path(path):
    assert overrides.text(overrides.parse([f"resume={overrides.hydra_value(path)}"])[0]) == path


def test_hydra_value_round_trips_a_non_ascii_path():
    path = "/home/josé/outputs"
    assert overrides.text(overrides.parse([f"resume={overrides.hydra_value(path)}"])[0]) == path


def test_parse_gives_one_override_per_line_in_order():
    parsed = overrides.parse(line for line in ["a=1", "~b", "+c=x"])
    assert [(o.key_or_group, overrides.text(o)) for o in parsed] == [("a", "1"), ("b", None), ("c", "x")]
