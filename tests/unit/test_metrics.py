"""runner.metrics in one process: building from a config, accumulating over batches, and its errors."""

import pytest
import torch
from omegaconf import OmegaConf
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score
from torchmetrics.regression import MeanAbsoluteError, MeanSquaredError

from runner.config import ConfigError
from runner.metrics import Metrics, build_metrics
from runner.training.components import BatchError
from tests.helpers import SampleCount

NUM_CLASSES = 5


class TargetStats:
    """A plain metric whose result is a dict."""

    def __init__(self) -> None:
        self.reset()

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.count += len(targets)
        self.total += float(targets.sum())

    def compute(self) -> dict[str, object]:
        return {"count": self.count, "mean": torch.tensor(self.total / self.count)}

    def reset(self) -> None:
        self.count, self.total = 0, 0.0


class UpdateOnly:
    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        pass


class Returns(UpdateOnly):
    def __init__(self, value: object) -> None:
        self.value = value

    def compute(self) -> object:
        return self.value

    def reset(self) -> None:
        pass


def node(cls: type, **kwargs: object) -> dict[str, object]:
    target = cls.__module__ + "." + cls.__qualname__
    return {"_target_": target, **kwargs}


def classification_batches(sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for size in sizes:
        labels = torch.randint(0, NUM_CLASSES, (size,), generator=generator)
        logits = torch.randn(size, NUM_CLASSES, generator=generator) + torch.nn.functional.one_hot(labels, NUM_CLASSES)
        batches.append((logits, labels))
    return batches


def regression_batches(sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(size, generator=generator), torch.randn(size, generator=generator)) for size in sizes]


def run(metrics: Metrics, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    for outputs, targets in batches:
        metrics.update(outputs, targets)
    return metrics.compute()


def on_all(metric, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    outputs, targets = (torch.cat(parts) for parts in zip(*batches, strict=True))
    return float(metric(outputs, targets))


def test_classification_metrics_over_batches_equal_torchmetrics_on_all_data():
    config = OmegaConf.create(
        {
            "accuracy": node(MulticlassAccuracy, num_classes=NUM_CLASSES, average="micro"),
            "f1": node(MulticlassF1Score, num_classes=NUM_CLASSES),
            "count": node(SampleCount),
        }
    )
    batches = classification_batches([8, 8, 8, 3])
    logs = run(build_metrics(config, device="cpu"), batches)
    assert list(logs) == ["eval/accuracy", "eval/f1", "eval/count"]
    assert all(type(value) is float for value in logs.values())
    assert logs["eval/accuracy"] == on_all(MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro"), batches)
    assert logs["eval/f1"] == pytest.approx(on_all(MulticlassF1Score(num_classes=NUM_CLASSES), batches), rel=1e-6)
    assert logs["eval/count"] == 27.0
    assert 0.2 < logs["eval/accuracy"] < 0.9  # neither chance nor trivial: the comparison means something


def test_regression_metrics_over_batches_equal_torchmetrics_on_all_data():
    config = OmegaConf.create({"mse": node(MeanSquaredError), "mae": node(MeanAbsoluteError)})
    batches = regression_batches([8, 8, 5])
    logs = run(build_metrics(config), batches)
    assert logs["eval/mse"] == pytest.approx(on_all(MeanSquaredError(), batches), rel=1e-6)
    assert logs["eval/mae"] == pytest.approx(on_all(MeanAbsoluteError(), batches), rel=1e-6)


def test_reset_forgets_earlier_evaluations():
    metrics = build_metrics({"mse": node(MeanSquaredError), "count": node(SampleCount)})
    first, second = regression_batches([8, 4])
    run(metrics, [first])
    metrics.reset()
    logs = run(metrics, [second])
    assert logs == {"eval/mse": pytest.approx(on_all(MeanSquaredError(), [second])), "eval/count": 4.0}


def test_dict_result_is_logged_per_key():
    metrics = build_metrics({"targets": node(TargetStats)})
    logs = run(metrics, [(torch.zeros(2), torch.tensor([1.0, 2.0])), (torch.zeros(1), torch.tensor([6.0]))])
    assert logs == {"eval/targets/count": 3.0, "eval/targets/mean": 3.0}


def test_empty_or_null_config_gives_no_metrics():
    for config in (None, {}, OmegaConf.create({"accuracy": None})):
        metrics = build_metrics(config)
        assert not metrics and len(metrics) == 0 and metrics.compute() == {}
    assert len(build_metrics({"count": node(SampleCount), "off": None})) == 1


def test_object_without_the_metric_methods_is_rejected():
    with pytest.raises(ConfigError) as error:
        build_metrics({"bad": node(UpdateOnly)})
    assert str(error.value) == (
        "metrics.bad (UpdateOnly) has no compute or reset; a metric needs "
        "update(outputs, targets), compute() and reset(), as torchmetrics' Metric classes have."
    )


@pytest.mark.parametrize(
    ("value", "returned"),
    [
        (torch.zeros(NUM_CLASSES), "a tensor of shape (5,)"),
        (torch.zeros(0), "a tensor of shape (0,)"),
        ("0.5", "a str"),
        ({"ok": 1.0, "per_class": torch.zeros(2, 3)}, "a tensor of shape (2, 3) under key 'per_class'"),
    ],
)
def test_result_that_is_not_one_number_is_rejected(value, returned):
    metrics = Metrics({"bad": Returns(value)})
    with pytest.raises(BatchError) as error:
        metrics.compute()
    assert str(error.value) == (
        f"metrics.bad returned {returned} from compute(); "
        "a metric must return a number, a one-element tensor or a dict of those."
    )


def test_per_class_torchmetrics_result_is_rejected():
    config = {"per_class": node(MulticlassAccuracy, num_classes=NUM_CLASSES, average=None)}
    metrics = build_metrics(OmegaConf.create(config))
    metrics.update(*classification_batches([8])[0])
    with pytest.raises(BatchError, match=r"^metrics\.per_class returned a tensor of shape \(5,\) from compute\(\);"):
        metrics.compute()


@pytest.mark.parametrize("name", ["", "train/accuracy"])
def test_invalid_name_is_rejected(name):
    with pytest.raises(ConfigError) as error:
        build_metrics({name: node(SampleCount)})
    assert str(error.value) == (
        f"metrics.{name!r} is not a valid metric name; "
        "use a non-empty string without '/' (it is logged as eval/<name>)."
    )


def test_node_without_target_is_rejected():
    with pytest.raises(ConfigError) as error:
        build_metrics(OmegaConf.create({"accuracy": {"num_classes": NUM_CLASSES}}))
    assert str(error.value) == (
        "metrics.accuracy has no _target_; give the class to build, "
        "e.g. `_target_: torchmetrics.classification.MulticlassAccuracy`."
    )


def test_the_next_token_loss_node_is_a_hugging_face_causal_lms_own_loss():
    from transformers import GPT2Config, GPT2LMHeadModel

    from runner.metrics import next_token_cross_entropy

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2))
    ids = torch.randint(32, (3, 8))
    labels = ids.clone()
    labels[0, 5:] = -100  # positions without a loss
    output = model(input_ids=ids, labels=labels)
    # From the model's output (its logits), or from the logits alone (a pipeline's last stage).
    assert next_token_cross_entropy(output, labels).item() == pytest.approx(output.loss.item(), abs=1e-6)
    assert torch.equal(next_token_cross_entropy(output.logits, labels), next_token_cross_entropy(output, labels))
