import pytest

from runner.data import SplitSpec, parse_split


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("train", SplitSpec("train")),
        ("test", SplitSpec("test")),
        ("test[:8000]", SplitSpec("test", None, "8000")),
        ("test[8000:]", SplitSpec("test", "8000", None)),
        ("test[100:200]", SplitSpec("test", "100", "200")),
        ("test[:]", SplitSpec("test")),
        ("train[:10%]", SplitSpec("train", None, "10%")),
        ("train[10%:20%]", SplitSpec("train", "10%", "20%")),
        ("test[-100:]", SplitSpec("test", "-100", None)),
        ("test[:-10%]", SplitSpec("test", None, "-10%")),
        ("  train  ", SplitSpec("train")),
        ("\ttest[:8000]\n", SplitSpec("test", None, "8000")),
    ],
)
def test_parse_split(text, expected):
    assert parse_split(text) == expected


@pytest.mark.parametrize(
    "text", ["train[", "tr ain", "[:5]", "test[a:b]", "", "test[5]", "test[1:2:3]", "test[:5]x", "9train", "test[ :5]"]
)
def test_parse_split_rejects_malformed_strings(text):
    with pytest.raises(ValueError) as error:
        parse_split(text)
    message = str(error.value)
    assert text in message
    assert "is not a split" in message


@pytest.mark.parametrize(
    ("text", "length", "expected"),
    [
        ("train", 60000, range(0, 60000)),
        ("train[:10%]", 60000, range(0, 6000)),
        ("train[10%:20%]", 60000, range(6000, 12000)),
        ("test[:8000]", 10000, range(0, 8000)),
        ("test[8000:]", 10000, range(8000, 10000)),
        ("test[-100:]", 10000, range(9900, 10000)),
        ("test[:-100]", 10000, range(0, 9900)),
        ("test[:-10%]", 10000, range(0, 9000)),
        ("test[-10%:]", 10000, range(9000, 10000)),
        ("test[:33%]", 10, range(0, 3)),  # percentages round down
        ("test[-33%:]", 10, range(7, 10)),
        ("test[:8000]", 5000, range(0, 5000)),  # a bound past the end is clamped
        ("test[8000:]", 5000, range(5000, 5000)),
        ("test[5:2]", 10, range(5, 2)),
    ],
)
def test_indices(text, length, expected):
    indices = parse_split(text).indices(length)
    assert list(indices) == list(expected)


def test_indices_of_percent_slices_count_items():
    indices = parse_split("train[:10%]").indices(60000)
    assert len(indices) == 6000
    rest = parse_split("test[8000:]").indices(10000)
    assert len(rest) == 2000 and rest[0] == 8000 and rest[-1] == 9999
