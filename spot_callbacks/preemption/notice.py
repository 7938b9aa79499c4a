"""A preemption notice: the machine is going away, from which source and by when; the exit code after it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM: "stopped to be resumed", as launchers expect


@dataclass(frozen=True)
class Notice:
    """The machine is going away: where the news came from and when it must be done (epoch seconds).

    Example:
        >>> notice = Notice("aws", deadline=1_000_120.0, detail="spot instance-action terminate")
        >>> notice.seconds_left(now=1_000_000.0), Notice("SIGTERM", None).seconds_left()
        (120.0, None)
    """

    source: str
    deadline: float | None
    detail: str = ""
    received_at: float = field(default_factory=time.time)

    def seconds_left(self, now: float | None = None) -> float | None:
        if self.deadline is None:
            return None
        return self.deadline - (time.time() if now is None else now)
