"""One split of a dataset whose constructor takes ``train: bool``, sliced like every split name here.

torchvision's datasets (``MNIST``, ``FashionMNIST``, ``KMNIST``, ``CIFAR10``, ``CIFAR100``, ...) choose their
split with a ``train`` flag, not a name; :class:`Split` gives them the names and slices that
``data.train_split`` and ``data.eval_split`` hold (``train``, ``test[:8000]``, ``train[:10%]``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import Subset

from runner.data.splits import SplitSpec, parse_split

TRAIN_FLAGS = {"train": True, "test": False}  # split name -> the dataset's ``train`` argument


class Split(Subset):
    """The items of one split of ``dataset``, optionally a slice of them.

    ``dataset`` is called once, with ``train=True`` for the ``train`` split and ``train=False`` for
    ``test``; the slice then keeps items by position. In YAML the inner node is ``_partial_``, so the
    dataset class and its arguments stay visible in the config::

        data:
          train:
            _target_: runner.data.Split
            split: test[:8000]
            dataset:
              _target_: torchvision.datasets.MNIST
              _partial_: true        # Split calls it with train=...
              root: data/mnist
              download: true

    Args:
        dataset: A callable taking ``train=`` and returning a map-style dataset (a class, or a
            ``functools.partial`` of one).
        split: ``train`` or ``test`` with an optional slice, e.g. ``test[:8000]`` or ``train[10%:]``.

    Raises:
        ValueError: The split is not ``train`` or ``test``, or its slice selects no item.
        TypeError: ``dataset`` is a dataset already built rather than a callable taking ``train=``.
    """

    def __init__(self, dataset: Callable[..., Any], split: str = "train") -> None:
        spec = _checked_spec(dataset, split)
        whole = dataset(train=TRAIN_FLAGS[spec.name])
        keep = spec.indices(len(whole))
        if len(keep) == 0:
            raise ValueError(
                f"Split {split!r} selects none of the {len(whole)} items of {_name(dataset)}'s {spec.name} split; "
                "widen the slice."
            )
        super().__init__(whole, keep)
        self.split = split

    @classmethod
    def prepare_data(cls, dataset: Callable[..., Any], split: str = "train") -> None:
        """Once, before the training processes start: build the split and drop it.

        A dataset that downloads in its constructor (torchvision's ``download=True``) so downloads once,
        not in every process at the same time, and a missing file or a slice that selects nothing is
        reported before anything is written.
        """
        cls(dataset=dataset, split=split)


def _checked_spec(dataset: Any, split: str) -> SplitSpec:
    if not callable(dataset):
        raise TypeError(
            f"dataset is a {type(dataset).__name__} already built, not a callable taking train=; add "
            "`_partial_: true` to its node."
        )
    spec = parse_split(split)
    if spec.name not in TRAIN_FLAGS:
        raise ValueError(
            f"{_name(dataset)} has no split {spec.name!r} ({split!r}); use 'train' or 'test' with an optional slice."
        )
    return spec


def _name(dataset: Any) -> str:
    """``MNIST`` for the class or a ``functools.partial`` of it."""
    factory = getattr(dataset, "func", dataset)
    return getattr(factory, "__name__", type(factory).__name__)
