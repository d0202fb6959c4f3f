"""Each pass's order drawn as an unprepared DataLoader draws it (:class:`PlainShuffle`), and what a position records
of it so a resumed pass draws the same.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import RandomSampler


def int64_draw(generator: torch.Generator | None) -> int:
    """The draw a DataLoader makes as each pass begins (its workers' base seed), and RandomSampler for its seed."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def _encoded(generator: torch.Generator) -> str:
    return base64.b64encode(generator.get_state().numpy().tobytes()).decode("ascii")


def _decoded(state: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(state, validate=True)), dtype=torch.uint8)


class PlainShuffle:
    """Each pass's order drawn as an unprepared DataLoader draws it: from the same generators, in the same order.

    As a pass begins, a DataLoader draws its workers' base seed from its ``generator`` (torch's global
    generator without one), then its sampler shuffles: from the sampler's own ``generator`` (which
    ``DataLoader(shuffle=True, generator=g)`` shares), or, without one, a ``RandomSampler`` from a
    new generator seeded by one more draw of the global generator, and other samplers
    (``SubsetRandomSampler``, ``WeightedRandomSampler``) from the global generator itself. A prepared
    loader makes the same draws, so on one process it yields the plain loader's batches and a ported
    loop keeps its numbers for a given seed. With several processes, rank 0's generators (or seed)
    are everyone's as each pass begins. (Loader workers still load each batch with its own seed, see
    :class:`SeededBatch`.)

    For an exact resume, a position records what the current pass drew from: the generators' states
    as it began and, without a sampler generator, the seed it drew (or the global generator's state
    the sampler drew from). A pass resumed from that position draws from them again, never twice from
    the global generator, which the checkpoint restores to the moment of saving. Between passes, the
    position records the generators as they are.

    Args:
        target: What shuffles: a sampler (or a user's batch sampler) with a ``generator`` attribute,
            which each pass draws from or, when None, sets to that pass's new generator.
        loader_generator: The user's loader's ``generator`` (None: the global generator).
        share: Rank 0's value on every rank (a collective when distributed).
        global_draws: Whether a ``target`` without a generator draws from the global generator, as it
            does in a plain loader (one process, a sampler other than ``RandomSampler``); otherwise each
            pass gives it a generator seeded by one draw, rank 0's.
        persistent: ``target``'s generator was given to it by ``prepare`` for every pass (several processes).

    A position saved by one process continues on several and the other way round: the resumed run takes
    the saved run's way of drawing (a generator for every pass, or a new one each pass).
    """

    def __init__(
        self,
        target: Any,
        loader_generator: torch.Generator | None,
        share: Callable[[Any], Any],
        *,
        global_draws: bool = False,
        persistent: bool = False,
    ) -> None:
        self.target = target
        self.generator: torch.Generator | None = target.generator
        self.loader_generator = loader_generator
        self.share = share
        self.global_draws = global_draws and self.generator is None and not isinstance(target, RandomSampler)
        self.persistent = persistent
        self._current: dict[str, Any] | None = None  # what the pass in progress drew from
        self._loaded: dict[str, Any] | None = None  # a loaded mid-pass record, for the next pass to draw from

    def _generators(self) -> list[torch.Generator]:
        generators = [self.generator]
        if self.loader_generator is not self.generator:
            generators.append(self.loader_generator)
        return [generator for generator in generators if generator is not None]

    def begin_pass(self) -> None:
        """Make this pass's draws; every rank calls it as the pass begins."""
        generators = self._generators()
        resumed, self._loaded = self._loaded, None
        if resumed is not None:
            record = dict(resumed)  # the generators were set to it when it was loaded
        else:
            states = self.share([generator.get_state() for generator in generators])
            for generator, state in zip(generators, states, strict=True):
                generator.set_state(state)
            record = {"generators": [_encoded(generator) for generator in generators], "draw_seed": None}
        if self.loader_generator is not None or resumed is None:
            int64_draw(self.loader_generator)  # the workers' base seed; the prepared loader seeds its own
        if resumed is not None and "global_state" in record:
            # The pass drew from the global generator: now from a copy of it as the pass began, since the
            # checkpoint restored the global generator to after these draws.
            self.target.generator = torch.Generator()
            self.target.generator.set_state(_decoded(record["global_state"]))
        elif resumed is None and self.global_draws:  # the sampler draws from the global generator, from here on
            record["global_state"] = _encoded(torch.default_generator)
            self.target.generator = None
        elif self.generator is None:
            if resumed is None:
                record["draw_seed"] = self.share(int64_draw(None))
            self.target.generator = torch.Generator().manual_seed(record["draw_seed"])
        self._current = record

    def end_pass(self) -> None:
        self._current = None

    def state(self, *, between_passes: bool = False) -> dict[str, Any]:
        """What the pass in progress (or loaded, pending) drew from, or the generators as they are before any.

        A begun pass's record has a ``draw_seed`` (None when the sampler has its own generator). A pass
        that has handed out its last batch (``between_passes``) is recorded as begun, with ``replay``:
        its sampler may still draw when asked for the end (RandomSampler does), so loading replays the
        whole pass's draws rather than trusting the generators' state of the moment. ``persistent`` marks
        a sampler generator that ``prepare`` gave (see the class).
        """
        if self._loaded is not None:
            state = dict(self._loaded)
        elif self._current is not None:
            state = {**self._current, "replay": True} if between_passes else dict(self._current)
        else:
            state = {"generators": [_encoded(generator) for generator in self._generators()]}
        if self.persistent:
            state["persistent"] = True
        return state

    def load(self, state: dict[str, Any]) -> None:
        """Set the generators to a :meth:`state`; the record of a begun pass is what the next pass draws from again.

        Raises:
            ValueError: The state records other generators than this loader has, or a damaged one.
        """
        generators = self._generators()
        saved = state.get("generators")
        adopts = state.get("persistent") is True and self.generator is None
        if adopts and isinstance(saved, list) and len(saved) == len(generators) + 1:
            self.generator = self.target.generator = torch.Generator()  # saved by several processes: theirs
            self.global_draws, self.persistent = False, True
        elif (
            self.persistent
            and "persistent" not in state
            and isinstance(saved, list)
            and len(saved) == len(generators) - 1
        ):
            self.generator = self.target.generator = None  # saved by one process: a new generator each pass
            self.persistent = False
        generators = self._generators()
        if not isinstance(saved, list) or len(saved) != len(generators):
            found = len(saved) if isinstance(saved, list) else "no"
            raise ValueError(
                f"This loader shuffles from {len(generators)} generator(s) but its saved position records {found} "
                "generator states: the run was saved with another sampler, generator or use_seedable_sampler "
                "setting; prepare the DataLoader as the saved run did."
            )
        begun = "draw_seed" in state
        drew_own = state.get("draw_seed") is None and "global_state" not in state
        kind_known = type(state.get("draw_seed")) is int or type(state.get("global_state")) is str or drew_own
        if begun and (not kind_known or drew_own != (self.generator is not None)):
            raise ValueError(
                "This loader's saved position was drawn by a sampler that shuffles from other generators than this "
                "one (its own, a new one each pass, or torch's global one); prepare the DataLoader as the saved run "
                "did."
            )
        try:
            for generator, encoded in zip(generators, saved, strict=True):
                generator.set_state(_decoded(encoded))
            if "global_state" in state:  # checked now, used as the resumed pass begins
                torch.Generator().set_state(_decoded(state["global_state"]))
        except (TypeError, ValueError, RuntimeError, binascii.Error) as error:
            raise ValueError(f"This loader's saved generator state is damaged ({error}).") from None
        self._current = self._loaded = None
        if begun and state.get("replay"):
            self._replay_pass()
        elif begun:
            self._loaded = {"generators": list(saved), "draw_seed": state["draw_seed"]}
            if "global_state" in state:
                self._loaded["global_state"] = state["global_state"]

    def _replay_pass(self) -> None:
        """Draw what a whole pass draws from the generators (just set to its start), leaving them as after it."""
        if self.loader_generator is not None:
            int64_draw(self.loader_generator)
        if self.generator is not None:  # without one, the pass's own generator is done with
            for _ in self.target:
                pass
