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
that record their state (a source without one is read past what was taken from it). A loaded state is checked
first (``check_state_dict``): one this mixture cannot reach is one sentence naming its field.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from typing import Any

from torch.utils.data import IterableDataset

from runner.data.mixture_weights import weights_problem
from runner.engine.loaders.dispatch import stateful
from runner.engine.loaders.stream_states import check_stream_state, is_count, known_length, shown, stream_state_error

EXHAUSTED = ("stop", "restart", "drop")
_STARTED_KEYS = ("epoch", "started", "rng", "active", "taken", "restarts", "sources")
_MT_WORDS = 624  # random.Random's Mersenne Twister: 624 words of 32 bits, then the index of the next one


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
        weights = [1.0] * len(datasets) if weights is None else list(weights)
        if len(weights) != len(datasets):
            raise ValueError(
                f"Mixture has {len(datasets)} datasets and {len(weights)} weights; give one weight per dataset."
            )
        problem = weights_problem(weights)
        if problem is not None:
            shown_weights = [float(w) if type(w) is int and abs(w) < 2**1023 else w for w in weights]
            raise ValueError(f"Mixture's weights={shown_weights} {problem}.")
        weights = [float(w) for w in weights]
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
        """Continue from ``state`` on the next pass; a CheckpointError for one it cannot have (``check_state_dict``)."""
        self.check_state_dict(state)
        self.epoch = state["epoch"]
        self._loaded = state if state.get("started") else None

    def check_state_dict(self, state: Any, *, field: str = "state") -> None:
        """Raise CheckpointError, one sentence naming ``field``'s key, unless this mixture can reach ``state``.

        Its draws' generator is a Mersenne Twister's state, the sources left are some of this mixture's (all of
        them unless ``exhausted`` drops), each source's count of samples taken is at most its length (where it has
        one), only restarted sources count restarts, and each source's state is checked by the source
        (:func:`~runner.engine.loaders.stream_states.check_stream_state`).
        """
        keys = _STARTED_KEYS if isinstance(state, dict) and state.get("started") is True else _STARTED_KEYS[:2]
        if not isinstance(state, dict) or not isinstance(state.get("started"), bool) or set(state) != set(keys):
            raise stream_state_error(field, f"{shown(state)} is not Mixture's state ({', '.join(keys)})")
        if not is_count(state["epoch"]):
            raise stream_state_error(f"{field}.epoch", f"{shown(state['epoch'])} is not an epoch")
        if not state["started"]:
            return
        _check_generator(state["rng"], field=f"{field}.rng")
        self._check_active(state["active"], field=f"{field}.active")
        for key in ("taken", "restarts", "sources"):
            if not isinstance(state[key], list) or len(state[key]) != len(self.datasets):
                raise stream_state_error(
                    f"{field}.{key}",
                    f"{shown(state[key])} is not a list of one entry for each of the {len(self.datasets)} sources",
                )
        for index, dataset in enumerate(self.datasets):
            self._check_source(index, dataset, state, field=field)

    def _check_active(self, active: Any, *, field: str) -> None:
        count = len(self.datasets)
        if not (isinstance(active, list) and all(type(i) is int for i in active)) or active != sorted(set(active)):
            raise stream_state_error(field, f"{shown(active)} is not a list of sources in order")
        if active and not 0 <= active[0] <= active[-1] < count:
            raise stream_state_error(field, f"{shown(active)} names a source this mixture of {count} lacks")
        if self.exhausted != "drop" and len(active) != count:
            raise stream_state_error(
                field, f"{shown(active)} leaves sources out, which exhausted={self.exhausted!r} never does"
            )

    def _check_source(self, index: int, dataset: Any, state: dict[str, Any], *, field: str) -> None:
        taken, restarts, saved = state["taken"][index], state["restarts"][index], state["sources"][index]
        if not is_count(taken):
            raise stream_state_error(f"{field}.taken[{index}]", f"{shown(taken)} is not a count of samples")
        length = known_length(dataset)
        if length is not None and taken > length:
            raise stream_state_error(
                f"{field}.taken[{index}]", f"{taken} samples taken, but source {index} holds {length}"
            )
        if not is_count(restarts):
            raise stream_state_error(f"{field}.restarts[{index}]", f"{shown(restarts)} is not a count of restarts")
        if restarts and self.exhausted != "restart":
            raise stream_state_error(
                f"{field}.restarts[{index}]", f"{restarts}, where exhausted={self.exhausted!r} restarts no source"
            )
        if saved is not None and not stateful(dataset):
            raise stream_state_error(
                f"{field}.sources[{index}]",
                f"{shown(saved)}, but source {index} ({type(dataset).__name__}) has no state",
            )
        if saved is not None:
            check_stream_state(dataset, saved, field=f"{field}.sources[{index}]")

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


def _check_generator(saved: Any, *, field: str) -> None:
    """``saved`` is a ``random.Random`` state as JSON keeps it: ``[3, [624 words, index], gauss or null]``."""
    fits = (
        isinstance(saved, list)
        and len(saved) == 3
        and saved[0] == 3
        and type(saved[0]) is int
        and isinstance(saved[1], list)
        and len(saved[1]) == _MT_WORDS + 1
        and all(type(word) is int and 0 <= word < 2**32 for word in saved[1][:_MT_WORDS])
        and type(saved[1][-1]) is int
        and 0 <= saved[1][-1] <= _MT_WORDS
        and (saved[2] is None or type(saved[2]) is float)
        and any(saved[1][:_MT_WORDS])
    )
    if not fits:
        raise stream_state_error(field, f"{shown(saved)} is not the state of the mixture's random draws")
