"""What happens on a preemption notice once every rank agreed on it: the deadline, in one place.

The emergency checkpoint must commit before the notice's deadline, less :data:`EXIT_MARGIN_S`
for the process to exit. :class:`Emergency` keeps the agreed notice, gives each checkpoint job
its deadline and the ``preemption`` record of its manifest, waits for the commit (the newest
checkpoint goes ahead of older uploads) and says how it went, once.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import time
from datetime import datetime, timezone
from typing import Any, Protocol

from spot_callbacks.preemption.notice import PREEMPTED_EXIT_CODE, Notice
from spot_callbacks.preemption.signals import signal_grace_s
from spot_callbacks.preemption.sources import GRACE_SIGNALS
from spot_callbacks.preemption.watcher import PreemptionWatcher
from spot_callbacks.progress import is_terminal, progress_every_s, progress_line, showing_progress
from spot_callbacks.store.meter import TransferMeter

log = logging.getLogger("spot_callbacks")

# Time kept back from a preemption deadline for the process to exit after the commit.
EXIT_MARGIN_S = 2.0


class Waitable(Protocol):
    """The part of a persister an emergency waits on."""

    def expedite(self, step: int, deadline: float) -> None: ...
    def wait_for_step(self, step: int, timeout: float | None = None) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...
    def upload_meter(self, step: int | None = None) -> TransferMeter | None: ...
    @property
    def idle(self) -> bool: ...


# How often the wait at the end of training looks for a notice that arrived meanwhile.
NOTICE_CHECK_S = 0.2
SAY_WAIT_AFTER_S = 2.0  # the end-of-fit wait is said only once it lasts this long


def time_left_s(notice: Notice | None, timeout: float | None = None) -> float | None:
    """The wait allowed before the notice's deadline (less the exit margin), capped by ``timeout``; never negative.

    Example:
        >>> time_left_s(None, 5.0), time_left_s(Notice("SIGTERM", None), None)
        (5.0, None)
        >>> 0 < time_left_s(Notice("aws", time.time() + 30)) <= 28.0
        True
    """
    seconds_left = None if notice is None else notice.seconds_left()
    if seconds_left is not None:
        left = seconds_left - EXIT_MARGIN_S
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
        self._said_steps: set[int] = set()  # emergency outcomes logged: each once
        self.noticed_at_exit: Notice | None = None  # a notice that came while the last uploads finished

    def agree(self, notice: Notice) -> None:
        self.agreed = notice

    def wait_limit(self, notice: Notice | None, timeout: float | None) -> float | None:
        """How long a wait for a commit may take: :func:`time_left_s`, or nothing after a second Ctrl-C."""
        return 0.0 if self.watcher.interrupted_twice else time_left_s(notice, timeout)

    def agreed_at_a_step(self) -> bool:
        """An emergency is under way: every rank agreed on the notice at a step boundary."""
        return self.agreed is not None and self.watcher.notice is not None

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
        if say and step not in self._said_steps and timeout != 0 and not persister.wait_for_step(step, 0):
            log.warning(
                "spot_callbacks: waiting for the emergency checkpoint of step %d to commit (%s)", step,
                f"at most {timeout:.1f}s" if timeout is not None else "no deadline; Ctrl-C again stops at once",
            )  # fmt: skip
        shown = say and step not in self._said_steps and timeout != 0
        with _upload_progress(persister, step, f"emergency checkpoint of step {step}", shown):
            committed = persister.wait_for_step(step, timeout=timeout)
        if say and step not in self._said_steps:
            self._said_steps.add(step)
            earlier = getattr(persister, "last_committed", None)
            _log_outcome(
                step, notice, committed, time.perf_counter() - started, getattr(earlier, "step", None)
            )
        if committed:
            self.committed_step = step
        return committed

    def wait_at_exit(self, persister: Waitable, step: int | None, timeout: float | None, say: bool) -> bool:
        """Wait for every upload at the end of training, up to ``timeout``, still handling notices.

        A notice arriving meanwhile makes the last checkpoint an emergency one: it goes ahead of
        older uploads and is waited for until the notice's deadline less the exit margin (then
        :attr:`noticed_at_exit` is set: the run stops as preempted). ``say``: log what is waited for.
        """
        if persister.idle:
            return True
        started = time.monotonic()
        ends = None if timeout is None else started + timeout
        finished = self._wait_for_uploads(persister, step, timeout, started, say)
        if finished is None:  # the time ran out
            return False
        notice = self.watcher.notice
        if notice is None:
            return True
        self.agree(notice)
        self.noticed_at_exit = notice  # the run stops as preempted, whether the upload made it or not
        if finished:
            return True
        wait_s = time_left_s(notice, None if ends is None else ends - time.monotonic())
        if say:
            log.warning(
                "spot_callbacks: %s notice while the last checkpoint uploads: step %s goes first; waiting %s",
                notice.source, step, f"at most {wait_s:.1f}s (its deadline less {EXIT_MARGIN_S:.0f}s to exit)"
                if wait_s is not None else "until it commits (the notice has no deadline)",
            )  # fmt: skip
        if step is None:
            return persister.wait(timeout=wait_s)
        self.wait_for_checkpoint(persister, step, notice, wait_s, say)
        return persister.wait(timeout=0)

    def _wait_for_uploads(
        self,
        persister: Waitable,
        step: int | None,
        timeout: float | None,
        started: float,
        say: bool,
    ) -> bool | None:
        """Wait for every upload until a notice arrives: True once done, False at a notice, None when
        ``timeout`` (from ``started``) ran out. ``say``: after :data:`SAY_WAIT_AFTER_S`, what is waited
        for, then its progress (bars on a terminal, else a line every ``$SPOT_PROGRESS_EVERY_S``)."""
        ends = None if timeout is None else started + timeout
        said_at: float | None = None  # a wait shorter than SAY_WAIT_AFTER_S is not news
        on_terminal, every_s = is_terminal(sys.stderr), progress_every_s()
        with contextlib.ExitStack() as bars:  # on a terminal, once the wait is said: the upload's bars
            while self.watcher.notice is None:
                left = None if ends is None else ends - time.monotonic()
                if persister.wait(
                    timeout=NOTICE_CHECK_S if left is None else max(min(left, NOTICE_CHECK_S), 0)
                ):
                    return True
                if left is not None and left <= NOTICE_CHECK_S:
                    return None
                now = time.monotonic()
                if not say or self.watcher.notice is not None:
                    continue
                if said_at is None and now - started >= SAY_WAIT_AFTER_S:
                    said_at = now
                    limit = (
                        f"at most {timeout:.0f}s"
                        if timeout is not None
                        else "no limit but the store's upload timeouts"
                    )
                    log.info(
                        "spot_callbacks: waiting for the upload of the checkpoint of step %s to commit (%s)%s; a "
                        "preemption notice or Ctrl-C meanwhile makes it an emergency with that notice's deadline",
                        step, limit, _upload_state(persister),
                    )  # fmt: skip
                    if on_terminal:
                        bars.enter_context(_upload_progress(persister, None, f"uploading step {step}", True))
                elif said_at is not None and not on_terminal and now - said_at >= every_s:
                    said_at = now
                    log.info(
                        "spot_callbacks: still waiting for the upload of step %s (%.0fs so far)%s",
                        step, now - started, _upload_state(persister),
                    )  # fmt: skip
            return False

    def exit_if_noticed_at_exit(self) -> None:
        """A notice came while the last uploads finished: the run stops as preempted (``SystemExit(143)``),
        the clouds that ask (Azure) told first."""
        notice = self.noticed_at_exit
        if notice is None:
            return
        self.watcher.acknowledge()
        log.warning(
            "spot_callbacks: stopping as preempted (%s at the end of training): exit %d",
            notice.source, PREEMPTED_EXIT_CODE,
        )  # fmt: skip
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def closing_timeout(self, persister: Waitable, step: int | None) -> float | None:
        """How long closing the persister may wait at the end: until the deadline, or not at all once
        the emergency checkpoint committed (what still uploads is older than it). None: no deadline."""
        notice = self.active_notice()
        if notice is None or notice.deadline is None:
            return None
        if step is not None and persister.wait_for_step(step, timeout=0):
            return 0.0
        return time_left_s(notice)


def _upload_state(persister: Waitable) -> str:
    """How far the upload in flight got, for a line about waiting on it ("" when none is moving)."""
    meter = persister.upload_meter()
    reading = None if meter is None else meter.reading()
    return f": {progress_line(reading)}" if reading is not None and reading.total_bytes else ""


def _upload_progress(
    persister: Waitable, step: int | None, label: str, shown: bool
) -> contextlib.AbstractContextManager[None]:
    """The progress of the upload of ``step`` (None: the newest in flight) while a wait runs, if ``shown``."""
    if not shown:
        return contextlib.nullcontext()
    return showing_progress(lambda: persister.upload_meter(step), label, to_log=True, transient=True)


def warn_if_grace_too_short(sources: list[str]) -> None:
    """At start: a signal's grace (``$SPOT_SIGNAL_GRACE_S``) at or below the exit margin leaves no
    time for an emergency checkpoint; say so while it can still be changed."""
    grace_s = signal_grace_s()
    watched = [name for name in sources if name in GRACE_SIGNALS]
    if watched and grace_s <= EXIT_MARGIN_S:
        log.warning(
            "spot_callbacks: SPOT_SIGNAL_GRACE_S=%g leaves no time for an emergency checkpoint after %s: "
            "%.0fs of it are kept to exit; set it to the real grace period (Kubernetes: "
            "terminationGracePeriodSeconds, default 30)",
            grace_s, "/".join(watched), EXIT_MARGIN_S,
        )  # fmt: skip


def _log_outcome(
    step: int, notice: Notice, committed: bool, waited_s: float, newest_committed: int | None = None
) -> None:
    since_notice_s = time.time() - notice.received_at
    left = notice.seconds_left()
    if committed:
        log.warning(
            "spot_callbacks: emergency checkpoint committed in %.1fs (step %d, %.1fs after the %s notice)%s",
            waited_s, step, since_notice_s, notice.source,
            f", {left:.1f}s left before the deadline" if left is not None else "",
        )  # fmt: skip
        if notice.source == signal.Signals.SIGINT.name:
            log.warning(
                "spot_callbacks: stopping after Ctrl-C: step %d is committed; run the same command again "
                "to resume from it", step,
            )  # fmt: skip
    else:
        # Say what happened: Ctrl-C has no deadline, and a run that committed nothing has no resume point.
        why = (
            "was not committed: Ctrl-C again stopped the wait"
            if notice.deadline is None
            else f"did not commit before the deadline ({since_notice_s:.1f}s after the {notice.source} notice"
            + (f", {left:.1f}s left)" if left is not None else ")")
        )
        resume = (
            f"step {newest_committed}, committed earlier, is the resume point"
            if newest_committed is not None
            else "this run committed no checkpoint: a restart resumes from the one it started from, if any"
        )
        log.error("spot_callbacks: the emergency checkpoint of step %d %s; %s", step, why, resume)


def _utc(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, tz=timezone.utc).isoformat()
