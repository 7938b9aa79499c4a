"""The staleness alarm (spot_callbacks/staleness.py) fed by a real engine over a fault-injecting store."""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.faultfs import FaultyFileSystem
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

from spot_callbacks import SpotConfig
from spot_callbacks._format import duration_setting
from spot_callbacks.accounting.staleness import StalenessMonitor
from spot_callbacks.engine import SpotEngine
from spot_callbacks.errors import PersistError
from spot_callbacks.lightning import SpotCheckpoint
from spot_callbacks.persist import PersistRecord
from spot_callbacks.store import CheckpointInfo

INTERVAL_S = 60.0


class Clock:
    """A clock the test advances by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def engine_with_clock(
    tmp_path: Path, interval: float | str = INTERVAL_S
) -> tuple[SpotEngine, FaultyFileSystem, Clock]:
    config = SpotConfig(
        dirpath=str(tmp_path / "run"),
        scratch_dir=str(tmp_path / "scratch"),
        interval=interval,
        preemption=[],
    )
    engine = SpotEngine(config, framework="test")
    clock = Clock()
    engine.watch.staleness = StalenessMonitor(engine.store.url, clock=clock)
    faulty = FaultyFileSystem(engine.store.fs)
    engine.store.fs = faulty
    return engine, faulty, clock


def stale_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "no checkpoint has committed" in r.getMessage()]


def save(engine: SpotEngine, step: int) -> None:
    engine.save_state(step, 0, {"w": torch.full((64,), float(step))}, reason="interval")


def test_failing_uploads_warn_once_per_episode_naming_the_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPOT_STRICT", "1")  # every failed checkpoint fails the end, not only the newest
    caplog.set_level(logging.WARNING, logger="spot_callbacks")
    engine, faulty, clock = engine_with_clock(tmp_path)
    engine.start()
    save(engine, 1)
    assert engine.wait_for_commit(timeout=30)
    clock.now += 30
    engine.decide(2)  # sees the commit of step 1: the lag restarts here
    assert engine.persist_lag_s() == 0.0

    faulty.permanent = True
    save(engine, 3)
    engine.wait_for_commit(timeout=30)  # settles as failed
    clock.now += 2 * INTERVAL_S - 1
    engine.decide(4)
    assert stale_warnings(caplog) == []  # not yet two intervals
    clock.now += 2
    engine.decide(5)
    clock.now += 500
    engine.decide(6)
    warnings = stale_warnings(caplog)
    assert len(warnings) == 1, warnings  # once per episode, not every step
    assert "uploads are failing" in warnings[0] and "PermissionError" in warnings[0]
    assert "step 3" in warnings[0] and "(step 1) is the resume point" in warnings[0]
    assert "interval=" in warnings[0]
    assert engine.persist_lag_s() == pytest.approx(2 * INTERVAL_S + 1 + 500)

    faulty.permanent = False  # storage recovers: a commit ends the episode
    save(engine, 7)
    assert engine.wait_for_commit(timeout=30)
    engine.decide(8)
    assert engine.persist_lag_s() == 0.0
    clock.now += 2 * INTERVAL_S
    engine.decide(9)  # a new episode: warned again (no new failure: taking checkpoints is the cause)
    assert len(stale_warnings(caplog)) == 2
    with pytest.raises(PersistError):
        engine.finish()


def test_uploads_slower_than_the_interval_warn_with_the_persist_time_and_a_longer_interval(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="spot_callbacks")
    engine, faulty, clock = engine_with_clock(tmp_path)
    engine.start()
    faulty.gate = threading.Event()  # after the start: the preflight's probe is not held
    try:
        save(engine, 1)
        assert faulty.held.wait(timeout=30)  # step 1 is uploading, held at the gate
        engine.decide(2)  # the engine sees the upload in flight from here
        clock.now += 2 * INTERVAL_S + 30
        engine.decide(3)
        engine.decide(4)
    finally:
        faulty.gate.set()
        engine.finish()
    warnings = stale_warnings(caplog)
    assert len(warnings) == 1, warnings
    persist_s = 2 * INTERVAL_S + 30
    assert (
        "uploads take 2.5 min, longer than the interval 1.0 min: raise the interval or use interval='auto'"
        in (warnings[0])
    )
    assert "the upload of step 1 has run for 2.5 min" in warnings[0]
    assert duration_setting(persist_s * 1.5) == "4min" and "interval='4min', 1.5x" in warnings[0]
    assert "nothing this run did is committed yet" in warnings[0]


def test_an_upload_in_flight_is_never_called_checkpoints_not_being_taken(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 23: two intervals without a commit while the first upload (slower than the interval) ran
    said "the measured persist time fits the interval. The checkpoints are not being taken"."""
    caplog.set_level(logging.WARNING, logger="spot_callbacks")
    engine, faulty, clock = engine_with_clock(tmp_path)
    engine.start()
    faulty.gate = threading.Event()
    try:
        clock.now += INTERVAL_S + 10  # the first checkpoint, at its interval
        save(engine, 1)
        assert faulty.held.wait(timeout=30)
        engine.decide(2)  # its upload is seen in flight from here
        clock.now += INTERVAL_S - 9  # two intervals without a commit; the upload has run 51 s < 60 s
        engine.decide(3)
        assert stale_warnings(caplog) == []  # on its way: not "the checkpoints are not being taken"
        clock.now += 15  # it outruns the interval
        engine.decide(4)
    finally:
        faulty.gate.set()
        engine.finish()
    [warning] = stale_warnings(caplog)
    assert "not being taken" not in warning
    assert (
        "uploads take 1.1 min, longer than the interval 1.0 min: raise the interval or use interval='auto'"
        in warning
    )
    assert "the upload of step 1 has run for 1.1 min" in warning


def test_checkpoints_dropped_for_newer_ones_mean_uploads_are_too_slow_said_once_in_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="spot_callbacks")  # later drops: per-checkpoint lines
    engine, faulty, clock = engine_with_clock(tmp_path)
    engine.start()
    faulty.gate = threading.Event()
    try:
        save(engine, 1)
        assert faulty.held.wait(timeout=30)  # step 1 uploads, slowly; no step boundary sees it
        save(engine, 2)
        save(engine, 3)  # 2 was queued: dropped for 3
        save(engine, 4)  # 3 was queued: dropped for 4
        persister = engine.saves.persister
        assert persister is not None and not persister.wait_for_step(3, timeout=30)
        assert persister.dropped_for_newer == 2
        clock.now += 2 * INTERVAL_S + 5
        engine.decide(5)  # the upload of step 1 is first seen now: in flight for 0 s by this clock
    finally:
        faulty.gate.set()
        engine.finish()
    [warning] = stale_warnings(caplog)
    assert "not being taken" not in warning
    assert (
        "uploads take longer than the interval 1.0 min: raise the interval or use interval='auto'" in warning
    )
    assert "2 checkpoints dropped before upload because a newer one came" in warning
    drops = [r.getMessage() for r in caplog.records if "before upload: step" in r.getMessage()]
    assert [line.split(": ", 1)[1].split(";")[0] for line in drops] == [
        "dropping checkpoint of step 2 before upload: step 3 is newer",
        "dropping checkpoint of step 3 before upload: step 4 is newer",
    ]
    assert (
        "raise the interval or use interval='auto'" in drops[0] and "the upload of step 1 has run" in drops[0]
    )
    assert "interval" not in drops[1]  # the advice once, not per drop


def test_a_drop_for_a_newer_checkpoint_with_interval_auto_never_says_use_auto(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="spot_callbacks")
    engine, faulty, _clock = engine_with_clock(tmp_path, "auto")
    engine.start()
    faulty.gate = threading.Event()
    try:
        save(engine, 1)
        assert faulty.held.wait(timeout=30)  # step 1 uploads, held at the gate
        save(engine, 2)
        save(engine, 3)  # 2 was queued: dropped for 3
        persister = engine.saves.persister
        assert persister is not None and not persister.wait_for_step(2, timeout=30)
    finally:
        faulty.gate.set()
        engine.finish()
    [drop] = [r.getMessage() for r in caplog.records if "before upload: step" in r.getMessage()]
    assert "use interval='auto'" not in drop
    assert drop.endswith(
        "interval='auto' sizes the interval by the training stall, not the upload: set a fixed interval "
        "above the upload time, or a faster store"
    ), drop


@pytest.mark.parametrize("interval", [INTERVAL_S, "auto"])
def test_slow_uploads_advice_fits_the_interval_setting_and_never_says_use_auto_when_auto_is_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, interval: float | str
) -> None:
    """Issue 23: with interval='auto' already on, the warning said "raise the interval or use
    interval='auto'". It must say what auto chose and what does lengthen it."""
    caplog.set_level(logging.WARNING, logger="spot_callbacks")
    engine, faulty, clock = engine_with_clock(tmp_path, interval)
    engine.start()
    save(engine, 1)  # a cheap checkpoint: "auto" measures its cost and goes to its floor
    assert engine.wait_for_commit(timeout=30)
    engine.decide(2)
    assert engine.trigger.interval_s == INTERVAL_S
    faulty.gate = threading.Event()
    try:
        save(engine, 3)
        assert faulty.held.wait(timeout=30)  # step 3 uploads, held at the gate
        engine.decide(4)
        clock.now += 2 * INTERVAL_S + 30
        engine.decide(5)
    finally:
        faulty.gate.set()
        engine.finish()
    [warning] = stale_warnings(caplog)
    assert "uploads take 2.5 min, longer than the interval 1.0 min: " in warning
    assert "the upload of step 3 has run for 2.5 min" in warning
    if interval == "auto":
        assert "use interval='auto'" not in warning
        assert (
            "interval='auto' chose 1.0 min, its floor (Daly's optimum is shorter), from a checkpoint cost of "
            in warning
        )
        assert "0.1 interruptions/h from 0 interruptions in 0.0 h of this run" in warning
        assert "slow uploads do not lengthen it" in warning
        assert (
            "set a fixed interval instead of 'auto' (e.g. interval='4min', 1.5x the measured persist time)"
            in (warning)
        )
        assert "a lower interruptions_per_hour" in warning
    else:
        assert "raise the interval or use interval='auto' (e.g. interval='4min', 1.5x" in warning
        assert "chose" not in warning


def test_failing_uploads_with_interval_auto_say_keep_auto_not_a_fixed_interval() -> None:
    clock = Clock()
    chose = "interval='auto' chose 1.0 min, its floor (...)"
    failure = PersistError(3, "s3://bucket/run/step-000000003", PermissionError("denied"), None)
    warnings = {}
    for setting, auto_choice in (("fixed", None), ("auto", lambda: chose)):
        monitor = StalenessMonitor("s3://bucket/run", clock=clock)
        monitor.start()
        clock.now += 2 * INTERVAL_S
        warnings[setting] = monitor.observe([], [failure], None, INTERVAL_S, auto_choice=auto_choice)
    assert "uploads are failing" in warnings["auto"] and "keep interval='auto'" in warnings["auto"]
    assert "suggested interval" not in warnings["auto"]
    assert "suggested interval='60s'" in warnings["fixed"] and "'auto'" not in warnings["fixed"]


def test_the_lightning_adapter_logs_the_persist_lag_at_each_checkpoint(tmp_path: Path) -> None:
    spot = SpotCheckpoint(dirpath=str(tmp_path / "run"), interval=None, every_n_steps=2, preemption=[])
    trainer = pl.Trainer(
        callbacks=[spot],
        max_steps=6,
        logger=CSVLogger(str(tmp_path / "logs")),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BoringModel())
    lags: list[float] = []
    for metrics in (tmp_path / "logs").rglob("metrics.csv"):
        header, *rows = [line.split(",") for line in metrics.read_text().splitlines()]
        column = header.index("spot/persist_lag_s")
        lags += [float(row[column]) for row in rows if len(row) > column and row[column]]
    assert len(lags) == 3 and all(lag >= 0 for lag in lags)  # steps 2, 4, 6


class GrowsWhileRead(list):  # type: ignore[type-arg]
    """The persister's records, to which its thread appends a commit just after the monitor sliced them."""

    def __init__(self, late: list[PersistRecord]) -> None:
        super().__init__()
        self.late = late

    def __getitem__(self, index: Any) -> Any:
        got = super().__getitem__(index)
        if isinstance(index, slice) and self.late:
            self.append(self.late.pop())
        return got


def committed(step: int) -> PersistRecord:
    info = CheckpointInfo(
        step, f"memory://run/step-{step}", datetime.now(timezone.utc), "interval", 8, "demo"
    )
    return PersistRecord(info, write_s=0.1, upload_s=0.2, bytes=8, queued_s=0.0)


def test_a_commit_appended_while_the_monitor_reads_is_seen_at_the_next_step() -> None:
    """Each step boundary reads the persister's own list (no copy): a commit appended between the
    monitor's slice and its count is read at the next boundary, not skipped as seen."""
    clock = Clock()
    monitor = StalenessMonitor("memory://run", clock=clock)
    monitor.start()
    records = GrowsWhileRead([committed(5)])
    clock.now += 30
    monitor.observe(records, [], None, INTERVAL_S)  # the commit lands just after the slice
    assert monitor.lag_s() == 30.0
    clock.now += 10
    monitor.observe(records, [], None, INTERVAL_S)
    assert monitor.lag_s() == 0.0  # seen now: the lag counts from this boundary


def test_step_boundaries_read_the_commits_without_copying_them(tmp_path: Path) -> None:
    engine, _, _ = engine_with_clock(tmp_path)
    engine.start()
    assert engine.new_records() == []
    save(engine, 1)
    assert engine.wait_for_commit(timeout=30)
    persister = engine.saves.persister
    assert persister is not None
    assert engine.saves.records_view() is persister.records  # one persister: its list itself
    assert [record.info.step for record in engine.new_records()] == [1]
    assert engine.new_records() == []  # returned once
    engine.decide(2)
    assert engine.persist_lag_s() == 0.0
    engine.finish()
