"""Durations in words for logs and reasons: a measured 18.8644 s reads as 18.9 s."""

from __future__ import annotations


def seconds(value: float) -> str:
    """Tenths of a second below 100 s, whole seconds above: "0.5 s", "18.9 s", "240 s"."""
    text = f"{round(value, 1):g}" if value < 100 else str(round(value))
    return f"{text} s"
