"""trigger/rules.py, preemption/emergency.py and resume.py's move-aside: the rules, without a trainer."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from spot_callbacks.preemption import Notice, PreemptionWatcher
from spot_callbacks.preemption.emergency import EXIT_MARGIN_S, Emergency, time_left_s
from spot_callbacks.resume import move_aside_uncommitted
from spot_callbacks.trigger import rules

QUIET = {"notice": None, "hint": None, "interval_due": False, "steps_due": False}


def test_priority_is_preemption_then_hint_then_interval_then_steps():
    notice = Notice("aws", time.time() + 60)
    everything = {"notice": notice, "hint": "rebalance", "interval_due": True, "steps_due": True}
    assert rules.decide(5, last_saved_step=None, **everything).act is rules.Act.EMERGENCY
    hinted = rules.decide(5, last_saved_step=None, **{**everything, "notice": None})
    assert (hinted.reason, hinted.warning) == (
        "interval",
        "checkpointing step 5 now (reason 'interval'): rebalance",
    )
    assert rules.decide(
        5, last_saved_step=None, **{**QUIET, "interval_due": True, "steps_due": True}
    ).reason == ("interval")
    assert rules.decide(5, last_saved_step=None, **{**QUIET, "steps_due": True}).reason == "steps"
    nothing = rules.decide(5, last_saved_step=None, **QUIET)
    assert nothing.act is rules.Act.NOTHING and not nothing.save and nothing.reason is None


def test_never_the_same_step_twice_but_an_emergency_still_waits_and_stops():
    due = {**QUIET, "interval_due": True, "steps_due": True, "hint": "rebalance"}
    assert not rules.decide(7, last_saved_step=7, **due).save
    emergency = rules.decide(7, last_saved_step=7, **{**QUIET, "notice": Notice("SIGTERM", None)})
    assert emergency.emergency and emergency.already_saved and not emergency.save
    fresh = rules.decide(8, last_saved_step=7, **{**QUIET, "notice": Notice("SIGTERM", None)})
    assert fresh.emergency and fresh.save and fresh.reason == "preemption"


def test_end_save_only_for_a_step_without_a_checkpoint():
    assert rules.end_reason(10, None) == "end"
    assert rules.end_reason(10, 9) == "end"
    assert rules.end_reason(10, 10) is None


@pytest.mark.parametrize(
    ("between_batches", "step", "last", "saves"),
    [
        (True, 5, None, True),
        (True, 5, 3, True),
        (True, 3, 3, False),
        (True, 2, 3, False),
        (False, 5, 3, False),
    ],
)
def test_save_on_exception_only_between_batches_and_past_the_resumed_step(between_batches, step, last, saves):
    action = rules.on_exception(
        "ValueError",
        late_signal=False,
        preempted=False,
        between_batches=between_batches,
        step=step,
        last_saved_step=last,
    )
    assert action.save is saves and not action.preempted
    assert (action.warning is not None) is (not between_batches)


def test_a_late_signal_takes_no_checkpoint_and_counts_as_preempted():
    late = rules.on_exception(
        "SIGTERMException", late_signal=True, preempted=False, between_batches=True, step=9, last_saved_step=6
    )
    assert not late.save and late.preempted and "(step 6) is the resume point" in late.warning
    after_emergency = rules.on_exception(
        "SIGTERMException", late_signal=True, preempted=True, between_batches=True, step=9, last_saved_step=9
    )
    assert after_emergency.preempted and after_emergency.warning is None


def test_stop_or_continue_after_an_emergency_and_the_failure_line():
    assert rules.after_emergency("stop") is rules.AfterEmergency.STOP
    assert rules.after_emergency("continue") is rules.AfterEmergency.CONTINUE
    assert (
        rules.failure_line(OSError("gone"))
        == "gone; training continues, the last committed checkpoint stands"
    )


def test_the_emergency_deadline_keeps_a_margin_and_only_preemption_checkpoints_carry_it():
    watcher = PreemptionWatcher([])
    emergency = Emergency(watcher)
    assert emergency.active_notice() is None and emergency.deadline("preemption") is None
    notice = Notice("aws", time.time() + 30, "terminate")
    watcher.report(notice)
    emergency.agree(notice)
    assert emergency.deadline("preemption") == notice.deadline - EXIT_MARGIN_S
    assert emergency.deadline("interval") is None and emergency.manifest_extra("interval") == {}
    assert emergency.manifest_extra("preemption")["preemption"]["source"] == "aws"
    assert time_left_s(notice, 5.0) == 5.0 and time_left_s(Notice("x", time.time() - 10)) == 0.0
    watcher.clear()  # training went on after the emergency: the notice is spent
    assert emergency.active_notice() is None and emergency.deadline("preemption") is None


def test_local_folders_newer_than_the_resume_are_moved_aside_with_one_line_each(tmp_path: Path, caplog):
    for step in (10, 20, 30):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / ".aside-checkpoint-30").mkdir()  # taken by an earlier resume
    found = [(step, tmp_path / f"checkpoint-{step}") for step in (10, 20, 30)]
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        moved = move_aside_uncommitted(found, 20, lambda f: f.with_name(f".aside-{f.name}"))
    assert [p.name.startswith(".aside-checkpoint-30-") for p in moved] == [True]
    assert (tmp_path / "checkpoint-10").is_dir() and (tmp_path / "checkpoint-20").is_dir()
    assert not (tmp_path / "checkpoint-30").exists()
    assert len([r for r in caplog.records if "never committed" in r.getMessage()]) == 1
