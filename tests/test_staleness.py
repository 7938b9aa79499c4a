"""The staleness alarm (spot_callbacks/staleness.py) fed by a real engine over a fault-injecting store."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers.faultfs import FaultyFileSystem
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

from spot_callbacks import SpotConfig
from spot_callbacks.accounting.staleness import StalenessMonitor, duration_setting
from spot_callbacks.engine import SpotEngine
from spot_callbacks.errors import PersistError
from spot_callbacks.lightning import SpotCheckpoint

INTERVAL_S = 60.0


class Clock:
    """A clock the test advances by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def engine_with_clock(tmp_path: Path) -> tuple[SpotEngine, FaultyFileSystem, Clock]:
    config = SpotConfig(
        dirpath=str(tmp_path / "run"),
        scratch_dir=str(tmp_path / "scratch"),
        interval=INTERVAL_S,
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
    assert "persisting is slower than the interval" in warnings[0]
    assert "the upload of step 1 has run for 2.5 min" in warnings[0]
    assert duration_setting(persist_s * 1.5) == "4min" and "interval='4min' (1.5x" in warnings[0]
    assert "nothing this run did is committed yet" in warnings[0]


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
