"""Checks of the arguments many calls take, each rule written once: a timeout, a seed.

A NaN timeout compares false with everything, so a wait bounded by it never ends; text or ``None``
fails deep inside the wait. A seed numpy refuses fails inside a half-built buffer. Both are
refused here, before anything is made or waited for, naming the argument and what it takes.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

__all__ = ["generator", "seeds", "timeout"]


def timeout(value: Any, what: str, *, positive: bool = False) -> float:
    """``value`` as a timeout in seconds: a finite real number ``>= 0`` (``> 0`` with ``positive``),
    never a bool, NaN, an infinity or text; ``ValueError`` naming ``what`` otherwise."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    seconds = float(value) if ok else math.nan
    if not (0 < seconds < math.inf if positive else 0 <= seconds < math.inf):
        raise ValueError(f"{what}: expected seconds, a finite number {'>' if positive else '>='} 0, got {value!r}; "
                         "pass the longest wait you accept, e.g. 60.0")
    return seconds


def seeds(seed: Any, what: str, expected: str = "an int >= 0 or None") -> np.random.SeedSequence:
    """The ``SeedSequence`` of ``seed`` (an int >= 0, a sequence of them, a ``SeedSequence``, or
    ``None`` for fresh entropy); ``ValueError`` naming ``what`` otherwise, chained to numpy's own."""
    if isinstance(seed, np.random.SeedSequence):
        return seed
    refused = f"{what}: expected {expected}, got {seed!r}; pass e.g. seed=0"
    if isinstance(seed, (bool, np.bool_)):  # numpy takes True for 1
        raise ValueError(refused)
    try:
        return np.random.SeedSequence(seed)
    except (TypeError, ValueError) as exc:
        raise ValueError(refused) from exc


def generator(seed: Any, what: str) -> np.random.Generator:
    """A ``numpy.random.Generator`` from ``seed``: a ``Generator`` as it is, else ``seeds(seed)``'s
    (the generator ``numpy.random.default_rng(seed)`` gives)."""
    if isinstance(seed, np.random.Generator):
        return seed
    return np.random.default_rng(seeds(seed, what, "an int >= 0, a numpy.random.Generator or None"))
