"""The evaluation metrics a config declares, computed over every eval sample exactly once across processes.

    metrics:
      accuracy: {_target_: torchmetrics.classification.MulticlassAccuracy, num_classes: 10}

The recipe's eval loop gathers first and updates second::

    metrics = build_metrics(config.metrics, device=accelerator.device)
    for inputs, targets in eval_loader:
        outputs, targets = accelerator.gather_for_metrics((model(inputs), targets))
        metrics.update(outputs, targets)
    logs = metrics.compute()  # {"eval/accuracy": 0.93}
    metrics.reset()

``gather_for_metrics`` drops the duplicates that padded the last batch and hands every rank all the
samples, so each rank's metric state already covers the whole eval set once. There must be no second
sync: torchmetrics' own one, in ``compute()``, would all-gather those full states again and count every
sample world-size times. ``Metrics`` therefore switches it off on every torchmetrics ``Metric`` it holds
(nested ones too, as in a ``MetricCollection``) by making the question torchmetrics asks before any sync,
``distributed_available_fn()``, answer "not distributed". ``Metric.sync`` asks it, and every sync goes
through there: the one in ``compute()``, ``forward`` with ``dist_sync_on_step``, a manual ``sync()``, and
the metrics that override ``_sync_dist`` (mean average precision); so it has been since torchmetrics 0.11.
The flags cover only some of those paths: ``sync_on_compute`` is copied into the private ``_to_sync`` at
construction (and back after every ``forward``), and ``dist_sync_on_step`` only governs ``forward``.

Any object with ``update(outputs, targets)``, ``compute()`` and ``reset()`` is a metric too; its
result must be a number, a one-element tensor, or a dict of those, and is logged as plain floats.

A causal language model's logits at position t predict the token at t + 1, and a Hugging Face model
takes unshifted labels (it shifts inside its loss). :func:`drop_last_position` and
:func:`drop_first_position` line the two up for a metric, as ``transform_pred`` and
``transform_target`` of torchmetrics' ``LambdaInputTransformer`` (``conf/data/shakespeare_hf.yaml``)::

    metrics:
      perplexity:
        _target_: torchmetrics.wrappers.LambdaInputTransformer
        wrapped_metric: {_target_: torchmetrics.text.Perplexity, ignore_index: -100}
        transform_pred: {_target_: runner.metrics.drop_last_position, _partial_: true}
        transform_target: {_target_: runner.metrics.drop_first_position, _partial_: true}
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from runner.config import ConfigError
from runner.training.components import BatchError, build, predictions

PREFIX = "eval"
REQUIRED_METHODS = ("update", "compute", "reset")


class Metrics:
    """Named eval metrics, updated on gathered outputs and targets; ``compute()`` returns ``{"eval/<name>": float}``.

    Args:
        metrics: name -> metric object (a torchmetrics ``Metric`` or anything with ``update(outputs,
            targets)``, ``compute()`` and ``reset()``), in the order they are logged.

    Raises:
        ConfigError: a name is empty or contains '/', or an object lacks one of update, compute, reset.

    Example::

        metrics = Metrics({"accuracy": MulticlassAccuracy(num_classes=10)})
        metrics.update(outputs, targets)  # gathered from every rank
        metrics.compute()  # {"eval/accuracy": 0.93}
    """

    def __init__(self, metrics: Mapping[str, Any]) -> None:
        for name, metric in metrics.items():
            _check_name(name)
            _check_protocol(name, metric)
            _disable_own_sync(metric)
        self._metrics = dict(metrics)

    def update(self, outputs: Any, targets: Any) -> None:
        """Update every metric with one gathered batch."""
        for metric in self._metrics.values():
            metric.update(outputs, targets)

    def compute(self) -> dict[str, float]:
        """``{"eval/<name>": value}`` per metric, in order; a dict result gives ``"eval/<name>/<key>"``.

        Raises:
            BatchError: a metric returned something other than a number, a one-element tensor or a dict of those.
        """
        logs: dict[str, float] = {}
        for name, metric in self._metrics.items():
            logs.update(_to_logs(name, metric.compute()))
        return logs

    def reset(self) -> None:
        """Forget every update, ready for the next evaluation."""
        for metric in self._metrics.values():
            metric.reset()

    def to(self, device: torch.device | str) -> Metrics:
        """Move the metrics that are modules (torchmetrics' are) to ``device``, where the gathered tensors are."""
        for metric in self._metrics.values():
            if isinstance(metric, torch.nn.Module):
                metric.to(device)
        return self

    def __getitem__(self, name: str) -> Any:
        return self._metrics[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._metrics)

    def __len__(self) -> int:
        return len(self._metrics)

    def __bool__(self) -> bool:
        return bool(self._metrics)

    def __repr__(self) -> str:
        return f"Metrics({', '.join(f'{name}={type(m).__name__}' for name, m in self._metrics.items())})"


def build_metrics(config: Mapping[str, Any] | None, *, device: torch.device | str | None = None) -> Metrics:
    """Instantiate each ``_target_`` node of ``config`` (name -> node), with torchmetrics' own sync off.

    Args:
        config: the ``metrics`` config group (a DictConfig or mapping), or None/empty for no metrics.
            A null node (``metrics.accuracy=null`` on the command line) switches that metric off.
        device: where to move the metrics; the device the gathered outputs live on.

    Returns:
        The metrics, in the order of ``config``.

    Raises:
        ConfigError: a name is invalid, a node has no ``_target_``, its class rejects its arguments, or the
            built object is not a metric.

    Example::

        metrics = build_metrics(cfg.metrics, device=accelerator.device)
    """
    metrics = {}
    for name, node in (config or {}).items():
        _check_name(name)
        if node is None:
            continue
        if not isinstance(node, Mapping) or "_target_" not in node:
            raise ConfigError(
                f"metrics.{name} has no _target_; give the class to build, "
                "e.g. `_target_: torchmetrics.classification.MulticlassAccuracy`."
            )
        # Plain lists and dicts: torchmetrics checks arguments such as `thresholds` with isinstance(list).
        metrics[name] = build(node, key=f"metrics.{name}", _convert_="all")
    built = Metrics(metrics)
    return built if device is None else built.to(device)


def _check_name(name: Any) -> None:
    """Raise ConfigError unless ``name`` can be a logged key ``eval/<name>``."""
    if not isinstance(name, str) or not name or "/" in name:
        raise ConfigError(
            f"metrics.{name!r} is not a valid metric name; use a non-empty string without '/' "
            f"(it is logged as {PREFIX}/<name>)."
        )


def _check_protocol(name: str, metric: Any) -> None:
    missing = [method for method in REQUIRED_METHODS if not callable(getattr(metric, method, None))]
    if missing:
        raise ConfigError(
            f"metrics.{name} ({type(metric).__name__}) has no {' or '.join(missing)}; a metric needs "
            "update(outputs, targets), compute() and reset(), as torchmetrics' Metric classes have."
        )


def next_token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """A causal language model's loss from its logits and unshifted labels, as a Hugging Face model computes its own
    (``loss: model``): the logits at t scored against the label at t + 1, ``ignore_index`` left out, the mean over
    the rest, in fp32. A loss node (``loss: {_target_: runner.metrics.next_token_cross_entropy, _partial_: true}``)
    where the model's own loss cannot run: under pipeline parallelism, whose last stage has only the logits."""
    logits = predictions(logits)  # a tensor (a last stage's output), or a model output with logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=ignore_index
    )


def drop_last_position(logits: torch.Tensor) -> torch.Tensor:
    """``logits[:, :-1]``: the predictions of positions 0..T-2, each scored against the next token.

    Module-level (not a lambda) so that the metric holding it pickles.
    """
    return logits[:, :-1]


def drop_first_position(labels: torch.Tensor) -> torch.Tensor:
    """``labels[:, 1:]``: the tokens of positions 1..T-1, the ones :func:`drop_last_position`'s logits predict."""
    return labels[:, 1:]


def _never_distributed() -> bool:
    # A module-level function, not a lambda: torchmetrics metrics pickle their attributes.
    return False


def _disable_own_sync(metric: Any) -> None:
    # No torchmetrics object can exist unless its package was imported: a config of plain metrics
    # does not pay for importing it.
    torchmetrics = sys.modules.get("torchmetrics")
    if torchmetrics is None or not isinstance(metric, torch.nn.Module):
        return
    for module in metric.modules():  # the metric itself, and those inside collections and wrappers
        if isinstance(module, torchmetrics.Metric):
            module.distributed_available_fn = _never_distributed


def _to_logs(name: str, value: Any) -> dict[str, float]:
    if isinstance(value, Mapping):
        return {f"{PREFIX}/{name}/{key}": _to_float(name, item, key=key) for key, item in value.items()}
    return {f"{PREFIX}/{name}": _to_float(name, value)}


def _to_float(name: str, value: Any, *, key: Any = None) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, numbers.Real):
        return float(value)
    is_tensor = isinstance(value, torch.Tensor)
    returned = f"a tensor of shape {tuple(value.shape)}" if is_tensor else f"a {type(value).__name__}"
    where = "" if key is None else f" under key {key!r}"
    raise BatchError(
        f"metrics.{name} returned {returned}{where} from compute(); "
        "a metric must return a number, a one-element tensor or a dict of those."
    )
