"""Flaky storage and disks end to end: 30% of writes fail transiently, a write hangs, scratch is full."""

from __future__ import annotations

import errno
import logging
import posixpath
import threading
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers.faultfs import FaultyFileSystem
from helpers.reliability_counts import FAULTS, record
from lightning.pytorch.demos.boring_classes import BoringModel

from spot_callbacks import CheckpointStore, PersistError, SpotConfig, load_state
from spot_callbacks.engine import STATE_FILE, SpotEngine
from spot_callbacks.lightning import SpotCheckpoint
from spot_callbacks.store import MANIFEST_NAME, step_dirname
from spot_callbacks.store.retry import RetryPolicy, UploadTimeout
from spot_callbacks.trigger.rules import STRICT_ENV

# 0.3**10: one operation in ~170,000 exhausts its retries; the test makes ~100.
PATIENT_RETRY = RetryPolicy(attempts=10, initial_backoff_s=0.001, max_backoff_s=0.01)
CHECKPOINTS = 15


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_with_30_percent_transient_write_failures_every_checkpoint_lands(backend, tmp_path, request) -> None:
    if backend == "file":
        url, options = str(tmp_path / "run"), {}
    else:
        info = request.getfixturevalue("s3_server")
        url, options = f"s3://{info.bucket}/flaky-{tmp_path.name}", dict(info.storage_options)
    config = SpotConfig(dirpath=url, interval=None, preemption=[], keep_last=0, storage_options=options,
                        scratch_dir=str(tmp_path / "scratch"))  # fmt: skip
    engine = SpotEngine(config, "test")
    faulty = FaultyFileSystem(engine.store.fs, failure_rate=0.3, seed=3)
    engine.store.fs, engine.store.retry = faulty, PATIENT_RETRY
    engine.start()
    weights = torch.zeros(64)
    for step in range(1, CHECKPOINTS + 1):
        weights += 1
        engine.save_state(step=step, epoch=0, state={"w": weights}, reason="steps")
        assert engine.wait_for_commit(timeout=120)  # each one lands before the next: none superseded
        assert engine.new_failures() == []
    engine.finish()
    store = CheckpointStore(url, storage_options=options)
    assert [info.step for info in store.committed()] == list(range(1, CHECKPOINTS + 1))
    assert all(store.verify(step) for step in range(1, CHECKPOINTS + 1))
    writes = len(faulty.calls)
    print(f"\nflaky {backend}: {faulty.injected} transient failures injected in {writes} writes, "
          f"{CHECKPOINTS}/{CHECKPOINTS} checkpoints landed")  # fmt: skip
    assert faulty.injected >= 0.15 * writes and faulty.injected >= 5
    record(FAULTS, faulty.injected)


def test_an_empty_step_folder_that_sorts_last_is_ignored(tmp_path) -> None:
    url = str(tmp_path / "run")
    engine = SpotEngine(SpotConfig(dirpath=url, interval=None, preemption=[]), "test")
    engine.start()
    engine.save_state(step=5, epoch=0, state={"w": torch.ones(3)}, reason="steps")
    engine.finish()
    (tmp_path / "run" / step_dirname(999999999)).mkdir()  # no files at all, sorts after every real step
    store = CheckpointStore(url)
    assert 999999999 in store.step_folders()
    assert store.latest().step == 5 and [info.step for info in store.committed()] == [5]
    resumed = SpotEngine(
        SpotConfig(dirpath=url, interval=None, preemption=[], scratch_dir=str(tmp_path / "s")), "test"
    )
    local = resumed.pull_latest()
    assert local is not None and resumed.resumed.info.step == 5


def _run_folder(backend: str, tmp_path, request, name: str) -> tuple[str, dict]:
    if backend == "file":
        return str(tmp_path / "run"), {}
    info = request.getfixturevalue("s3_server")
    return f"s3://{info.bucket}/{name}-{tmp_path.name}", dict(info.storage_options)


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_a_hung_upload_times_out_is_retried_and_the_checkpoint_commits(
    backend, tmp_path, request, monkeypatch, caplog
) -> None:
    url, options = _run_folder(backend, tmp_path, request, "hung")
    monkeypatch.setenv("SPOT_UPLOAD_TIMEOUT_S", "2")  # through the environment, as a user would
    config = SpotConfig(dirpath=url, interval=None, preemption=[], storage_options=options,
                        scratch_dir=str(tmp_path / "scratch"))  # fmt: skip
    engine = SpotEngine(config, "test")
    assert engine.store.upload_timeout.floor_s == 2.0
    faulty = FaultyFileSystem(engine.store.fs)
    # The first upload of the state file never returns until the test opens the gate.
    faulty.gate, faulty.gate_only, faulty.hang_first = threading.Event(), STATE_FILE, 1
    engine.store.fs = faulty
    engine.store.retry = RetryPolicy(attempts=5, initial_backoff_s=0.01, max_backoff_s=0.05)
    weights = torch.arange(5000, dtype=torch.float32)
    engine.start()
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        engine.save_state(step=1, epoch=0, state={"w": weights}, reason="steps")
        assert engine.wait_for_commit(timeout=120)
    try:
        assert engine.new_failures() == []
        assert faulty.held.is_set() and faulty.injected == 1
        retried = [r.getMessage() for r in caplog.records if "did not finish within 2.0s" in r.getMessage()]
        assert retried and "attempt 1 of 5" in retried[0] and step_dirname(1) in retried[0]
        store = CheckpointStore(url, storage_options=options)
        assert store.latest().step == 1 and store.verify(1)
        manifest = store.fs.cat_file(posixpath.join(store.step_path(1), MANIFEST_NAME))
    finally:
        faulty.gate.set()  # the abandoned attempt wakes up and writes, after the commit
    assert faulty.held_writes_done.wait(timeout=60)
    for attempt in [t for t in threading.enumerate() if t.name == "spot-attempt"]:
        attempt.join(timeout=60)  # the abandoned attempt has finished whatever it does after the put
    engine.finish()
    # The late write changed nothing: same manifest, every byte still matches it.
    assert store.fs.cat_file(posixpath.join(store.step_path(1), MANIFEST_NAME)) == manifest
    assert store.verify(1)
    pulled = store.pull(1, tmp_path / "pulled")
    assert torch.equal(load_state(pulled / STATE_FILE)["w"], weights)
    record(FAULTS, faulty.injected)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "ten",
            "SPOT_UPLOAD_TIMEOUT_S='ten' is not a duration; use e.g. '90', '90s', '2min' or '1h', or 0/off for no limit",
        ),
        ("-5", "SPOT_UPLOAD_TIMEOUT_S='-5'"),
    ],
)
def test_a_bad_upload_timeout_in_the_environment_is_an_error_naming_it(monkeypatch, tmp_path, value, message):
    monkeypatch.setenv("SPOT_UPLOAD_TIMEOUT_S", value)
    with pytest.raises(ValueError, match=message):
        CheckpointStore(str(tmp_path / "run"))
    monkeypatch.setenv("SPOT_UPLOAD_TIMEOUT_S", "off")
    assert CheckpointStore(str(tmp_path / "run")).upload_timeout.seconds_for(10**12) is None
    monkeypatch.setenv("SPOT_UPLOAD_TIMEOUT_S", "30")
    monkeypatch.setenv("SPOT_UPLOAD_MIN_MBPS", "10")
    assert CheckpointStore(str(tmp_path / "run")).upload_timeout == UploadTimeout(30.0, 10.0)


def test_a_full_scratch_disk_is_one_clear_error_and_training_keeps_going(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(
        STRICT_ENV, "1"
    )  # strict: any failed checkpoint fails the end (see below for the default)
    url, scratch = str(tmp_path / "run"), tmp_path / "scratch"
    config = SpotConfig(dirpath=url, interval=None, preemption=[], keep_last=0, scratch_dir=str(scratch))
    engine = SpotEngine(config, "test")
    engine.start()

    def save(step: int) -> None:
        engine.save_state(step=step, epoch=0, state={"w": torch.full((20000,), float(step))}, reason="steps")
        engine.wait_for_commit(timeout=120)

    save(1)
    save(2)
    store = CheckpointStore(url)
    committed_bytes = {
        path: store.fs.cat_file(path) for step in (1, 2) for path in store.fs.find(store.step_path(step))
    }
    # A real ENOSPC from the kernel, without root: the file the writer opens for step 3 is /dev/full.
    full = engine.scratch_root / step_dirname(3) / f".{STATE_FILE}.tmp"
    full.parent.mkdir(parents=True)
    full.symlink_to("/dev/full")
    save(3)
    [error] = engine.new_failures()
    assert isinstance(error, PersistError) and error.cause.errno == errno.ENOSPC
    message = str(error)
    assert f"no space left in the scratch folder {engine.scratch_root}" in message
    assert "scratch_dir" in message and "SPOT_SCRATCH" in message and "bigger disk" in message
    assert "local copy is kept" not in message  # nothing half-written is left to keep
    assert not full.is_symlink() and not any(full.parent.iterdir())
    save(4)  # training goes on: the next checkpoint commits as usual
    assert engine.new_failures() == []
    with pytest.raises(PersistError, match="no space left in the scratch folder"):
        engine.finish()  # and the failure is reported once more at the end
    assert [info.step for info in store.committed()] == [1, 2, 4]
    assert all(store.fs.cat_file(path) == data for path, data in committed_bytes.items())
    assert store.verify(1) and store.verify(2) and store.verify(4)
    record(FAULTS)


def trainer_whose_step_4_finds_scratch_full(tmp_path: Path) -> tuple[SpotCheckpoint, pl.Trainer]:
    """A checkpoint every 2 of 8 steps; step 4's state write hits a real ENOSPC (/dev/full)."""
    spot = SpotCheckpoint(dirpath=str(tmp_path / "run"), interval=None, every_n_steps=2, keep_last=0,
                          preemption=[], scratch_dir=str(tmp_path / "scratch"))  # fmt: skip
    full = spot.engine.scratch_root / step_dirname(4) / f".{STATE_FILE}.tmp"
    full.parent.mkdir(parents=True)
    full.symlink_to("/dev/full")  # the kernel's ENOSPC for the checkpoint of step 4 only
    trainer = pl.Trainer(callbacks=[spot], logger=False, enable_progress_bar=False, enable_model_summary=False,
                         max_steps=8)  # fmt: skip
    return spot, trainer


def test_a_full_scratch_disk_during_a_lightning_fit_lets_training_finish_then_fails_fit(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv(STRICT_ENV, "1")
    spot, trainer = trainer_whose_step_4_finds_scratch_full(tmp_path)
    with pytest.raises(PersistError, match=r"step 4 .*no space left in the scratch folder"):
        trainer.fit(BoringModel())
    assert trainer.global_step == 8  # training went on to the end
    committed = [info.step for info in spot.store.committed()]
    assert 4 not in committed and committed[-1] == 8 and spot.store.verify(8)
    record(FAULTS)


def test_by_default_a_dropped_checkpoint_does_not_fail_a_run_whose_newest_state_committed(
    tmp_path, caplog
) -> None:
    spot, trainer = trainer_whose_step_4_finds_scratch_full(tmp_path)
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        trainer.fit(BoringModel())  # no PersistError: step 8, the newest state, is durable
    committed = [info.step for info in spot.store.committed()]
    assert 4 not in committed and committed[-1] == 8 and spot.store.verify(8)
    said = [r.getMessage() for r in caplog.records if "the newest state" in r.getMessage()]
    assert said == [
        "spot_callbacks: the newest state (step 8) is committed; 1 earlier checkpoint could not be persisted "
        "and was dropped (step 4)"
    ]
    record(FAULTS)


def test_the_run_still_fails_when_its_newest_checkpoint_failed(tmp_path) -> None:
    engine = SpotEngine(SpotConfig(dirpath=str(tmp_path / "run"), interval=None, preemption=[], keep_last=0,
                                   scratch_dir=str(tmp_path / "scratch")), "test")  # fmt: skip
    engine.start()
    engine.save_state(step=1, epoch=0, state={"w": torch.ones(8)}, reason="steps")
    assert engine.wait_for_commit(timeout=60)
    faulty = FaultyFileSystem(engine.store.fs)
    faulty.permanent = True
    engine.store.fs = faulty
    engine.save_state(step=2, epoch=0, state={"w": torch.ones(8) * 2}, reason="end")
    with pytest.raises(PersistError, match="step 2"):
        engine.finish()
    record(FAULTS, faulty.injected)
