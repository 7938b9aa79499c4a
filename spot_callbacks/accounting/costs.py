"""The cost of interruptions: what a run measured, and what a spot job is expected to cost.

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

**The model** (:func:`expected_wall_time_s`): Daly's complete model for Poisson interruptions,
the one his higher-order interval optimizes. See its docstring for the formula and assumptions.
:func:`plan_job` and :func:`break_even_interruptions_per_hour` answer "is spot worth it";
:mod:`spot_callbacks.accounting.report` turns all of it into what people read.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

SECONDS_PER_HOUR = 3600.0
EMERGENCY_REASONS = ("preemption", "exception")  # taken when the interruption came: nothing lost
CONTINUATION_REASONS = ("end",)  # a finished run continued later: not an interruption
LEDGER_VERSION = 1
RECENT_RESUMES_KEPT = 20
# Prior of the interruption rate when a run has little history of its own: one interruption in ten
# hours, worth ten hours of observation (a Gamma prior; the estimate is the posterior mean).
PRIOR_INTERRUPTIONS_PER_HOUR = 0.1
PRIOR_HOURS = 10.0


# ------------------------------------------------------------------------------------ intervals
def young_interval_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Young (1974): tau = sqrt(2 * delta * M).

    Example:
        >>> round(young_interval_s(10, 36000))
        849
    """
    return math.sqrt(2.0 * checkpoint_cost_s * mtbf_s)


def daly_interval_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Daly (2006) higher-order optimum: sqrt(2dM)*[1 + 1/3 sqrt(d/2M) + 1/9 (d/2M)] - d for d < 2M, else M.

    Example:
        >>> round(daly_interval_s(10, 36000))
        842
    """
    delta, m = checkpoint_cost_s, mtbf_s
    if delta >= 2.0 * m:
        return m
    ratio = delta / (2.0 * m)
    return math.sqrt(2.0 * delta * m) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - delta


def optimal_interval_s(checkpoint_s: float, interruptions_per_hour: float) -> float:
    """The interval ``interval="auto"`` and ``plan`` use: Daly's, with M = 1/rate; ``inf`` when nothing interrupts.

    Daly's interval is the optimum of :func:`expected_wall_time_s` to within 0.1 % of the
    expected time for any checkpoint cost below 2M (``tests/test_costs.py`` checks it).

    Example:
        >>> round(optimal_interval_s(300, 1 / 24) / 60)  # Daly's paper: 5 min checkpoints, M = 24 h
        117
        >>> optimal_interval_s(300, 0.0)
        inf
    """
    _check_non_negative(checkpoint_s=checkpoint_s, interruptions_per_hour=interruptions_per_hour)
    if interruptions_per_hour == 0:
        return math.inf
    return daly_interval_s(checkpoint_s, SECONDS_PER_HOUR / interruptions_per_hour)


# ------------------------------------------------------------------------------------ the model
def expected_wall_time_s(
    work_s: float,
    interval_s: float,
    checkpoint_s: float,
    resume_s: float,
    interruptions_per_hour: float,
) -> float:
    """Expected wall time of ``work_s`` seconds of training on a machine interrupted at a given rate.

    Daly's complete model (Daly 2006, "A higher order estimate of the optimum checkpoint interval
    for restart dumps", FGCS 22(3)), with M = 1/lambda::

        T = (W / tau) * M * exp(R / M) * (exp((tau + delta) / M) - 1)

    Each segment of ``tau`` seconds of work is followed by a checkpoint of ``delta`` seconds; an
    interruption loses the segment in progress and costs a resume of ``R`` seconds (a new
    machine, the pull, the load) before the segment is retried. To first order in 1/M it is
    ``W (1 + delta/tau)(1 + lambda (tau/2 + delta/2 + R))``: checkpoints add ``delta/tau``, each
    interruption loses half a segment and a resume.

    Assumptions: interruptions are a Poisson process (memoryless, rate constant over the job), and
    can also strike during a checkpoint or a resume; the job spans many intervals (``W/tau``
    segments, not rounded); ``delta`` and ``R`` are the time the training is blocked (background
    persist time counts only through the slowdown it causes); every second is billed.
    ``lambda = 0`` gives ``W (1 + delta/tau)``; ``tau = inf`` (never checkpoint) gives ``W`` without
    interruptions and ``inf`` with them.

    Example:
        >>> expected_wall_time_s(3600, 600, 60, 120, 0.0)  # no interruptions: W (1 + delta/tau)
        3960.0
    """
    _check_non_negative(
        work_s=work_s,
        checkpoint_s=checkpoint_s,
        resume_s=resume_s,
        interruptions_per_hour=interruptions_per_hour,
    )
    if not interval_s >= 0:
        raise ValueError(f"interval_s={interval_s!r} must be >= 0")
    if work_s == 0:
        return 0.0
    rate_per_s = interruptions_per_hour / SECONDS_PER_HOUR
    if math.isinf(interval_s):
        return work_s if rate_per_s == 0 else math.inf
    if interval_s == 0:  # checkpointing continuously: free only if checkpoints are free
        if checkpoint_s > 0:
            return math.inf
        return work_s * math.exp(rate_per_s * resume_s)
    if rate_per_s == 0:
        return work_s * (interval_s + checkpoint_s) / interval_s
    exponent = rate_per_s * (interval_s + checkpoint_s)
    if exponent > 700 or rate_per_s * resume_s > 700:  # exp() would overflow: never finishes
        return math.inf
    return work_s / interval_s * math.exp(rate_per_s * resume_s) * math.expm1(exponent) / rate_per_s


def overhead_factor(
    interruptions_per_hour: float, checkpoint_s: float, resume_s: float, interval_s: float | None = None
) -> float:
    """Expected wall time per second of work (>= 1) at ``interval_s`` (default: the optimal interval).

    Example:
        >>> overhead_factor(0.0, 60, 120)  # nothing interrupts: no checkpoint is needed
        1.0
    """
    if interval_s is None:
        interval_s = optimal_interval_s(checkpoint_s, interruptions_per_hour)
    return expected_wall_time_s(1.0, interval_s, checkpoint_s, resume_s, interruptions_per_hour)


def break_even_interruptions_per_hour(
    spot_price: float, on_demand_price: float, checkpoint_s: float, resume_s: float
) -> float:
    """The interruption rate (per hour) above which on-demand is cheaper than spot at its optimal interval.

    Spot costs ``spot_price * T(lambda)``, on-demand ``on_demand_price * W``; the rate where they
    are equal is found by bisection (the expected time at the optimal interval grows with the
    rate). It does not depend on the amount of work. ``0.0`` when spot is not cheaper per hour;
    ``inf`` when spot stays cheaper at any rate (free checkpoints and resumes, or a free spot).

    Example:
        >>> rate = break_even_interruptions_per_hour(1.0, 3.0, 60, 300)
        >>> round(overhead_factor(rate, 60, 300), 6)  # spot hours cost 3x less, and take 3x longer
        3.0
    """
    _check_non_negative(
        spot_price=spot_price, on_demand_price=on_demand_price, checkpoint_s=checkpoint_s, resume_s=resume_s
    )
    if spot_price >= on_demand_price:
        return 0.0
    if spot_price == 0:
        return math.inf
    ratio = on_demand_price / spot_price

    def too_costly(rate: float) -> bool:
        return overhead_factor(rate, checkpoint_s, resume_s) >= ratio

    low, high = 0.0, 1.0
    while not too_costly(high):
        low, high = high, high * 2.0
        if high > 1e9:  # an interruption every 4 microseconds and still cheaper
            return math.inf
    for _ in range(200):
        middle = (low + high) / 2.0
        if middle in (low, high):
            break
        if too_costly(middle):
            high = middle
        else:
            low = middle
    return (low + high) / 2.0


@dataclass(frozen=True)
class SpotPlan:
    """Expected cost and time of a job on spot and on demand (see :func:`plan_job`)."""

    work_hours: float
    spot_price: float
    on_demand_price: float
    interruptions_per_hour: float
    checkpoint_s: float
    resume_s: float
    interval_s: float  # Daly's optimum, what interval="auto" would use
    young_interval_s: float
    spot_hours: float
    on_demand_hours: float
    break_even_interruptions_per_hour: float

    @property
    def spot_cost(self) -> float:
        return self.spot_hours * self.spot_price

    @property
    def on_demand_cost(self) -> float:
        return self.on_demand_hours * self.on_demand_price

    @property
    def expected_interruptions(self) -> float:
        return self.spot_hours * self.interruptions_per_hour

    @property
    def savings(self) -> float:
        """On-demand cost minus spot cost (negative: spot costs more)."""
        return self.on_demand_cost - self.spot_cost

    def spot_cost_at(self, interval_s: float) -> float:
        """Expected spot cost with checkpoints every ``interval_s`` seconds (the plot's curve)."""
        hours = expected_wall_time_s(
            self.work_hours * SECONDS_PER_HOUR, interval_s, self.checkpoint_s, self.resume_s,
            self.interruptions_per_hour,
        ) / SECONDS_PER_HOUR  # fmt: skip
        return hours * self.spot_price


def plan_job(
    work_hours: float,
    spot_price: float,
    on_demand_price: float,
    interruptions_per_hour: float,
    checkpoint_s: float,
    resume_s: float,
) -> SpotPlan:
    """Expected cost and wall time of ``work_hours`` of training on spot (at the optimal interval) and on demand.

    On demand is modelled as uninterrupted: ``work_hours`` at ``on_demand_price``.

    Example:
        >>> plan = plan_job(100, spot_price=1.0, on_demand_price=3.0, interruptions_per_hour=0.0,
        ...                 checkpoint_s=60, resume_s=300)
        >>> plan.spot_cost, plan.on_demand_cost, plan.interval_s
        (100.0, 300.0, inf)
    """
    _check_non_negative(
        work_hours=work_hours, spot_price=spot_price, on_demand_price=on_demand_price,
        interruptions_per_hour=interruptions_per_hour, checkpoint_s=checkpoint_s, resume_s=resume_s,
    )  # fmt: skip
    interval = optimal_interval_s(checkpoint_s, interruptions_per_hour)
    young = (
        math.inf
        if interruptions_per_hour == 0
        else young_interval_s(checkpoint_s, SECONDS_PER_HOUR / interruptions_per_hour)
    )
    spot_s = expected_wall_time_s(
        work_hours * SECONDS_PER_HOUR, interval, checkpoint_s, resume_s, interruptions_per_hour
    )
    return SpotPlan(
        work_hours=work_hours, spot_price=spot_price, on_demand_price=on_demand_price,
        interruptions_per_hour=interruptions_per_hour, checkpoint_s=checkpoint_s, resume_s=resume_s,
        interval_s=interval, young_interval_s=young, spot_hours=spot_s / SECONDS_PER_HOUR,
        on_demand_hours=work_hours,
        break_even_interruptions_per_hour=break_even_interruptions_per_hour(
            spot_price, on_demand_price, checkpoint_s, resume_s
        ),
    )  # fmt: skip


def _check_non_negative(**values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{name}={value!r} must be a number >= 0")


# ------------------------------------------------------------------------------- interval="auto"
def posterior_interruptions_per_hour(
    interruptions: int,
    hours: float,
    prior_rate: float = PRIOR_INTERRUPTIONS_PER_HOUR,
    prior_hours: float = PRIOR_HOURS,
) -> float:
    """The interruption rate a run's own history suggests: (prior events + observed) / (prior hours + observed).

    The posterior mean of a Gamma prior (``prior_rate`` over ``prior_hours``) after a Poisson count:
    with no history it is the prior, with a long one it is the observed rate.

    Example:
        >>> posterior_interruptions_per_hour(0, 0.0)
        0.1
        >>> posterior_interruptions_per_hour(3, 5.0)  # (1 + 3) / (10 + 5)
        0.26666666666666666
    """
    return (prior_rate * prior_hours + interruptions) / (prior_hours + max(hours, 0.0))


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
    def from_json(cls, doc: dict[str, Any]) -> ResumeRecord:
        downtime = doc.get("downtime_s")
        return cls(
            from_step=int(doc["from_step"]), from_reason=str(doc["from_reason"]),
            resumed_at=float(doc["resumed_at"]), pull_s=float(doc["pull_s"]), load_s=float(doc["load_s"]),
            lost_work_s=float(doc["lost_work_s"]), lost_work_measured=bool(doc["lost_work_measured"]),
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
    def from_json(cls, doc: Any) -> RunLedger | None:
        """The ledger in a manifest, or ``None`` when there is none or it cannot be read."""
        if not isinstance(doc, dict) or doc.get("version") != LEDGER_VERSION:
            return None
        try:
            return cls(
                checkpoints={str(k): int(v) for k, v in dict(doc.get("checkpoints", {})).items()},
                stall_s=float(doc.get("stall_s", 0.0)), slowdown_s=float(doc.get("slowdown_s", 0.0)),
                train_s=float(doc.get("train_s", 0.0)), resumes=int(doc.get("resumes", 0)),
                interruptions=int(doc.get("interruptions", 0)), pull_s=float(doc.get("pull_s", 0.0)),
                load_s=float(doc.get("load_s", 0.0)),
                lost_work_measured_s=float(doc.get("lost_work_measured_s", 0.0)),
                lost_work_estimated_s=float(doc.get("lost_work_estimated_s", 0.0)),
                downtime_s=float(doc.get("downtime_s", 0.0)), downtime_unknown=int(doc.get("downtime_unknown", 0)),
                recent_resumes=tuple(ResumeRecord.from_json(r) for r in doc.get("recent_resumes", [])),
            )  # fmt: skip
        except (TypeError, ValueError, KeyError):
            return None

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


def ledger_after_resume(info: Any, resumed_at: float, pull_s: float, load_s: float) -> RunLedger:
    """The ledger a run resumed from checkpoint ``info`` continues, with this resume recorded in it.

    ``info`` is the :class:`~spot_callbacks.store.CheckpointInfo` resumed from; its manifest's
    ledger is continued (or, for a manifest without one, a ledger that starts at its training time).
    """
    metrics = info.metrics
    ledger = RunLedger.from_json(info.extra.get("ledger")) or RunLedger(
        train_s=finite_number(metrics.get("train_s")) or 0.0
    )
    persist_s = (finite_number(metrics.get("write_s")) or 0.0) + (
        finite_number(metrics.get("upload_s")) or 0.0
    )
    record = measure_resume(
        info.reason, info.step,
        committed_at=info.created.timestamp(), taken_at=finite_number(metrics.get("taken_at")),
        resumed_at=resumed_at, pull_s=pull_s, load_s=load_s,
        interval_s=finite_number(metrics.get("interval_s")), persist_s=persist_s,
    )  # fmt: skip
    return ledger.add_resume(record)


def finite_number(value: Any) -> float | None:
    """A manifest's number as a float, or ``None`` for anything else (missing, text, NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)
