"""The interruption schedules of the goodput replay: the fixed one and seeded Poisson ones per Spot Advisor band.

A schedule is a list with one entry per attempt (machine): the interruption that attempt gets, timed
from its spawn, or ``None``; attempts past the end of the list run to completion.

Time compression of the Poisson schedules: AWS Spot Advisor gives, per instance type, the share of
instances interrupted within a month (``<5 %`` ... ``>20 %``). A band's share ``p`` is a rate of
``-ln(1 - p)`` interruptions per month (a Poisson process that interrupts within a month with
probability ``p``); one month is compressed into ``month_s`` seconds of the replay.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

# Spot Advisor's bands, each as the share interrupted per month used for it (the band's middle; 25 % for >20 %).
BANDS: dict[str, float] = {"lt5": 0.025, "5-10": 0.075, "10-15": 0.125, "15-20": 0.175, "gt20": 0.25}
BAND_LABELS: dict[str, str] = {
    "lt5": "<5%",
    "5-10": "5-10%",
    "10-15": "10-15%",
    "15-20": "15-20%",
    "gt20": ">20%",
}
# The fixed schedule, seconds from each attempt's spawn: (notice?, when).
FIXED: tuple[tuple[bool, float], ...] = ((True, 35.0), (False, 55.0), (True, 70.0))


@dataclass(frozen=True)
class Interruption:
    """One attempt's interruption: at ``at_s`` after spawn SIGTERM (a notice, SIGKILL ``grace_s`` later) or SIGKILL."""

    at_s: float
    notice: bool
    grace_s: float

    def signals(self) -> list[tuple[float, str]]:
        """``(seconds after spawn, signal name)`` in the order they are sent."""
        if self.notice:
            return [(self.at_s, "SIGTERM"), (self.at_s + self.grace_s, "SIGKILL")]
        return [(self.at_s, "SIGKILL")]

    def describe(self) -> str:
        if self.notice:
            return f"SIGTERM@{self.at_s:.1f}s+{self.grace_s:g}s"
        return f"SIGKILL@{self.at_s:.1f}s"


Schedule = Sequence[Interruption | None]


def fixed_schedule(scale: float = 1.0, grace_s: float = 5.0) -> list[Interruption | None]:
    """SIGTERM at 35 s (SIGKILL at 40 s), a hard SIGKILL at 55 s, SIGTERM at 70 s (SIGKILL at 75 s); times × ``scale``."""
    return [Interruption(at * scale, notice, grace_s) for notice, at in FIXED]


def rate_per_s(band: str, month_s: float) -> float:
    """Interruptions per replay second for a Spot Advisor band, one month compressed into ``month_s`` s."""
    return -math.log1p(-BANDS[band]) / month_s


def poisson_schedule(
    band: str,
    month_s: float,
    seed: int,
    notice_share: float = 0.5,
    grace_s: float = 5.0,
    max_attempts: int = 20,
) -> list[Interruption | None]:
    """Seeded exponential times to interruption, one per attempt, at the band's compressed rate.

    Each interruption is a notice (SIGTERM, SIGKILL ``grace_s`` later) with probability
    ``notice_share``, else a hard SIGKILL. The same ``(band, month_s, seed)`` gives the same list,
    so every variant meets the same interruptions. Attempt ``max_attempts`` and later are not interrupted.
    """
    rng = random.Random(f"{seed}:{band}")
    rate = rate_per_s(band, month_s)
    return [
        Interruption(rng.expovariate(rate), rng.random() < notice_share, grace_s) for _ in range(max_attempts)
    ]


def interruption_for(schedule: Schedule, attempt: int) -> Interruption | None:
    """The interruption of attempt ``attempt`` (0-based), ``None`` past the schedule's end."""
    return schedule[attempt] if attempt < len(schedule) else None
