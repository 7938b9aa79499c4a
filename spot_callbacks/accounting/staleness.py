"""Staleness alarm: how long since a checkpoint last committed, and a warning when that is too long.

``persist_lag_s`` is the time since the newest commit of this training run, or since training
started when nothing has committed yet (time outside training is not a lag). When it reaches
twice the checkpoint interval, uploads are failing or too slow for the interval: one warning per
episode (until a checkpoint commits again) says which, with the evidence and an interval that
would keep up. The verdict reads what is in flight: an upload that has run longer than the
interval, a persist time over it, or a checkpoint dropped because a newer one came before it
could upload all mean "uploads take X, longer than the interval Y: raise the interval or use
interval='auto'"; when "auto" is on already, the warning says what it chose and why slow uploads
do not lengthen it (a fixed interval, a lower ``interruptions_per_hour`` or a faster store do).
While an upload is in flight and none of these holds yet, the alarm waits for it (it commits, or
outruns the interval): an upload on its way is never called "checkpoints are not being taken".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from spot_callbacks._format import duration_setting, format_seconds
from spot_callbacks.errors import PersistError
from spot_callbacks.persist import PersistRecord

log = logging.getLogger("spot_callbacks")

STALE_FACTOR = 2.0  # intervals without a commit before the alarm
# A suggested interval leaves this much room over the persist time: uploads keep up with margin.
PERSIST_HEADROOM = 1.5


def suggested_interval_s(persist_s: float | None, interval_s: float) -> float:
    """An interval that persisting keeps up with: the current one, or ``PERSIST_HEADROOM`` x the persist time.

    Example:
        >>> suggested_interval_s(100.0, 60.0), suggested_interval_s(10.0, 60.0), suggested_interval_s(None, 60.0)
        (150.0, 60.0, 60.0)
    """
    if persist_s is None:
        return interval_s
    return max(interval_s, persist_s * PERSIST_HEADROOM)


class StalenessMonitor:
    """Tracks the time since the newest commit and warns once per episode when it exceeds ``factor`` intervals.

    The engine calls :meth:`observe` at each step boundary with what the persister knows; tests
    pass a ``clock`` they advance by hand.

    Args:
        store_url: named in the warning.
        clock: seconds, monotonic (default :func:`time.monotonic`).
        factor: intervals without a commit before the warning.

    Example:
        >>> now = [0.0]
        >>> monitor = StalenessMonitor("s3://bucket/run", clock=lambda: now[0])
        >>> monitor.start()
        >>> now[0] = 50.0; monitor.observe([], [], None, interval_s=60.0) is None, monitor.lag_s()
        (True, 50.0)
        >>> now[0] = 125.0; print(monitor.observe([], [], None, interval_s=60.0))  # doctest: +ELLIPSIS
        spot_callbacks: no checkpoint has committed to s3://bucket/run for 2.1 min (the interval is 1.0 min), and no upload failed: ...
        >>> monitor.observe([], [], None, interval_s=60.0) is None  # once per episode
        True

    An upload in flight for longer than the interval is the cause, said with the fix:

        >>> monitor = StalenessMonitor("s3://bucket/run", clock=lambda: now[0])
        >>> now[0] = 0.0; monitor.start(); monitor.observe([], [], 1, interval_s=10.0)
        >>> now[0] = 19.0; monitor.observe([], [], 1, interval_s=10.0) is None  # still uploading, < 2 intervals
        True
        >>> now[0] = 25.0; print(monitor.observe([], [], 1, interval_s=10.0))  # doctest: +ELLIPSIS
        spot_callbacks: no checkpoint has committed to s3://bucket/run for 25.0 s (...): uploads take 25.0 s, longer than the interval 10.0 s: raise the interval or use interval='auto' (e.g. interval='38s', ...
    """

    def __init__(
        self, store_url: str, clock: Callable[[], float] = time.monotonic, factor: float = STALE_FACTOR
    ) -> None:
        self.store_url = store_url
        self.clock = clock
        self.factor = factor
        self._since: float | None = None
        self._seen_records = 0
        self._newest_step: int | None = None
        self._persist_s: float | None = None
        self._in_flight_step: int | None = None
        self._in_flight_since = 0.0
        self._dropped = 0  # checkpoints the persister dropped for a newer one, so far
        self._dropped_at_commit = 0  # ... when the episode began
        self._warned = False
        self._auto_choice: Callable[[], str | None] | None = None

    def start(self) -> None:
        """Training starts (again): the lag counts from now; time outside training is no lag."""
        self._since = self.clock()
        self._warned = False

    def lag_s(self) -> float:
        """Seconds since the newest commit of this run, or since training started (0 before)."""
        return 0.0 if self._since is None else max(0.0, self.clock() - self._since)

    def observe(
        self,
        records: Sequence[PersistRecord],
        failures: Sequence[PersistError],
        in_flight_step: int | None,
        interval_s: float | None,
        dropped: int = 0,
        auto_choice: Callable[[], str | None] | None = None,
    ) -> str | None:
        """Take in the persister's state; log and return the warning when one is due (else None).

        ``records``: every commit so far (append-only; only the new ones are read). ``failures``:
        the persist failures so far. ``in_flight_step``: the step uploading now. ``interval_s``:
        the checkpoint interval now (None: no time interval, no alarm). ``dropped``: checkpoints
        the persister dropped so far because a newer one came before they could upload.
        ``auto_choice``: with ``interval="auto"``, what it chose and why
        (:meth:`~spot_callbacks.trigger.CheckpointTrigger.auto_choice`), asked only for a warning:
        the advice is then about "auto", never "use interval='auto'".
        """
        self._auto_choice = auto_choice
        now = self.clock()
        if self._since is None:
            self._since = now
        fresh = records[self._seen_records :]
        self._seen_records += len(fresh)  # not len(records): one appended since the slice comes next time
        self._dropped = dropped
        if fresh:
            self._since = now
            self._warned = False
            self._dropped_at_commit = dropped
            self._persist_s = fresh[-1].persist_s
            self._newest_step = max([r.info.step for r in fresh] + [self._newest_step or 0])
        if in_flight_step != self._in_flight_step:
            self._in_flight_step, self._in_flight_since = in_flight_step, now
        if interval_s is None or interval_s <= 0 or self._warned:
            return None
        lag = now - self._since
        if lag < self.factor * interval_s:
            return None
        message = self._message(lag, interval_s, failures, now)
        if message is None:
            return None
        self._warned = True
        log.warning("%s", message)
        return message

    def _message(
        self, lag: float, interval_s: float, failures: Sequence[PersistError], now: float
    ) -> str | None:
        """The warning, or None when an upload in flight may still commit within the interval."""
        head = (
            f"spot_callbacks: no checkpoint has committed to {self.store_url} for {format_seconds(lag)} "
            f"(the interval is {format_seconds(interval_s)})"
        )
        resume_point = (
            f"the newest committed checkpoint (step {self._newest_step}) is the resume point"
            if self._newest_step is not None
            else "nothing this run did is committed yet"
        )
        failure = failures[-1] if failures else None
        if failure is not None and (self._newest_step is None or failure.step > self._newest_step):
            fits = self._interval_fits(self._persist_s, interval_s)
            return (
                f"{head}: uploads are failing. Last error: {failure}. Fix the storage problem it names; "
                f"{fits}. Training goes on; {resume_point}"
            )
        in_flight_s = now - self._in_flight_since if self._in_flight_step is not None else None
        measured = [s for s in (self._persist_s, in_flight_s) if s is not None]
        persist = max(measured) if measured else None
        dropped = self._dropped - self._dropped_at_commit
        if (persist is not None and persist > interval_s) or dropped > 0:
            return self._slow_uploads(head, interval_s, persist, in_flight_s, dropped, resume_point)
        if in_flight_s is not None:
            return (
                None  # on its way and not yet slower than the interval: judged when it commits or outruns it
            )
        known = "no persist time is measured yet"
        if persist is not None:
            known = f"the measured persist time ({format_seconds(persist)}) fits the interval"
        return (
            f"{head}, and no upload failed: {known}. The checkpoints are not being taken: steps (or "
            f"validation) may run longer than the interval, or a checkpoint is still being written; "
            f"{resume_point}"
        )

    def _slow_uploads(
        self,
        head: str,
        interval_s: float,
        persist: float | None,
        in_flight_s: float | None,
        dropped: int,
        resume_point: str,
    ) -> str:
        evidence = []
        if self._persist_s is not None:
            evidence.append(f"the last commit took {format_seconds(self._persist_s)} to persist")
        if in_flight_s is not None:
            evidence.append(
                f"the upload of step {self._in_flight_step} has run for {format_seconds(in_flight_s)}"
            )
        if dropped:
            evidence.append(
                f"{dropped} checkpoint{'' if dropped == 1 else 's'} dropped before upload because a newer one came"
            )
        slower = persist is not None and persist > interval_s
        took = f"take {format_seconds(persist)}, longer than" if slower else "take longer than"
        example = ""
        if slower:
            suggestion = suggested_interval_s(persist, interval_s)
            example = f"e.g. interval={duration_setting(suggestion)!r}, {PERSIST_HEADROOM:g}x the measured persist time"
        auto = self._auto()
        if auto is None:
            advice = (
                f"raise the interval or use interval='auto' ({example + '; ' if example else ''}a faster or "
                "closer store helps too)"
            )
        else:  # "auto" is on already: it sizes the interval by the stall, never by the upload beside it
            advice = (
                f"{auto}. 'auto' sizes the interval by what a checkpoint blocks training, not by how long its "
                "upload runs beside it, so slow uploads do not lengthen it: set a fixed interval instead of "
                f"'auto' ({example or 'longer than an upload takes'}), pass a lower interruptions_per_hour if "
                "interruptions are rarer than that (auto's interval grows as the rate falls), or make uploads "
                "faster (a faster or closer store)"
            )
        return (
            f"{head}: uploads {took} the interval {format_seconds(interval_s)}: {advice}. Evidence: "
            f"{'; '.join(evidence)}. Newer checkpoints replace queued ones before they commit; {resume_point}"
        )

    def _interval_fits(self, persist: float | None, interval_s: float) -> str:
        """Whether the interval suits the last persist time, said for a fixed interval or for "auto"."""
        suggestion = suggested_interval_s(persist, interval_s)
        auto = self._auto_choice is not None and self._auto() is not None
        setting = repr(duration_setting(suggestion))
        if persist is not None and suggestion == interval_s:
            keep = "'auto'" if auto else setting
            return f"the interval suits the last measured persist time ({format_seconds(persist)}); keep interval={keep}"
        if persist is None:
            return "keep interval='auto'" if auto else f"suggested interval={setting}"
        fits = f"suggested interval={setting} ({PERSIST_HEADROOM:g}x the measured persist time)"
        return fits + (
            " instead of 'auto', which does not lengthen the interval for slow uploads" if auto else ""
        )

    def _auto(self) -> str | None:
        """What interval="auto" chose, or None when the interval is not "auto"."""
        return self._auto_choice() if self._auto_choice is not None else None


__all__ = ["StalenessMonitor", "duration_setting", "suggested_interval_s"]
