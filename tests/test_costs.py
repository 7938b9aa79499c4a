"""costs.py and ledger.py: the interval formulas, the expected-cost model, the break-even rate, the ledger a run
keeps in its manifests, interval="auto", and the summary the adapters log at the end."""

from __future__ import annotations

import logging
import math
import random

import pytest
import torch

from spot_callbacks import SpotConfig
from spot_callbacks.accounting.costs import (
    PRIOR_HOURS,
    PRIOR_INTERRUPTIONS_PER_HOUR,
    break_even_interruptions_per_hour,
    daly_interval_s,
    expected_wall_time_s,
    optimal_interval_s,
    overhead_factor,
    plan_job,
    posterior_interruptions_per_hour,
    young_interval_s,
)
from spot_callbacks.accounting.ledger import ResumeRecord, RunLedger, SlowdownMeter, measure_resume
from spot_callbacks.accounting.report import RunHistory, history_rows
from spot_callbacks.engine import SpotEngine
from spot_callbacks.trigger import AUTO_MAX_INTERVAL_S, AUTO_MIN_INTERVAL_S, CheckpointTrigger

HOUR = 3600.0
MINUTE = 60.0


def daly_model_s(work_s, interval_s, checkpoint_s, resume_s, rate_per_h) -> float:
    """The documented formula, written out once more: T = (W/tau) M e^(R/M) (e^((tau+delta)/M) - 1)."""
    m = HOUR / rate_per_h
    return work_s / interval_s * m * math.exp(resume_s / m) * (math.exp((interval_s + checkpoint_s) / m) - 1)


# ------------------------------------------------------------------------------------ intervals
@pytest.mark.parametrize(
    ("mtbf_s", "expected_min", "digits"),
    [(24 * HOUR, 117, 0), (6 * HOUR, 57, 0), (15 * MINUTE, 9.1, 1)],  # Daly (2006), delta = 5 min
)
def test_daly_interval_reproduces_the_papers_examples(mtbf_s, expected_min, digits):
    assert round(daly_interval_s(5 * MINUTE, mtbf_s) / MINUTE, digits) == expected_min


def test_young_is_sqrt_2_delta_m_and_daly_approaches_it_when_checkpoints_are_cheap():
    assert young_interval_s(5 * MINUTE, 24 * HOUR) == pytest.approx(math.sqrt(2 * 300 * 86400))
    ratios = [
        daly_interval_s(delta, 24 * HOUR) / young_interval_s(delta, 24 * HOUR) for delta in (300, 30, 3, 0.03)
    ]
    assert all(ratio < 1 for ratio in ratios)  # Daly subtracts delta: a little shorter
    assert ratios == sorted(ratios) and ratios[-1] == pytest.approx(1, abs=1e-3)


def test_daly_interval_is_m_once_a_checkpoint_costs_2m_or_more():
    assert daly_interval_s(2 * HOUR, 1 * HOUR) == 1 * HOUR
    assert daly_interval_s(10 * HOUR, 1 * HOUR) == 1 * HOUR
    just_below = daly_interval_s(2 * HOUR - 1, 1 * HOUR)
    assert 0 < just_below < 2 * HOUR


@pytest.mark.parametrize(
    ("checkpoint_s", "mtbf_s"), [(300, 86400), (300, 900), (10, 36000), (600, 600), (5, 60)]
)
def test_daly_interval_minimises_the_model_it_comes_from(checkpoint_s, mtbf_s):
    rate = HOUR / mtbf_s
    grid = [mtbf_s * 10 ** (k / 400 - 4) for k in range(1601)]  # 1e-4 M .. 1e0 M, fine steps

    def cost(tau: float) -> float:
        return expected_wall_time_s(HOUR, tau, checkpoint_s, 0, rate)

    daly = daly_interval_s(checkpoint_s, mtbf_s)
    assert cost(daly) <= min(cost(tau) for tau in grid) * 1.001
    assert cost(daly) < cost(daly * 1.1) and cost(daly) < cost(daly / 1.1)  # a minimum, not a slope


def test_optimal_interval_without_interruptions_is_never():
    assert optimal_interval_s(60, 0.0) == math.inf
    assert optimal_interval_s(60, 0.5) == daly_interval_s(60, 7200)


# ------------------------------------------------------------------------------------ the model
def test_expected_wall_time_is_the_documented_formula():
    work_s, tau, delta, resume, rate = 10 * HOUR, 1 * HOUR, 6 * MINUTE, 12 * MINUTE, 0.5
    assert expected_wall_time_s(work_s, tau, delta, resume, rate) == pytest.approx(
        daly_model_s(work_s, tau, delta, resume, rate), rel=1e-12
    )
    # Its first-order form: W (1 + d/tau)(1 + lambda (tau/2 + d/2 + R)), close at a low rate.
    low = 0.01
    first_order = work_s * (1 + delta / tau) * (1 + low / HOUR * (tau / 2 + delta / 2 + resume))
    assert expected_wall_time_s(work_s, tau, delta, resume, low) == pytest.approx(first_order, rel=1e-4)


def test_expected_wall_time_agrees_with_a_simulation_of_poisson_interruptions():
    work_s, tau, delta, resume, rate = 20 * HOUR, 1 * HOUR, 5 * MINUTE, 10 * MINUTE, 0.5
    rng = random.Random(20260101)
    rate_per_s = rate / HOUR

    def finish(length_s: float) -> float:
        """Wall time to get length_s uninterrupted seconds (a resume must itself complete)."""
        spent = 0.0
        while True:
            until_interruption = rng.expovariate(rate_per_s)
            if until_interruption >= length_s:
                return spent + length_s
            spent += until_interruption
            spent += finish(resume) if resume else 0.0

    jobs = 3000
    segments = round(work_s / tau)
    mean_s = sum(sum(finish(tau + delta) for _ in range(segments)) for _ in range(jobs)) / jobs
    assert mean_s == pytest.approx(expected_wall_time_s(work_s, tau, delta, resume, rate), rel=0.01)


def test_edge_cases_of_the_model():
    assert expected_wall_time_s(HOUR, 600, 60, 300, 0.0) == HOUR * (600 + 60) / 600  # lambda = 0
    assert expected_wall_time_s(HOUR, math.inf, 60, 300, 0.0) == HOUR  # never checkpoint, never stopped
    assert expected_wall_time_s(HOUR, math.inf, 60, 300, 0.1) == math.inf
    assert expected_wall_time_s(0, 600, 60, 300, 0.5) == 0.0
    assert expected_wall_time_s(HOUR, 0, 0, 300, 0.5) == pytest.approx(HOUR * math.exp(0.5 / HOUR * 300))
    assert expected_wall_time_s(HOUR, 0, 60, 300, 0.5) == math.inf
    assert expected_wall_time_s(HOUR, 600, 60, 300, 1e6) == math.inf  # exp() would overflow
    delta_over_2m = expected_wall_time_s(HOUR, optimal_interval_s(3 * HOUR, 1.0), 3 * HOUR, 0, 1.0)
    assert math.isfinite(delta_over_2m) and delta_over_2m > HOUR
    for bad in ({"work_s": -1}, {"checkpoint_s": -1}, {"interruptions_per_hour": math.nan}):
        arguments = {
            "work_s": HOUR,
            "interval_s": 600,
            "checkpoint_s": 60,
            "resume_s": 0,
            "interruptions_per_hour": 1,
        }
        with pytest.raises(ValueError, match=next(iter(bad))):
            expected_wall_time_s(**{**arguments, **bad})


def test_expected_time_grows_with_the_rate_the_checkpoint_cost_and_the_resume_cost():
    def at(rate=0.2, delta=60.0, resume=300.0, tau=1200.0):
        return expected_wall_time_s(HOUR, tau, delta, resume, rate)

    assert [at(rate=r) for r in (0, 0.1, 0.5, 2, 8)] == sorted(at(rate=r) for r in (0, 0.1, 0.5, 2, 8))
    assert at(delta=30) < at(delta=60) < at(delta=120)
    assert at(resume=0) < at(resume=300) < at(resume=900)
    optimal = [overhead_factor(r, 60, 300) for r in (0, 0.01, 0.1, 1, 10)]
    assert optimal[0] == 1.0 and all(a < b for a, b in zip(optimal, optimal[1:], strict=False))


# ---------------------------------------------------------------------------- break-even & plan
def test_break_even_rate_is_where_spot_and_on_demand_cost_the_same():
    spot, on_demand, delta, resume = 1.2, 3.9, 45.0, 400.0
    rate = break_even_interruptions_per_hour(spot, on_demand, delta, resume)
    assert 0 < rate < math.inf
    assert spot * overhead_factor(rate, delta, resume) == pytest.approx(on_demand, rel=1e-9)
    assert spot * overhead_factor(rate * 0.9, delta, resume) < on_demand
    assert spot * overhead_factor(rate * 1.1, delta, resume) > on_demand
    assert plan_job(100, spot, on_demand, rate * 0.9, delta, resume).savings > 0
    assert plan_job(100, spot, on_demand, rate * 1.1, delta, resume).savings < 0


def test_break_even_rate_falls_as_checkpoints_and_resumes_get_dearer_and_rises_with_the_discount():
    assert (
        break_even_interruptions_per_hour(1, 3, 10, 300)
        > break_even_interruptions_per_hour(1, 3, 100, 300)
        > break_even_interruptions_per_hour(1, 3, 100, 3000)
    )
    assert break_even_interruptions_per_hour(1, 2, 60, 300) < break_even_interruptions_per_hour(1, 4, 60, 300)


def test_break_even_edge_cases():
    assert break_even_interruptions_per_hour(2.0, 2.0, 60, 300) == 0.0  # equal prices: spot never cheaper
    assert break_even_interruptions_per_hour(3.0, 2.0, 60, 300) == 0.0
    assert break_even_interruptions_per_hour(0.0, 2.0, 60, 300) == math.inf  # free spot
    assert break_even_interruptions_per_hour(1.0, 2.0, 0, 0) == math.inf  # free checkpoints and resumes


def test_plan_job_numbers_come_from_the_model():
    plan = plan_job(200, spot_price=1.2, on_demand_price=3.9, interruptions_per_hour=0.1, checkpoint_s=30,
                    resume_s=300)  # fmt: skip
    mtbf_s = HOUR / 0.1
    assert plan.interval_s == daly_interval_s(30, mtbf_s)
    assert plan.young_interval_s == young_interval_s(30, mtbf_s)
    spot_s = daly_model_s(200 * HOUR, plan.interval_s, 30, 300, 0.1)
    assert plan.spot_hours == pytest.approx(spot_s / HOUR, rel=1e-12)
    assert plan.spot_cost == pytest.approx(spot_s / HOUR * 1.2, rel=1e-12)
    assert plan.on_demand_cost == 200 * 3.9
    assert plan.expected_interruptions == pytest.approx(spot_s / HOUR * 0.1)
    assert plan.spot_cost_at(plan.interval_s) == pytest.approx(plan.spot_cost)
    assert plan.spot_cost_at(plan.interval_s / 4) > plan.spot_cost < plan.spot_cost_at(plan.interval_s * 4)

    calm = plan_job(200, 1.2, 3.9, 0.0, 30, 300)
    assert (calm.interval_s, calm.spot_hours, calm.spot_cost) == (math.inf, 200, 200 * 1.2)
    same_price = plan_job(10, 2.0, 2.0, 0.1, 30, 300)
    assert same_price.savings < 0 and same_price.break_even_interruptions_per_hour == 0.0


# ------------------------------------------------------------------------------------ records
def test_resume_after_an_emergency_checkpoint_lost_nothing_and_measures_the_downtime():
    record = measure_resume("preemption", 40, committed_at=1000.0, taken_at=995.0, resumed_at=1180.0,
                            pull_s=12.0, load_s=3.0)  # fmt: skip
    assert (record.lost_work_s, record.lost_work_measured, record.downtime_s) == (0.0, True, 180.0)
    assert record.interrupted


def test_resume_after_a_crash_estimates_lost_work_as_a_bound():
    def crash(resumed_at: float, interval_s: float | None):
        return measure_resume("interval", 40, committed_at=1030.0, taken_at=1000.0, resumed_at=resumed_at,
                              pull_s=1.0, load_s=1.0, interval_s=interval_s, persist_s=30.0)  # fmt: skip

    soon = crash(1000.0 + 250, interval_s=600)
    assert (soon.lost_work_s, soon.lost_work_measured, soon.downtime_s) == (250.0, False, None)
    late = crash(1000.0 + 5000, interval_s=600)
    assert late.lost_work_s == 600 + 30  # it would have committed the next checkpoint by then
    assert crash(1000.0 + 5000, interval_s=None).lost_work_s == 5000  # every_n_steps: only the gap bounds it
    assert crash(900.0, interval_s=600).lost_work_s == 0.0  # clock skew: never negative
    finished = measure_resume(
        "end", 40, committed_at=1000.0, taken_at=990.0, resumed_at=9000.0, pull_s=1, load_s=1
    )
    assert not finished.interrupted and finished.lost_work_s == 0 and finished.downtime_s is None


def test_ledger_adds_up_and_survives_json():
    ledger = RunLedger().add_checkpoint("interval", 0.5, 1800.0).add_checkpoint("preemption", 0.25, 2000.0)
    ledger = ledger.add_resume(measure_resume("preemption", 9, 100.0, 99.0, 160.0, pull_s=10.0, load_s=2.0))
    ledger = ledger.add_resume(measure_resume("interval", 12, 300.0, 280.0, 400.0, 8.0, 4.0, interval_s=60))
    ledger = ledger.add_resume(measure_resume("end", 20, 500.0, 499.0, 900.0, 6.0, 3.0))
    assert ledger.checkpoints == {"interval": 1, "preemption": 1} and ledger.stall_s == 0.75
    assert (ledger.resumes, ledger.interruptions) == (3, 2)
    assert (ledger.pull_s, ledger.load_s) == (24.0, 9.0)
    assert (ledger.lost_work_measured_s, ledger.lost_work_estimated_s) == (0.0, 60.0)
    assert (ledger.downtime_s, ledger.downtime_unknown) == (60.0, 1)
    assert ledger.billed_s == 2000.0 + 60.0 + 24.0 + 9.0
    assert ledger.goodput == pytest.approx((2000.0 - 0.75) / ledger.billed_s)
    assert RunLedger.from_json(ledger.to_json()) == ledger
    assert RunLedger.from_json({"version": 99}) is None and RunLedger.from_json("garbage") is None
    assert ResumeRecord.from_json(ledger.recent_resumes[1].to_json()) == ledger.recent_resumes[1]


def test_posterior_rate_moves_from_the_prior_to_the_observed_rate():
    assert posterior_interruptions_per_hour(0, 0) == PRIOR_INTERRUPTIONS_PER_HOUR
    prior_events = PRIOR_INTERRUPTIONS_PER_HOUR * PRIOR_HOURS
    assert posterior_interruptions_per_hour(3, 5.0) == (prior_events + 3) / (PRIOR_HOURS + 5.0)
    assert posterior_interruptions_per_hour(2000, 1000.0) == pytest.approx(2.0, rel=0.01)
    assert posterior_interruptions_per_hour(0, 1000.0) < PRIOR_INTERRUPTIONS_PER_HOUR / 50


def test_slowdown_meter_uses_medians_and_needs_both_kinds_of_steps():
    meter = SlowdownMeter()
    for seconds in (1.0, 1.0, 1.0, 30.0):  # 30 s: a validation epoch, not a slowdown
        meter.observe_step(seconds, persisting=False)
    assert meter.per_checkpoint_s() == 0.0  # no busy step seen yet
    for _ in range(3):
        meter.observe_step(1.2, persisting=True)
    meter.checkpoint_taken()
    assert meter.per_checkpoint_s() == pytest.approx((1.2 - 1.0) * 3)
    for _ in range(5):
        meter.observe_step(0.9, persisting=True)  # now persisting slows nothing: busy median 0.9 s
    meter.checkpoint_taken()
    assert meter.per_checkpoint_s() == 0.0


# ------------------------------------------------------------------------------- interval="auto"
def test_auto_interval_uses_the_median_checkpoint_cost_and_the_configured_rate(caplog):
    trigger = CheckpointTrigger(None, None, auto=True, interruptions_per_hour=2.0, clock=lambda: 0.0)
    with caplog.at_level(logging.INFO, logger="spot_callbacks"):
        for cost in (4.0, 100.0, 6.0):  # one slow outlier
            trigger.mark_checkpoint(cost_s=cost)
    assert trigger.interval_s == pytest.approx(daly_interval_s(6.0, HOUR / 2.0))
    changes = [r.getMessage() for r in caplog.records if "interval='auto'" in r.getMessage()]
    assert len(changes) == 3 and "interruptions_per_hour" in changes[-1]

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="spot_callbacks"):
        for _ in range(5):
            trigger.mark_checkpoint(cost_s=6.0)  # the same interval again: no new line
    assert not [r for r in caplog.records if "interval='auto'" in r.getMessage()]


def test_auto_interval_learns_the_rate_from_the_runs_history_and_is_clamped():
    learned = CheckpointTrigger(None, None, auto=True, interruptions_per_hour=None, clock=lambda: 0.0)
    learned.observe_interruptions(3, 5.0)
    learned.mark_checkpoint(cost_s=20.0)
    rate = posterior_interruptions_per_hour(3, 5.0)
    assert learned.interruption_rate()[0] == rate
    assert learned.interval_s == pytest.approx(daly_interval_s(20.0, HOUR / rate))

    cheap = CheckpointTrigger(None, None, auto=True, interruptions_per_hour=1.0, clock=lambda: 0.0)
    cheap.mark_checkpoint(cost_s=0.001)
    assert cheap.interval_s == AUTO_MIN_INTERVAL_S
    calm = CheckpointTrigger(None, None, auto=True, interruptions_per_hour=0.0, clock=lambda: 0.0)
    calm.mark_checkpoint(cost_s=5.0)
    assert calm.interval_s == AUTO_MAX_INTERVAL_S  # a configured 0 means no interruptions, not "unknown"


# ------------------------------------------------------------------------- the engine's ledger
def engine_on(tmp_path, machine: str, **kw) -> SpotEngine:
    config = SpotConfig(dirpath=str(tmp_path / "run"), scratch_dir=str(tmp_path / f"scratch-{machine}"),
                        preemption=[], **kw)  # fmt: skip
    return SpotEngine(config, framework="test")


def resume(
    engine: SpotEngine, seconds_after_commit: float | None = None, seconds_after_snapshot: float | None = None
):
    """Pull the newest checkpoint and load it, as a run on a fresh machine started at a chosen time."""
    newest = engine.store.latest()
    if seconds_after_commit is not None:
        engine.accounts.created_at = newest.created.timestamp() + seconds_after_commit
    else:
        engine.accounts.created_at = newest.metrics["taken_at"] + seconds_after_snapshot
    engine.start()
    local = engine.pull_latest()
    engine.load_state_dict(torch.load(local / "state.ckpt", weights_only=True)["engine"])
    return newest


def save(engine: SpotEngine, step: int, reason: str) -> float:
    """A checkpoint holding the engine's state, as the adapters take it; returns the seconds blocked."""
    state = {"w": torch.full((256,), float(step)), "engine": engine.state_dict(at_checkpoint=True)}
    return engine.save_state(step, 0, state, reason)


def test_two_preemptions_and_a_crash_are_accounted_from_the_store_alone(tmp_path):
    blocked_s = []
    first = engine_on(tmp_path, "a", interval="10min")
    first.start()
    blocked_s += [save(first, 10, "interval"), save(first, 15, "preemption")]
    first.finish()

    second = engine_on(tmp_path, "b", interval="10min")
    resume(second, seconds_after_commit=120.0)  # a new machine two minutes after the emergency commit
    blocked_s.append(save(second, 20, "preemption"))
    second.finish()

    third = engine_on(tmp_path, "c", interval="10min")
    resume(third, seconds_after_commit=45.0)
    blocked_s.append(save(third, 30, "interval"))
    third.finish()  # then the machine vanishes: no emergency checkpoint

    fourth = engine_on(tmp_path, "d", interval="10min", keep_last=2)
    crashed_from = resume(fourth, seconds_after_snapshot=250.0)
    assert crashed_from.step == 30
    blocked_s.append(save(fourth, 40, "end"))
    fourth.finish()

    committed = fourth.store.committed()
    assert [info.step for info in committed] == [30, 40]  # retention: the ledger remembers the rest
    history = RunHistory.from_checkpoints(fourth.store.url, committed)
    ledger = history.ledger
    assert ledger.checkpoints == {"interval": 2, "preemption": 2, "end": 1}
    assert (history.interruptions, ledger.resumes) == (3, 3)
    assert [(r.from_step, r.from_reason) for r in ledger.recent_resumes] == [
        (15, "preemption"), (20, "preemption"), (30, "interval")
    ]  # fmt: skip
    downtimes = [r.downtime_s for r in ledger.recent_resumes]
    assert downtimes[:2] == [pytest.approx(120.0, abs=0.01), pytest.approx(45.0, abs=0.01)]
    assert downtimes[2] is None
    assert ledger.lost_work_measured_s == 0.0
    assert ledger.lost_work_estimated_s == pytest.approx(250.0, abs=0.01)
    assert all(r.pull_s > 0 and r.load_s >= 0 for r in ledger.recent_resumes)
    # Every stall is in the ledger, those of the checkpoints retention deleted too.
    assert sum(info.metrics["stall_s"] for info in committed) < ledger.stall_s <= sum(blocked_s)
    newest = committed[-1]
    for key in ("stall_s", "write_s", "upload_s", "taken_at", "train_s", "interval_s", "staged_bytes"):
        assert key in newest.metrics, key
    assert newest.metrics["interval_s"] == 600.0
    rows = dict(history_rows(history))
    assert rows["interruptions"].startswith("3 (3 resumed)")
    assert "up to 4.2 min estimated" in rows["lost work"]


def test_training_clock_continues_across_resumes_and_skips_the_pull(tmp_path):
    first = engine_on(tmp_path, "a", interval=None)
    first.start()
    first.accounts.train_started_at -= 100.0  # 100 s of training
    save(first, 5, "preemption")
    first.finish()
    taken = first.store.latest().metrics["train_s"]
    assert 100.0 <= taken < 110.0

    second = engine_on(tmp_path, "b", interval=None)
    resume(second, seconds_after_commit=30.0)
    assert second.train_seconds() == pytest.approx(taken, abs=1.0)  # the downtime is not training
    save(second, 6, "end")
    second.finish()
    assert second.store.latest().extra["ledger"]["train_s"] == pytest.approx(taken, abs=1.0)


def test_cost_summary_fits_on_a_screen_and_counts_this_runs_commits(tmp_path, caplog):
    engine = engine_on(tmp_path, "a", interval="auto", interruptions_per_hour=0.5)
    engine.start()
    for step, reason in ((1, "interval"), (2, "interval"), (3, "interval"), (4, "end")):
        engine.decide(step)
        save(engine, step, reason)
        engine.wait_for_commit()  # none dropped for a newer one: four commits
    engine.finish()
    with caplog.at_level(logging.INFO, logger="spot_callbacks"):
        engine.log_cost_summary()
    (summary,) = [r.getMessage() for r in caplog.records if "checkpoint costs of" in r.getMessage()]
    lines = summary.splitlines()
    assert lines[0] == f"spot_callbacks: checkpoint costs of {engine.store.url}"
    assert len(lines) <= 15 and max(len(line) for line in lines) <= 120
    labels = [line.split("  ")[1].strip() for line in lines[1:]]
    assert labels[:3] == ["checkpoints", "training time", "training stall"]
    assert "4 taken (3 interval, 1 end)" in lines[1]
    assert "over 4 committed by this run" in summary and "interruptions" in summary
    assert "(auto, for 0.5 interruptions/h)" in lines[-1]


def test_a_ledger_or_resume_record_with_a_huge_integer_is_unknown_not_an_exception() -> None:
    """Issue 31: a store-supplied ``10**400`` made ``math.isfinite`` raise OverflowError while reading a ledger."""
    ledger = RunLedger.from_json({"version": 1, "stall_s": 10**400, "train_s": 10**400, "resumes": 10**30})
    assert ledger is not None and ledger.stall_s == 0.0 and ledger.train_s == 0.0 and ledger.resumes == 0
    record = {"resumed_at": 10**400, "pull_s": 1.0, "load_s": 1.0, "lost_work_s": 1.0}
    record |= {"from_step": 3, "from_reason": "interval", "lost_work_measured": True, "downtime_s": None}
    assert ResumeRecord.from_json(record) is None
