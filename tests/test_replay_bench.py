"""The goodput replay benchmark's own arithmetic: its schedules and its outcome table (no training here)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import _replay_outcome as outcome  # noqa: E402
import _replay_schedule as schedule  # noqa: E402


def test_a_poisson_schedule_is_the_same_for_the_same_seed_and_differs_for_another() -> None:
    first = schedule.poisson_schedule("gt20", month_s=20.0, seed=7)
    assert first == schedule.poisson_schedule("gt20", month_s=20.0, seed=7)
    assert first != schedule.poisson_schedule("gt20", month_s=20.0, seed=8)
    assert first != schedule.poisson_schedule("lt5", month_s=20.0, seed=7)


def test_poisson_times_are_positive_and_their_mean_follows_the_band() -> None:
    # 20 s per month, the >20 % band (25 % a month): one interruption per 69.5 s on average.
    interruptions = schedule.poisson_schedule(
        "gt20", 20.0, seed=1, notice_share=0.5, grace_s=5.0, max_attempts=4000
    )
    assert len(interruptions) == 4000
    times = [i.at_s for i in interruptions if i is not None]
    assert all(t > 0 for t in times)
    expected_mean = 20.0 / -math.log(0.75)
    assert expected_mean == pytest.approx(69.52, abs=0.01)
    assert sum(times) / len(times) == pytest.approx(expected_mean, rel=0.06)
    notices = sum(1 for i in interruptions if i is not None and i.notice)
    assert 0.45 < notices / len(interruptions) < 0.55
    assert (
        schedule.rate_per_s("lt5", 20.0)
        < schedule.rate_per_s("5-10", 20.0)
        < schedule.rate_per_s("gt20", 20.0)
    )


def test_a_notice_is_sigterm_then_sigkill_after_the_grace_and_a_hard_kill_is_sigkill_alone() -> None:
    fixed = schedule.fixed_schedule(grace_s=5.0)
    assert [i.signals() for i in fixed if i is not None] == [
        [(35.0, "SIGTERM"), (40.0, "SIGKILL")],
        [(55.0, "SIGKILL")],
        [(70.0, "SIGTERM"), (75.0, "SIGKILL")],
    ]
    assert [i.at_s for i in schedule.fixed_schedule(scale=0.5) if i is not None] == [17.5, 27.5, 35.0]
    assert schedule.interruption_for(fixed, 3) is None


def attempt(
    spawned: float, exited: float, steps: range, done: bool = False, cut: str = "SIGKILL@1s"
) -> outcome.Attempt:
    """An attempt that trained ``steps``, one step per 0.1 s from 2 s after its spawn."""
    records = [(step, spawned + 2.0 + 0.1 * n) for n, step in enumerate(steps)]
    return outcome.Attempt(spawned, exited, 0 if done else -9, "-" if done else cut, records, done)


def test_the_outcome_of_a_synthetic_record_is_computed_right() -> None:
    baseline = attempt(0.0, 12.0, range(1, 101), done=True)  # 100 steps at 0.1 s, 12 s spawn to exit
    attempts = [
        attempt(100.0, 105.0, range(1, 31)),  # trained 1..30, killed
        attempt(108.0, 109.0, range(0)),  # killed during start-up: trained nothing
        attempt(112.0, 118.0, range(21, 51)),  # resumed at 20: redoes 21..30
        attempt(121.0, 130.0, range(51, 101), done=True),  # resumed at 50 (a notice: nothing lost)
    ]
    result = outcome.Outcome("spot", "fixed", attempts, baseline.billed_s, outcome.per_step_s(baseline), 100)
    assert result.step_s == pytest.approx(0.1)
    assert result.billed_s == pytest.approx(5 + 1 + 6 + 9)
    assert result.goodput == pytest.approx(12.0 / 21.0)
    assert result.useful_share == pytest.approx(100 * 0.1 / 21.0)
    assert result.lost_steps == [0, 10, 0]
    assert result.lost_s == pytest.approx([0.0, 1.0, 0.0])
    # the killed machine ran at the baseline's speed: the same seconds either way
    assert result.lost_own_s == pytest.approx([0.0, 1.0, 0.0])
    assert (
        sum(result.lost_steps) == result.steps_trained - result.total_steps
    )  # every step redone, counted once
    assert result.restart_downtimes_s == pytest.approx([2.0, 2.0])
    assert result.interruptions == 3 and result.finished


def test_lost_time_at_own_speed_prices_the_redone_steps_at_the_killed_machines_speed() -> None:
    slow = outcome.Attempt(
        0.0, 9.0, -9, "SIGKILL@9s", [(step, 2.0 + 0.2 * n) for n, step in enumerate(range(1, 31))]
    )
    attempts = [slow, attempt(12.0, 30.0, range(21, 101), done=True)]  # resumed at 20: redoes 21..30
    result = outcome.Outcome("spot", "fixed", attempts, 12.0, 0.1, 100)
    assert result.lost_steps == [10]
    assert result.lost_s == pytest.approx([1.0])  # at the uninterrupted run's 0.1 s per step
    assert result.lost_own_s == pytest.approx([2.0])  # what the killed machine spent on them: 10 x 0.2 s


def test_restarts_from_scratch_lose_everything_trained_before() -> None:
    attempts = [
        attempt(0, 10, range(1, 61)),
        attempt(13, 20, range(1, 41)),
        attempt(23, 40, range(1, 101), True),
    ]
    lost = outcome.lost_steps(attempts)
    assert lost == [60, 40]
    assert sum(lost) == sum(len(a.steps) for a in attempts) - 100


def test_markers_are_parsed_and_a_line_cut_by_a_kill_is_ignored() -> None:
    lines = [
        "REPLAY SPAWNED 1.5",
        "noise",
        "REPLAY STEP 1 2.0",
        "REPLAY STEP 2 2.5",
        "REPLAY STEP 3 2.",
        "REPLAY STEP 4",
    ]
    assert outcome.parse_markers(lines) == ([(1, 2.0), (2, 2.5), (3, 2.0)], False)
    assert outcome.parse_markers([*lines, "REPLAY DONE 4 3.0"])[1] is True
    assert outcome.parse_markers(["REPLAY STEP x 1.0"]) == ([], False)


def test_every_variant_run_lies_between_two_baselines_and_is_measured_against_their_mean() -> None:
    order = outcome.interleaved(["spot", "mc", "none", "spot-auto", "hf"], 2)
    assert order == [None, "spot", "mc", None, "none", "spot-auto", None, "hf", None]
    assert outcome.interleaved(["spot"], 5) == [None, "spot", None]
    assert outcome.interleaved(["a", "b"], 0) == [None, "a", None, "b", None]  # 0 means after each
    fast = attempt(0.0, 12.0, range(1, 101), done=True)  # 0.1 s per step
    slow = attempt(
        0.0, 22.0, range(1, 51), done=True
    )  # 22 s spawn to exit; renumbered below: 0.05 s per step
    slow.steps[:] = [(step * 2, t) for step, t in slow.steps]
    assert outcome.around([slow, fast]) == pytest.approx((17.0, 0.075))
    with pytest.raises(ValueError, match="no baseline"):
        outcome.around([])


def test_the_start_up_inside_fit_is_split_from_the_imports_by_the_ready_marker() -> None:
    lines = ["REPLAY SPAWNED 100.0", "REPLAY READY 109.5", "REPLAY STEP 1 110.25", "REPLAY READY x"]
    assert outcome.ready_at(lines) == 109.5 and outcome.ready_at(["REPLAY READY"]) is None
    first = attempt(90.0, 99.0, range(1, 11))
    resumed = outcome.Attempt(
        100.0, 120.0, 0, "-", outcome.parse_markers(lines)[0], True, outcome.ready_at(lines)
    )
    never_ready = outcome.Attempt(130.0, 131.0, -9, "SIGKILL@1s", [], False, None)
    assert resumed.startup_s == pytest.approx(10.25) and resumed.in_fit_s == pytest.approx(0.75)
    result = outcome.Outcome("spot", "fixed", [first, never_ready, resumed], 20.0, 0.1, 10)
    assert result.restart_downtimes_s == pytest.approx([10.25]) and result.restart_in_fit_s == pytest.approx(
        [0.75]
    )


def test_the_kept_share_times_only_the_steps_no_later_attempt_redid_at_their_own_speed() -> None:
    attempts = [
        attempt(0.0, 10.0, range(1, 31)),  # 1..30 at 0.1 s; the next resumes at 21: 1..20 kept, 2.0 s
        attempt(12.0, 14.0, range(0)),  # killed during start-up
        attempt(16.0, 26.0, range(21, 61), done=True),  # 21..60 kept, 4.0 s
    ]
    result = outcome.Outcome("spot", "fixed", attempts, 10.0, 0.1, 60)
    assert result.kept_training_s == pytest.approx(2.0 + 4.0)
    assert result.kept_share == pytest.approx(6.0 / (10 + 2 + 10))


def test_abba_reverses_the_variants_order_every_other_round_and_runs_each_once_per_round() -> None:
    order = outcome.round_order(["a", "b", "c"], 3, abba=True)
    assert [v for _, v in order] == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert [r for r, _ in order] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    plain = outcome.round_order(["a", "b"], 2, abba=False)
    assert [v for _, v in plain] == ["a", "b", "a", "b"]
    assert outcome.round_order(["a", "b"], 0, abba=True) == [(0, "a"), (0, "b")]  # at least one round
