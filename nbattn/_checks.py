"""Argument checks shared by the planner, the simulator and the wrappers.

Each raises ``ValueError`` naming the argument and the rule, before anything
is computed; none converts a value it would have to round (``2.7`` is not a
count of CTAs).
"""
from __future__ import annotations

import numbers

import numpy as np

__all__ = ["int_arg", "count_arg"]


def int_arg(name: str, x, *, minimum: int | None = None) -> int:
    """``x`` as a Python int: an integer (or an integral NumPy scalar), not a
    bool, a float or a string; ``>= minimum`` when given."""
    if type(x) is not int:              # the common case skips the abstract-class checks
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Integral, np.integer)):
            raise ValueError(f"{name}: must be an integer, got {x!r} ({type(x).__name__})")
        x = int(x)
    if minimum is not None and x < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {x}")
    return x


def count_arg(name: str, x) -> int:
    """A positive count (``>= 1``)."""
    return int_arg(name, x, minimum=1)
