"""Transfers in words a person reads: sizes, rates, the time left, and the line a slow resume pull logs."""

from __future__ import annotations

import logging

from spot_callbacks._format import human_rate, human_size
from spot_callbacks.store import CheckpointInfo

log = logging.getLogger("spot_callbacks")

# A pull shorter than this is not worth a line of its own (the resume line already gives its time).
SLOW_PULL_S = 3.0


def eta_s(done: int, total: int, seconds: float) -> float | None:
    """Seconds left at the average rate so far; None before the first byte.

    Example:
        >>> eta_s(100, 400, 2.0), eta_s(0, 400, 2.0)
        (6.0, None)
    """
    if done <= 0 or seconds <= 0:
        return None
    return max(0.0, (total - done) * seconds / done)


def slow_pull_line(info: CheckpointInfo, pull_s: float) -> str | None:
    """What a resume pull of at least :data:`SLOW_PULL_S` moved and how fast; None for a quick one."""
    if pull_s < SLOW_PULL_S:
        return None
    return (
        f"spot_callbacks: pulled {human_size(info.size_bytes)} of step {info.step} in {pull_s:.1f}s "
        f"({human_rate(info.size_bytes, pull_s)}) from {info.url}"
    )


def log_slow_pull(info: CheckpointInfo, pull_s: float) -> None:
    """Log :func:`slow_pull_line` when the resume pull was slow enough to explain the wait."""
    line = slow_pull_line(info, pull_s)
    if line is not None:
        log.info("%s", line)
