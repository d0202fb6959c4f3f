"""The rule for ``runner.data.Mixture``'s weights, shared by the Mixture and the check before launch (which
imports no torch): numbers, at least 0, not all 0, finite, with a finite sum (the draws divide by it)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any


def weights_problem(weights: Sequence[Any]) -> str | None:
    """What is wrong with ``weights``, as the end of a sentence that names them; None if nothing is."""
    if not all(isinstance(weight, numbers.Real) and not isinstance(weight, bool) for weight in weights):
        return "must be numbers"
    try:
        values = [float(weight) for weight in weights]
    except OverflowError:  # an integer beyond any float
        values = [math.inf]
    if not all(value >= 0 for value in values) or not any(values):  # NaN is not >= 0
        return "must be non-negative numbers, not all 0"
    if not math.isfinite(sum(values)):
        return "must be finite, and so must their sum; scale them down (only their ratios matter)"
    return None
