"""What a run measured: the records in each manifest and the lineage's ledger.

**The records.** Every manifest carries what its checkpoint cost, in ``metrics``:

- ``stall_s`` (measured): seconds the training loop was blocked taking the snapshot;
- ``write_s`` / ``upload_s`` (measured): background seconds to serialize to scratch and to upload;
- ``taken_at`` (measured): Unix time of the snapshot; the manifest's ``created`` is its commit;
- ``train_s`` (measured): training seconds in this checkpoint's lineage, wall clock, summed over the
  runs that led to it (validation and stalls included; pulls, loads and lost work not);
- ``interval_s``: the interval in force; ``slowdown_s`` (estimated): how much the background
  persist of a checkpoint slows the steps around it (step times while persisting vs. not).

and, in ``extra["ledger"]``, a :class:`RunLedger`: the totals of the whole lineage (checkpoints,
stall, training time, resumes), so the newest manifest alone tells the run's history even after
retention deleted the older ones. A resume is recorded (:class:`ResumeRecord`) in the ledger of
the next checkpoint: ``pull_s`` and ``load_s`` are measured; how much work the interruption lost:

- after an emergency checkpoint (``preemption``, ``exception``) the run stopped right after it:
  **lost work 0, measured**, and the downtime (that commit to the new process) is measured too;
- after any other checkpoint the run vanished without notice (kill -9, a machine that is gone):
  nothing says how far it got. The lost work is **estimated** as an upper bound: the time from
  that checkpoint's snapshot to the new process, but at most one interval plus one persist
  (otherwise the next checkpoint would have committed); the downtime is unknown.

Timestamps of two machines are compared, so clock skew enters downtime and the estimate
(negative gaps count as 0).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, cast

EMERGENCY_REASONS = ("preemption", "exception")  # taken when the interruption came: nothing lost
CONTINUATION_REASONS = ("end",)  # a finished run continued later: not an interruption
LEDGER_VERSION = 1
RECENT_RESUMES_KEPT = 20
# The most a ledger value may say: seconds (about 3,000 years, Unix times included) and counts. A
# value beyond, negative or not a number is no run's record (a bucket writer's): it is ignored.
MAX_LEDGER_S = 1e11
MAX_LEDGER_COUNT = 10**12

log = logging.getLogger("spot_callbacks")


class SlowdownMeter:
    """How much a background persist slows training, from step times: an estimate, per checkpoint.

    The adapters' step boundaries feed it the time of each step and whether a checkpoint was
    persisting meanwhile. Per checkpoint: (median busy step - median idle step) x busy steps, and
    0 until both kinds were seen a few times. Medians keep validation and logging steps out.

    Example:
        >>> meter = SlowdownMeter()
        >>> for _ in range(5):
        ...     meter.observe_step(1.0, persisting=False)
        >>> meter.checkpoint_taken()
        >>> for _ in range(4):
        ...     meter.observe_step(1.5, persisting=True)
        >>> meter.checkpoint_taken()
        >>> meter.per_checkpoint_s()
        2.0
    """

    MIN_SAMPLES = 3

    def __init__(self, window: int = 64) -> None:
        self._busy_steps_s: deque[float] = deque(maxlen=window)
        self._idle_steps_s: deque[float] = deque(maxlen=window)
        self._busy_per_checkpoint: deque[int] = deque(maxlen=10)
        self._busy_since_checkpoint = 0

    def observe_step(self, seconds: float, persisting: bool) -> None:
        if persisting:
            self._busy_steps_s.append(seconds)
            self._busy_since_checkpoint += 1
        else:
            self._idle_steps_s.append(seconds)

    def checkpoint_taken(self) -> None:
        if self._busy_since_checkpoint:
            self._busy_per_checkpoint.append(self._busy_since_checkpoint)
        self._busy_since_checkpoint = 0

    def per_checkpoint_s(self) -> float:
        if (
            len(self._busy_steps_s) < self.MIN_SAMPLES
            or len(self._idle_steps_s) < self.MIN_SAMPLES
            or not self._busy_per_checkpoint
        ):
            return 0.0
        extra_s = statistics.median(self._busy_steps_s) - statistics.median(self._idle_steps_s)
        return max(extra_s, 0.0) * statistics.median(self._busy_per_checkpoint)


# ------------------------------------------------------------------------------------ the records
@dataclass(frozen=True)
class ResumeRecord:
    """One resume: where from, what it cost, and what the interruption before it lost.

    ``lost_work_measured`` says whether ``lost_work_s`` is measured (after an emergency checkpoint)
    or an upper-bound estimate (after a crash); ``downtime_s`` is ``None`` when unknown.
    """

    from_step: int
    from_reason: str
    resumed_at: float  # Unix time the resuming process started (its callback was created)
    pull_s: float
    load_s: float
    lost_work_s: float
    lost_work_measured: bool
    downtime_s: float | None

    @property
    def interrupted(self) -> bool:
        """False for a finished run continued later (resumed from its ``end`` checkpoint)."""
        return self.from_reason not in CONTINUATION_REASONS

    def to_json(self) -> dict[str, Any]:
        return {
            "from_step": self.from_step, "from_reason": self.from_reason,
            "resumed_at": round(self.resumed_at, 3), "pull_s": round(self.pull_s, 6),
            "load_s": round(self.load_s, 6), "lost_work_s": round(self.lost_work_s, 6),
            "lost_work_measured": self.lost_work_measured,
            "downtime_s": None if self.downtime_s is None else round(self.downtime_s, 6),
        }  # fmt: skip

    @classmethod
    def from_json(cls, doc: Any) -> ResumeRecord | None:
        """The record ``doc`` (from a store: untrusted), or ``None`` when a field is not what a run
        writes (a negative, huge or non-numeric number, a missing key, a reason over 64 characters)."""
        if not isinstance(doc, dict):
            return None
        seconds = {
            key: seconds_value(doc.get(key)) for key in ("resumed_at", "pull_s", "load_s", "lost_work_s")
        }
        downtime, step, reason = doc.get("downtime_s"), doc.get("from_step"), doc.get("from_reason")
        measured = doc.get("lost_work_measured")
        if (
            None in seconds.values()
            or (downtime is not None and seconds_value(downtime) is None)
            or count_value(step) is None
            or not isinstance(reason, str)
            or len(reason) > 64
            or not isinstance(measured, bool)
        ):
            return None
        known = cast(dict[str, float], seconds)  # None was refused above
        return cls(
            from_step=int(cast(int, step)), from_reason=reason, resumed_at=known["resumed_at"],
            pull_s=known["pull_s"], load_s=known["load_s"], lost_work_s=known["lost_work_s"], lost_work_measured=measured,
            downtime_s=None if downtime is None else float(downtime),
        )  # fmt: skip


def measure_resume(
    from_reason: str,
    from_step: int,
    committed_at: float,
    taken_at: float | None,
    resumed_at: float,
    pull_s: float,
    load_s: float,
    interval_s: float | None = None,
    persist_s: float = 0.0,
) -> ResumeRecord:
    """What a resume cost and what the interruption before it lost, from the checkpoint resumed from.

    ``committed_at``/``taken_at``: Unix times of that checkpoint's commit and snapshot;
    ``resumed_at``: when the resuming process started. See the module docstring for what is
    measured and what is estimated.

    Example:
        >>> record = measure_resume("interval", 500, committed_at=1030, taken_at=1000, resumed_at=1900,
        ...                         pull_s=5, load_s=2, interval_s=600, persist_s=30)
        >>> record.lost_work_s, record.lost_work_measured, record.downtime_s  # at most 600 + 30 s
        (630.0, False, None)
    """
    taken = committed_at if taken_at is None else taken_at
    if from_reason in EMERGENCY_REASONS:
        lost, measured, downtime = 0.0, True, max(resumed_at - committed_at, 0.0)
    elif from_reason in CONTINUATION_REASONS:
        lost, measured, downtime = 0.0, True, None
    else:
        lost, measured, downtime = max(resumed_at - taken, 0.0), False, None
        if interval_s is not None and math.isfinite(interval_s):
            lost = min(lost, interval_s + persist_s)
    return ResumeRecord(
        from_step=from_step, from_reason=from_reason, resumed_at=float(resumed_at), pull_s=float(pull_s),
        load_s=float(load_s), lost_work_s=float(lost), lost_work_measured=measured,
        downtime_s=None if downtime is None else float(downtime),
    )  # fmt: skip


@dataclass(frozen=True)
class RunLedger:
    """The cumulative costs of a checkpoint's lineage, stored in every manifest (``extra["ledger"]``).

    Immutable: :meth:`add_checkpoint` and :meth:`add_resume` return the next ledger.

    Example:
        >>> ledger = RunLedger().add_checkpoint("interval", stall_s=0.5, train_s=1800.0)
        >>> ledger = ledger.add_checkpoint("preemption", stall_s=0.25, train_s=2000.0)
        >>> ledger.checkpoints, ledger.stall_s, RunLedger.from_json(ledger.to_json()) == ledger
        ({'interval': 1, 'preemption': 1}, 0.75, True)
    """

    checkpoints: dict[str, int] = field(default_factory=dict)
    stall_s: float = 0.0
    slowdown_s: float = 0.0
    train_s: float = 0.0
    resumes: int = 0
    interruptions: int = 0
    pull_s: float = 0.0
    load_s: float = 0.0
    lost_work_measured_s: float = 0.0
    lost_work_estimated_s: float = 0.0
    downtime_s: float = 0.0
    downtime_unknown: int = 0
    recent_resumes: tuple[ResumeRecord, ...] = ()

    @property
    def checkpoint_count(self) -> int:
        return sum(self.checkpoints.values())

    @property
    def lost_work_s(self) -> float:
        return self.lost_work_measured_s + self.lost_work_estimated_s

    @property
    def billed_s(self) -> float:
        """Machine time the lineage used: training, lost work, pulls and loads (downtime is not billed)."""
        return self.train_s + self.lost_work_s + self.pull_s + self.load_s

    @property
    def productive_s(self) -> float:
        return max(self.train_s - self.stall_s - self.slowdown_s, 0.0)

    @property
    def goodput(self) -> float | None:
        """Productive training time / billed machine time, or ``None`` before any training."""
        return self.productive_s / self.billed_s if self.billed_s > 0 else None

    def add_checkpoint(
        self, reason: str, stall_s: float, train_s: float, slowdown_s: float = 0.0
    ) -> RunLedger:
        counts = dict(self.checkpoints)
        counts[reason] = counts.get(reason, 0) + 1
        return replace(
            self,
            checkpoints=counts,
            stall_s=self.stall_s + stall_s,
            slowdown_s=self.slowdown_s + slowdown_s,
            train_s=train_s,
        )

    def add_resume(self, record: ResumeRecord) -> RunLedger:
        return replace(
            self,
            resumes=self.resumes + 1,
            interruptions=self.interruptions + int(record.interrupted),
            pull_s=self.pull_s + record.pull_s,
            load_s=self.load_s + record.load_s,
            lost_work_measured_s=self.lost_work_measured_s
            + (record.lost_work_s if record.lost_work_measured else 0.0),
            lost_work_estimated_s=self.lost_work_estimated_s
            + (0.0 if record.lost_work_measured else record.lost_work_s),
            downtime_s=self.downtime_s + (record.downtime_s or 0.0),
            downtime_unknown=self.downtime_unknown + int(record.interrupted and record.downtime_s is None),
            recent_resumes=(*self.recent_resumes, record)[-RECENT_RESUMES_KEPT:],
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "version": LEDGER_VERSION,
            "checkpoints": dict(sorted(self.checkpoints.items())),
            "stall_s": round(self.stall_s, 6), "slowdown_s": round(self.slowdown_s, 6),
            "train_s": round(self.train_s, 3), "resumes": self.resumes, "interruptions": self.interruptions,
            "pull_s": round(self.pull_s, 6), "load_s": round(self.load_s, 6),
            "lost_work_measured_s": round(self.lost_work_measured_s, 6),
            "lost_work_estimated_s": round(self.lost_work_estimated_s, 6),
            "downtime_s": round(self.downtime_s, 6), "downtime_unknown": self.downtime_unknown,
            "recent_resumes": [record.to_json() for record in self.recent_resumes],
        }  # fmt: skip

    @classmethod
    def from_json(cls, doc: Any, where: str = "a checkpoint") -> RunLedger | None:
        """The ledger in a manifest or a checkpoint's state, or ``None`` when there is none.

        It comes from a store, so each value is checked: one that no run writes (negative, over
        :data:`MAX_LEDGER_S` seconds or :data:`MAX_LEDGER_COUNT`, not a number, a resume record
        that is not one) is ignored, its default kept, with one warning naming ``where`` and the keys.

        Example:
            >>> RunLedger.from_json({"version": 1, "stall_s": -1e300, "resumes": 2}).stall_s
            0.0
        """
        if not isinstance(doc, dict) or doc.get("version") != LEDGER_VERSION:
            return None
        ignored: list[str] = []

        def seconds(key: str) -> float:
            value = seconds_value(doc.get(key, 0.0))
            if value is None:
                ignored.append(key)
            return value or 0.0

        def count(key: str) -> int:
            value = count_value(doc.get(key, 0))
            if value is None:
                ignored.append(key)
            return value or 0

        counts = doc.get("checkpoints", {})
        counts = counts if isinstance(counts, dict) else {None: counts}  # not a mapping: ignored whole
        checkpoints = {
            key: number
            for key, value in counts.items()
            if isinstance(key, str) and len(key) <= 64 and (number := count_value(value)) is not None
        }
        if len(checkpoints) < len(counts):
            ignored.append("checkpoints")
        records = doc.get("recent_resumes", [])
        records = records[-RECENT_RESUMES_KEPT:] if isinstance(records, list) else [None]
        resumes = tuple(record for record in map(ResumeRecord.from_json, records) if record is not None)
        if len(resumes) < len(records):
            ignored.append("recent_resumes")
        ledger = cls(
            checkpoints=checkpoints, stall_s=seconds("stall_s"), slowdown_s=seconds("slowdown_s"),
            train_s=seconds("train_s"), resumes=count("resumes"), interruptions=count("interruptions"),
            pull_s=seconds("pull_s"), load_s=seconds("load_s"),
            lost_work_measured_s=seconds("lost_work_measured_s"),
            lost_work_estimated_s=seconds("lost_work_estimated_s"),
            downtime_s=seconds("downtime_s"), downtime_unknown=count("downtime_unknown"), recent_resumes=resumes,
        )  # fmt: skip
        if ignored:
            log.warning(
                "spot_callbacks: ignoring values of the run ledger in %s that no run writes (%s): "
                "negative, too large or not numbers; the totals go on without them",
                where, ", ".join(ignored),
            )  # fmt: skip
        return ledger

    @classmethod
    def from_manifests(cls, infos: Iterable[Any]) -> RunLedger:
        """A ledger rebuilt from the manifests a store still holds (for runs written without one)."""
        ledger = cls()
        for info in infos:
            ledger = ledger.add_checkpoint(
                info.reason,
                finite_number(info.metrics.get("stall_s")) or 0.0,
                finite_number(info.metrics.get("train_s")) or ledger.train_s,
            )
        return ledger


# ResumeRecord.from_reason of a resume after a run that died before it committed anything.
DIED_UNCOMMITTED = "crash"


def ledger_after_resume(
    info: Any, resumed_at: float, pull_s: float, load_s: float, dead_run: tuple[float, float] | None = None
) -> RunLedger:
    """The ledger a run resumed from checkpoint ``info`` continues, with this resume recorded in it.

    ``info`` is the :class:`~spot_callbacks.store.CheckpointInfo` resumed from; its manifest's
    ledger is continued (or, for a manifest without one, a ledger that starts at its training time).
    ``dead_run``: ``(started, last_heartbeat)`` (Unix times) of a previous run seen dead through
    its stale run lock; when it started after ``info`` committed, it resumed from ``info`` too and
    died before committing anything, so no manifest tells of it: its resume and its death are
    recorded here (lost work: its start to its last heartbeat, estimated; downtime: from then).

    Example:
        >>> from datetime import datetime, timezone
        >>> from types import SimpleNamespace
        >>> info = SimpleNamespace(step=150, reason="preemption", metrics={}, extra={},
        ...                        created=datetime.fromtimestamp(1000, timezone.utc))
        >>> ledger = ledger_after_resume(info, 1200, 1.0, 1.0, dead_run=(1010, 1050))
        >>> ledger.resumes, ledger.interruptions, ledger.lost_work_estimated_s
        (2, 2, 40.0)
    """
    metrics = info.metrics
    ledger = RunLedger.from_json(
        info.extra.get("ledger"), getattr(info, "url", "the checkpoint")
    ) or RunLedger(train_s=finite_number(metrics.get("train_s")) or 0.0)
    persist_s = (finite_number(metrics.get("write_s")) or 0.0) + (
        finite_number(metrics.get("upload_s")) or 0.0
    )
    committed_at = info.created.timestamp()

    def resumed(at: float, pull: float, load: float) -> ResumeRecord:
        return measure_resume(
            info.reason, info.step, committed_at=committed_at, taken_at=finite_number(metrics.get("taken_at")),
            resumed_at=at, pull_s=pull, load_s=load,
            interval_s=finite_number(metrics.get("interval_s")), persist_s=persist_s,
        )  # fmt: skip

    started, beat = dead_run if dead_run is not None else (None, None)
    if started is None or beat is None or not committed_at < started <= beat:
        return ledger.add_resume(resumed(resumed_at, pull_s, load_s))
    died = ResumeRecord(
        from_step=info.step, from_reason=DIED_UNCOMMITTED, resumed_at=float(resumed_at),
        pull_s=float(pull_s), load_s=float(load_s), lost_work_s=beat - started,
        lost_work_measured=False, downtime_s=max(resumed_at - beat, 0.0),
    )  # fmt: skip
    return ledger.add_resume(resumed(started, 0.0, 0.0)).add_resume(died)


def seconds_value(value: Any) -> float | None:
    """A ledger's seconds (or Unix time) as a float, or ``None`` unless finite and within 0..:data:`MAX_LEDGER_S`."""
    number = finite_number(value)
    return number if number is not None and 0.0 <= number <= MAX_LEDGER_S else None


def count_value(value: Any) -> int | None:
    """A ledger's count (or step) as an int, or ``None`` unless an integer within 0..:data:`MAX_LEDGER_COUNT`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LEDGER_COUNT:
        return None
    return value


def finite_number(value: Any) -> float | None:
    """A manifest's number as a float, or ``None`` for anything else (missing, text, NaN, an integer
    too large for a float such as ``10**400``, which ``math.isfinite`` would raise on).

    Example:
        >>> finite_number(1.5), finite_number(10**400), finite_number(float("nan")), finite_number(True)
        (1.5, None, None, None)
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None
