"""What happens on a preemption notice once every rank agreed on it: the deadline, in one place.

The emergency checkpoint must commit before the notice's deadline, less :data:`EXIT_MARGIN_S`
for the process to exit. :class:`Emergency` keeps the agreed notice, gives each checkpoint job
its deadline and the ``preemption`` record of its manifest, waits for the commit (the newest
checkpoint goes ahead of older uploads) and says how it went, once.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone
from typing import Any, Protocol

from spot_callbacks.notices import Notice, PreemptionWatcher

log = logging.getLogger("spot_callbacks")

# Time kept back from a preemption deadline for the process to exit after the commit.
EXIT_MARGIN_S = 2.0


class Waitable(Protocol):
    """The part of a persister an emergency waits on."""

    def expedite(self, step: int, deadline: float) -> None: ...
    def wait_for_step(self, step: int, timeout: float | None = None) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...


def time_left_s(notice: Notice | None, timeout: float | None = None) -> float | None:
    """The wait allowed before the notice's deadline (less the exit margin), capped by ``timeout``; never negative.

    Example:
        >>> time_left_s(None, 5.0), time_left_s(Notice("SIGTERM", None), None)
        (5.0, None)
        >>> 0 < time_left_s(Notice("aws", time.time() + 30)) <= 28.0
        True
    """
    if notice is not None and notice.deadline is not None:
        left = notice.seconds_left() - EXIT_MARGIN_S
        timeout = left if timeout is None else min(timeout, left)
    return None if timeout is None else max(timeout, 0.0)


class Emergency:
    """The run's agreed preemption notice, and the deadline every emergency checkpoint job carries.

    Example:
        >>> watcher = PreemptionWatcher([])
        >>> emergency = Emergency(watcher)
        >>> notice = Notice("aws", time.time() + 120, "spot instance-action terminate")
        >>> watcher.report(notice); emergency.agree(notice)
        >>> emergency.deadline("preemption") == notice.deadline - EXIT_MARGIN_S, emergency.deadline("interval")
        (True, None)
        >>> sorted(emergency.manifest_extra("preemption")["preemption"])
        ['deadline', 'detail', 'received', 'source']
    """

    def __init__(self, watcher: PreemptionWatcher) -> None:
        self.watcher = watcher
        self.agreed: Notice | None = None  # the notice every rank agreed on
        self.committed_step: int | None = None  # its checkpoint's step, once committed

    def agree(self, notice: Notice) -> None:
        self.agreed = notice

    def active_notice(self) -> Notice | None:
        if self.watcher.notice is None:  # cleared: training went on after the emergency
            return None
        return self.agreed or self.watcher.notice

    def _notice_for(self, reason: str) -> Notice | None:
        return self.active_notice() if reason == "preemption" else None

    def deadline(self, reason: str) -> float | None:
        """When a checkpoint of this ``reason`` must be committed (epoch seconds), or None."""
        notice = self._notice_for(reason)
        if notice is None or notice.deadline is None:
            return None
        return notice.deadline - EXIT_MARGIN_S

    def manifest_extra(self, reason: str) -> dict[str, Any]:
        """The ``preemption`` record of an emergency checkpoint's manifest (empty for other reasons)."""
        notice = self._notice_for(reason)
        if notice is None:
            return {}
        return {
            "preemption": {
                "source": notice.source,
                "detail": notice.detail,
                "received": _utc(notice.received_at),
                "deadline": _utc(notice.deadline) if notice.deadline is not None else None,
            }
        }

    def wait_for_checkpoint(
        self, persister: Waitable, step: int, notice: Notice, timeout: float | None, say: bool
    ) -> bool:
        """Put ``step`` ahead of older uploads and wait for its commit; ``say``: log how it went (once per step)."""
        started = time.perf_counter()
        if notice.deadline is not None:
            persister.expedite(step, notice.deadline - EXIT_MARGIN_S)
        committed = persister.wait_for_step(step, timeout=timeout)
        if self.committed_step != step and say:
            _log_outcome(step, notice, committed, time.perf_counter() - started)
        if committed:
            self.committed_step = step
        return committed

    def closing_timeout(self, persister: Waitable, step: int | None) -> float | None:
        """How long closing the persister may wait at the end: until the deadline, or not at all once
        the emergency checkpoint committed (what still uploads is older than it). None: no deadline."""
        notice = self.active_notice()
        if notice is None or notice.deadline is None:
            return None
        if step is not None and persister.wait_for_step(step, timeout=0):
            return 0.0
        return time_left_s(notice)


def _log_outcome(step: int, notice: Notice, committed: bool, waited_s: float) -> None:
    since_notice_s = time.time() - notice.received_at
    left = notice.seconds_left()
    if committed:
        log.warning(
            "spot_callbacks: emergency checkpoint committed in %.1fs (step %d, %.1fs after the %s notice)%s",
            waited_s, step, since_notice_s, notice.source,
            f", {left:.1f}s left before the deadline" if left is not None else "",
        )  # fmt: skip
    else:
        log.error(
            "spot_callbacks: the emergency checkpoint of step %d did not commit before the deadline "
            "(%.1fs after the %s notice%s); the newest committed checkpoint stays the resume point",
            step, since_notice_s, notice.source, f", {left:.1f}s left" if left is not None else "",
        )  # fmt: skip


def _utc(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, tz=timezone.utc).isoformat()
