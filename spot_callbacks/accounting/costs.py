"""The cost of interruptions: what a spot job is expected to cost, and the interval that minimises it.

**The model** (:func:`expected_wall_time_s`): Daly's complete model for Poisson interruptions,
the one his higher-order interval optimizes. See its docstring for the formula and assumptions.
:func:`plan_job` and :func:`break_even_interruptions_per_hour` answer "is spot worth it".
What a run measured is in :mod:`spot_callbacks.accounting.ledger`;
:mod:`spot_callbacks.accounting.report` turns both into what people read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SECONDS_PER_HOUR = 3600.0
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
