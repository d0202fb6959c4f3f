"""``runner.data.Mixture``: several datasets read as one stream, each sample drawn from a source chosen by weight.

    data:
      train:
        _target_: runner.data.Mixture
        datasets: [{_target_: ...}, {_target_: ...}, {_target_: ...}]   # any datasets, streams or map-style
        weights: [0.7, 0.2, 0.1]      # relative; null: equal
        seed: ${seed}
        exhausted: restart            # a source that runs out: stop (the mixture ends), restart it, or drop it

The choice of source is a seeded draw (per epoch: ``set_epoch``), so the order is deterministic. The mixture
records its position (``state_dict``): the draws' generator, each source's state (its own ``state_dict`` when it
has one, else how many of its samples were taken) and which sources are left; a prepared loader saves it with
every checkpoint and the resumed mixture continues from it exactly, reading nothing twice from the sources
that record their state (a source without one is read past what was taken from it).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from typing import Any

from torch.utils.data import IterableDataset

from runner.engine.data.dispatch import stateful

EXHAUSTED = ("stop", "restart", "drop")


class Mixture(IterableDataset):
    """Samples of ``datasets``, each drawn from a source chosen with probability proportional to ``weights``.

    Args:
        datasets: The sources: iterable datasets or map-style ones (read in order), each non-empty.
        weights: One non-negative number per source, not all 0; None: equal weights.
        seed: Seeds the draws, with the epoch.
        exhausted: When a source runs out: ``stop`` ends the mixture (its epoch), ``restart`` begins that
            source again (its next pass: ``set_epoch`` with its restart count, where it has one), ``drop``
            leaves it out and draws among the rest, ending when none is left.

    Raises:
        ValueError: One sentence for weights or a rule that cannot be used.
    """

    def __init__(
        self,
        datasets: Sequence[Any],
        weights: Sequence[float] | None = None,
        seed: int = 0,
        exhausted: str = "stop",
    ) -> None:
        datasets = list(datasets)
        if not datasets:
            raise ValueError("Mixture needs at least one dataset in datasets.")
        weights = [1.0] * len(datasets) if weights is None else [float(w) for w in weights]
        if len(weights) != len(datasets):
            raise ValueError(
                f"Mixture has {len(datasets)} datasets and {len(weights)} weights; give one weight per dataset."
            )
        if any(w < 0 or w != w for w in weights) or not sum(weights) > 0:
            raise ValueError(f"Mixture's weights={weights} must be non-negative numbers, not all 0.")
        if exhausted not in EXHAUSTED:
            raise ValueError(f"Mixture's exhausted={exhausted!r} is not a rule; use one of {', '.join(EXHAUSTED)}.")
        self.datasets, self.weights, self.seed, self.exhausted = datasets, weights, int(seed), exhausted
        self.epoch = 0
        self._loaded: dict[str, Any] | None = None  # the next pass continues from this state
        self._live: dict[str, Any] | None = None  # the current pass's position (what state_dict reports)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    # ------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Where the mixture is: JSON, as a checkpoint's manifest records it."""
        if self._loaded is not None:  # loaded, not iterated yet: the position is the pending one
            return self._loaded
        if self._live is None:
            return {"epoch": self.epoch, "started": False}
        live = self._live
        version, internal, gauss = live["rng"].getstate()
        sources = [
            dataset.state_dict() if stateful(dataset) else None
            for dataset in self.datasets  # each stops right after the sample it handed out last
        ]
        return {
            "epoch": live["epoch"],
            "started": True,
            "rng": [version, list(internal), gauss],
            "active": list(live["active"]),
            "taken": list(live["taken"]),
            "restarts": list(live["restarts"]),
            "sources": sources,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` on the next pass."""
        self.epoch = state["epoch"]
        self._loaded = state if state.get("started") else None

    # ------------------------------------------------------------------------------------------- stream
    def __iter__(self) -> Iterator[Any]:
        state, self._loaded = self._loaded, None
        count = len(self.datasets)
        if state is None:
            live = {
                "epoch": self.epoch,
                "rng": random.Random(self.seed * 1_000_003 + self.epoch),
                "active": list(range(count)),
                "taken": [0] * count,  # samples of the source's current pass
                "restarts": [0] * count,
            }
        else:
            rng = random.Random()
            version, internal, gauss = state["rng"]
            rng.setstate((version, tuple(internal), gauss))
            live = {"epoch": state["epoch"], "rng": rng, "active": list(state["active"]),
                    "taken": list(state["taken"]), "restarts": list(state["restarts"])}  # fmt: skip
        self._live = live
        streams = [self._source(i, live, state) for i in range(count)]
        rng, active, taken = live["rng"], live["active"], live["taken"]
        while active:
            source = rng.choices(active, weights=[self.weights[i] for i in active])[0]
            sample = next(streams[source], _END)
            if sample is _END:
                if self.exhausted == "stop":
                    return
                if self.exhausted == "drop":
                    active.remove(source)
                    continue
                live["restarts"][source] += 1
                taken[source] = 0
                streams[source] = self._source(source, live, None)
                sample = next(streams[source], _END)
                if sample is _END:
                    raise ValueError(f"Mixture's dataset {source} ({type(self.datasets[source]).__name__}) is empty.")
            taken[source] += 1
            yield sample

    def _source(self, index: int, live: dict[str, Any], state: dict[str, Any] | None) -> Iterator[Any]:
        """Source ``index``'s stream: from its saved state or position, else its pass from the start."""
        dataset = self.datasets[index]
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(self.epoch + live["restarts"][index])
        if state is not None and stateful(dataset) and state["sources"][index] is not None:
            dataset.load_state_dict(state["sources"][index])
            return iter(dataset)
        skip = state["taken"][index] if state is not None else 0
        if not isinstance(dataset, IterableDataset) and hasattr(dataset, "__len__"):  # map-style: in index order
            return map(dataset.__getitem__, range(skip, len(dataset)))
        return itertools.islice(iter(dataset), skip, None)  # read past what was taken (a stream without state)


_END = object()
