"""The config's error and the single-field checks every section's ``__post_init__`` uses (pure, light)."""

from __future__ import annotations

import math


class ConfigError(ValueError):
    """A configuration problem, always naming the dotted key at fault and how to fix it."""


def require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def positive(value, key: str) -> None:
    if value is not None:
        require(value > 0 and math.isfinite(value), key, f"must be a finite number > 0, got {value!r}")


def non_negative(value, key: str) -> None:
    if value is not None:
        require(value >= 0 and math.isfinite(value), key, f"must be a finite number >= 0, got {value!r}")
