"""Argument checks shared by the public constructors."""

from __future__ import annotations

import numbers

__all__ = ["positive_int"]


def positive_int(name: str, value) -> int:
    """`value` as an int if it is a positive integer (Python or numpy, not bool); else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)
