"""What ``spot-callbacks plan --from DIRPATH`` takes from a run: the planner's three inputs, measured.

The planner (:func:`~spot_callbacks.accounting.costs.plan_job`) needs, besides the job and the prices:

- **delta**, the checkpoint cost: seconds a checkpoint blocks training. From the ledger: its stall
  plus the slowdown its background persist causes, over every checkpoint of the lineage (the cost
  ``interval="auto"`` feeds Daly's interval too). The upload itself is not in it: it runs beside
  training.
- **R**, the resume cost: seconds from an interruption to training again. From the ledger: the
  pull and the load, on average over the lineage's resumes, plus the downtime (the interruption's
  commit to the new process starting: a new machine coming up) on average over the interruptions
  that measured it. After a crash the downtime is unknown; it is left out, and said.
- **lambda**, the interruption rate: the lineage's interruptions (resumed, or one awaiting its
  resume) over its billed machine hours (:attr:`~spot_callbacks.accounting.ledger.RunLedger.billed_s`).

A quantity the ledger cannot give (no checkpoint measured, no resume yet, no interruption yet) is
``None`` with the reason in :attr:`PlanInputs.lacking`: never a made-up number.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spot_callbacks._format import format_seconds
from spot_callbacks.accounting.costs import SECONDS_PER_HOUR
from spot_callbacks.accounting.report import RunHistory

# Below this many interruptions a measured rate is a rough estimate, and the output says so.
FEW_INTERRUPTIONS = 3


def shown_seconds(seconds: float) -> str:
    """:func:`~spot_callbacks._format.format_seconds`, in milliseconds below 10 ms (a small run's stall).

    Example:
        >>> shown_seconds(0.0011), shown_seconds(2.5)
        ('1.1 ms', '2.50 s')
    """
    return format_seconds(seconds) if seconds >= 0.01 else f"{1000 * seconds:.2g} ms"


def shown_rate(per_hour: float) -> str:
    """Interruptions per hour as people read them.

    Example:
        >>> shown_rate(0.1), shown_rate(1743.25)
        ('0.1 interruptions/h', '1,743 interruptions/h')
    """
    return f"{per_hour:.3g} interruptions/h" if per_hour < 1000 else f"{per_hour:,.0f} interruptions/h"


@dataclass(frozen=True)
class Measured:
    """One input as the run measured it: the value, and how, in words."""

    value: float
    how: str


@dataclass(frozen=True)
class PlanInputs:
    """The planner's inputs from one run's ledger; ``lacking`` maps each missing one's flag to why."""

    checkpoint_s: Measured | None
    resume_s: Measured | None
    interruptions_per_hour: Measured | None
    lacking: dict[str, str] = field(default_factory=dict)


def plan_inputs(history: RunHistory) -> PlanInputs:
    """delta, R and the interruption rate from ``history`` (see the module docstring).

    Example:
        >>> from spot_callbacks.accounting.ledger import RunLedger, measure_resume
        >>> ledger = RunLedger().add_checkpoint("preemption", stall_s=2.0, train_s=3600.0)
        >>> ledger = ledger.add_resume(measure_resume("preemption", 10, 1000.0, 995.0, 1100.0, 30.0, 10.0))
        >>> ledger = ledger.add_checkpoint("end", stall_s=1.0, train_s=7160.0)
        >>> inputs = plan_inputs(RunHistory("s3://b/run", ledger))
        >>> inputs.checkpoint_s.value, inputs.resume_s.value, inputs.interruptions_per_hour.value
        (1.5, 140.0, 0.5)
        >>> plan_inputs(RunHistory("s3://b/run", RunLedger())).lacking["--resume-seconds"]
        'no resume yet: no pull, load or downtime measured'
    """
    lacking: dict[str, str] = {}
    checkpoint = _checkpoint_cost(history)
    if checkpoint is None:
        lacking["--checkpoint-seconds"] = "no checkpoint with a measured stall yet"
    resume = _resume_cost(history)
    if resume is None:
        lacking["--resume-seconds"] = "no resume yet: no pull, load or downtime measured"
    rate = _interruption_rate(history)
    if rate is None:
        hours = history.ledger.billed_s / SECONDS_PER_HOUR
        lacking["--interruptions-per-hour"] = (
            f"no interruption yet in {format_seconds(history.ledger.billed_s)} of machine time"
            if hours > 0
            else "no machine time measured"
        )
    return PlanInputs(checkpoint, resume, rate, lacking)


def _checkpoint_cost(history: RunHistory) -> Measured | None:
    ledger = history.ledger
    count = ledger.checkpoint_count
    blocked_s = ledger.stall_s + ledger.slowdown_s
    if count == 0 or blocked_s <= 0:
        return None
    how = f"{count} checkpoint{'s' if count > 1 else ''} blocked training {shown_seconds(ledger.stall_s)}"
    if ledger.slowdown_s > 0:
        how += f" + {shown_seconds(ledger.slowdown_s)} background slowdown"
    return Measured(blocked_s / count, how + " in all" if count > 1 else how)


def _resume_cost(history: RunHistory) -> Measured | None:
    ledger = history.ledger
    if ledger.resumes == 0:
        return None
    pull_s, load_s = ledger.pull_s / ledger.resumes, ledger.load_s / ledger.resumes
    how = (
        f"pull {shown_seconds(pull_s)} + load {shown_seconds(load_s)} on average over "
        f"{ledger.resumes} resume{'s' if ledger.resumes > 1 else ''}"
    )
    known = ledger.interruptions - ledger.downtime_unknown
    downtime_s = ledger.downtime_s / known if known > 0 else 0.0
    if known > 0:
        how += (
            f" + downtime {format_seconds(downtime_s)} (interruption to the new process, "
            f"{'mean of ' + str(known) if known > 1 else 'measured once'})"
        )
    elif ledger.interruptions:
        how += (
            "; downtime unknown (no emergency checkpoint before the resume), not included: "
            "pass --resume-seconds if a new machine takes longer"
        )
    return Measured(pull_s + load_s + downtime_s, how)


def _interruption_rate(history: RunHistory) -> Measured | None:
    interruptions = history.interruptions
    hours = history.ledger.billed_s / SECONDS_PER_HOUR
    if interruptions == 0 or hours <= 0:
        return None
    how = (
        f"{interruptions} interruption{'s' if interruptions > 1 else ''} in "
        f"{format_seconds(history.ledger.billed_s)} of machine time"
    )
    if interruptions < FEW_INTERRUPTIONS:
        how += "; a rough estimate from so few: pass --interruptions-per-hour for the market's rate"
    return Measured(interruptions / hours, how)
