"""Eval metrics count every sample exactly once, on 1 process and on 2, padding or not, with no second sync."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

from runner.engine import Accelerator
from runner.metrics import build_metrics

NUM_CLASSES = 5
BATCH_SIZE = 8
# On 2 ranks a global batch is 16: 97 and 101 end on a batch padded to an even split, 100 on a short one.
SIZES = (97, 100, 101)


class SyncedSampleCount(Metric):
    """The same count as a torchmetrics Metric, whose state torchmetrics would sum over ranks in compute()."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("count", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.count += len(targets)

    def compute(self) -> torch.Tensor:
        return self.count


def accuracy_config() -> dict[str, dict[str, object]]:
    accuracy = {"_target_": "torchmetrics.classification.MulticlassAccuracy", "num_classes": NUM_CLASSES}
    return {"accuracy": {**accuracy, "average": "micro"}}


# Macro F1 (a mean of per-class ratios) and next-token perplexity (as conf/data/shakespeare_hf.yaml declares it,
# over [samples, positions, classes] logits): exact only if every sample is counted exactly once.
F1 = {"_target_": "torchmetrics.classification.MulticlassF1Score", "num_classes": NUM_CLASSES, "average": "macro"}
PERPLEXITY = {
    "_target_": "torchmetrics.wrappers.LambdaInputTransformer",
    "wrapped_metric": {"_target_": "torchmetrics.text.Perplexity"},
    "transform_pred": {"_target_": "runner.metrics.drop_last_position", "_partial_": True},
    "transform_target": {"_target_": "runner.metrics.drop_first_position", "_partial_": True},
}
POSITIONS = 3


def as_sequences(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample as a sequence of POSITIONS steps: the logits shifted by the position, the labels rolled."""
    steps = torch.arange(POSITIONS)
    return logits.unsqueeze(1) + steps[None, :, None], (labels.unsqueeze(1) + steps) % NUM_CLASSES


def eval_set(size: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(size)
    labels = torch.randint(0, NUM_CLASSES, (size,), generator=generator)
    logits = torch.randn(size, NUM_CLASSES, generator=generator) + torch.nn.functional.one_hot(labels, NUM_CLASSES)
    return TensorDataset(logits, labels)


def evaluate(accelerator: Accelerator, size: int) -> dict[str, float]:
    """The recipe's eval loop, with the inputs standing in for the model's outputs."""
    config = {
        **accuracy_config(),
        "f1": F1,
        "count": {"_target_": "tests.helpers.SampleCount"},
        "synced_count": {"_target_": f"{__name__}.SyncedSampleCount"},
    }
    metrics = build_metrics(config, device=accelerator.device)
    perplexity = build_metrics({"perplexity": PERPLEXITY}, device=accelerator.device)
    loader = accelerator.prepare(DataLoader(eval_set(size), batch_size=BATCH_SIZE))
    for logits, labels in loader:
        outputs, targets = accelerator.gather_for_metrics((logits, labels))
        metrics.update(outputs, targets)
        perplexity.update(*as_sequences(outputs, targets))
    return {**metrics.compute(), **perplexity.compute()}


def evaluate_every_size(accelerator: Accelerator) -> dict[int, dict[str, float]]:
    return {size: evaluate(accelerator, size) for size in SIZES}


def compute_local_batch(accelerator: Accelerator) -> dict[str, object]:
    """Each rank updates with a batch of its own; only torchmetrics left as it is combines them."""
    labels = torch.arange(4) % NUM_CLASSES
    predicted = labels if accelerator.process_index == 0 else (labels + 1) % NUM_CLASSES  # all right, all wrong
    logits = torch.nn.functional.one_hot(predicted, NUM_CLASSES).float()
    collection = {"_target_": "torchmetrics.MetricCollection", "metrics": accuracy_config()}
    ours = build_metrics({**accuracy_config(), "collection": collection})  # nested metrics are switched off too
    as_shipped = MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro")
    ours.update(logits, labels)
    as_shipped.update(logits, labels)
    return {"ours": ours.compute(), "as_shipped": float(as_shipped.compute())}


def on_each_rank() -> dict[str, object]:
    # One launch for every check: starting the workers costs seconds, the checks milliseconds.
    accelerator = Accelerator()
    return {"sizes": evaluate_every_size(accelerator), "local": compute_local_batch(accelerator)}


def accuracy_on_one_process(size: int) -> float:
    logits, labels = eval_set(size).tensors
    return float(MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro")(logits, labels))


def f1_and_perplexity_in_one_batch(size: int) -> tuple[float, float]:
    """Macro F1 and next-token perplexity over the whole set at once, by torch and torchmetrics alone."""
    logits, labels = eval_set(size).tensors
    f1 = MulticlassF1Score(num_classes=NUM_CLASSES, average="macro")(logits, labels)
    sequences, targets = as_sequences(logits, labels)
    loss = torch.nn.functional.cross_entropy(sequences[:, :-1].transpose(1, 2), targets[:, 1:])
    return float(f1), float(torch.exp(loss))


def check_every_sample_once(results: dict[int, dict[str, float]]) -> None:
    for size in SIZES:
        # A second sync would double the torchmetrics count but not the accuracy, a ratio of doubled counts.
        assert results[size]["eval/count"] == results[size]["eval/synced_count"] == size
        assert results[size]["eval/accuracy"] == accuracy_on_one_process(size)  # exact: counts, not averages
        f1, perplexity = f1_and_perplexity_in_one_batch(size)
        assert results[size]["eval/f1"] == f1  # per-class counts, summed over batches: exact
        assert results[size]["eval/perplexity"] == pytest.approx(perplexity, rel=1e-6)  # float sums in batches


def test_every_sample_counted_once_on_one_process():
    check_every_sample_once(evaluate_every_size(Accelerator()))


def test_every_sample_counted_once_on_two_processes_and_no_second_sync(launch):
    rank0, rank1 = launch(on_each_rank)
    check_every_sample_once(rank0["sizes"])
    check_every_sample_once(rank1["sizes"])
    # The group is there and torchmetrics as shipped syncs over it; ours keeps each rank's own state.
    assert rank0["local"]["as_shipped"] == rank1["local"]["as_shipped"] == 0.5
    assert rank0["local"]["ours"] == {"eval/accuracy": 1.0, "eval/collection/accuracy": 1.0}
    assert rank1["local"]["ours"] == {"eval/accuracy": 0.0, "eval/collection/accuracy": 0.0}
