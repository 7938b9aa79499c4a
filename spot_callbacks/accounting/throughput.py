"""Transfers in words a person reads: sizes, rates, the time left, and the line a slow resume pull logs."""

from __future__ import annotations

import logging
import math

from spot_callbacks.accounting.report import human_size
from spot_callbacks.store import CheckpointInfo

log = logging.getLogger("spot_callbacks")

# A pull shorter than this is not worth a line of its own (the resume line already gives its time).
SLOW_PULL_S = 3.0


def human_rate(nbytes: int, seconds: float) -> str:
    """Bytes per second in decimal units; ``"-"`` before any time has passed.

    Example:
        >>> human_rate(300_000_000, 4.0), human_rate(10, 0.0)
        ('75.0 MB/s', '-')
    """
    if seconds <= 0:
        return "-"
    return f"{human_size(round(nbytes / seconds))}/s"


def human_duration(seconds: float | None) -> str:
    """``"42s"``, ``"3m07s"``, ``"1h02m"``; ``"?"`` when unknown.

    Example:
        >>> human_duration(42.4), human_duration(187), human_duration(3720), human_duration(None)
        ('42s', '3m07s', '1h02m', '?')
    """
    if seconds is None or not math.isfinite(seconds):
        return "?"
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


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
