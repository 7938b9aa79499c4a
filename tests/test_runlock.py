"""The run lock: a second run on the same dirpath refuses to start; dead and stale owners are taken over."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from spot_callbacks import CheckpointStore, RunLockedError, SpotConfig
from spot_callbacks.engine import SpotEngine
from spot_callbacks.store.layout import is_local_fs
from spot_callbacks.store.runlock import LOCK_NAME, RunLock


@pytest.fixture(params=["file", "s3"])
def lock_target(request, tmp_path):
    if request.param == "file":
        return str(tmp_path / "run"), {}
    info = request.getfixturevalue("s3_server")
    return f"s3://{info.bucket}/lock-{tmp_path.name}", dict(info.storage_options)


def _engine(url: str, options: dict) -> SpotEngine:
    return SpotEngine(SpotConfig(dirpath=url, interval=None, preemption=[], storage_options=options), "test")


def _write_foreign_lock(url: str, options: dict, **fields) -> None:
    store = CheckpointStore(url, storage_options=options)
    doc = {"host": "other-host", "pid": 4242, "run_id": "f" * 32, "started": "2026-01-01T00:00:00+00:00",
           "heartbeat": time.time(), **fields}  # fmt: skip
    if is_local_fs(store.fs):
        store.fs.makedirs(store.root, exist_ok=True)
    path = f"{store.root}/{LOCK_NAME}"
    if is_local_fs(store.fs):  # as the library does: a reader never sees half a lock
        Path(f"{path}.tmp").write_bytes(json.dumps(doc).encode())
        os.replace(f"{path}.tmp", path)
    else:
        store.fs.pipe_file(path, json.dumps(doc).encode())


def test_a_second_run_on_a_live_runs_dirpath_refuses_to_start_with_the_owner_and_override(
    lock_target, monkeypatch
) -> None:
    url, options = lock_target
    monkeypatch.delenv("SPOT_FORCE_LOCK", raising=False)
    monkeypatch.setenv("SPOT_LOCK_STALE_S", "8")
    _write_foreign_lock(url, options)  # a live run on another machine, heartbeat just now
    alive, refresher = threading.Event(), None

    def keep_beating() -> None:  # the other machine's heartbeat thread
        while not alive.wait(0.5):
            _write_foreign_lock(url, options)

    refresher = threading.Thread(target=keep_beating, daemon=True)
    refresher.start()
    second = _engine(url, options)
    try:
        with pytest.raises(RunLockedError) as refused:
            second.start()
    finally:
        alive.set()
        refresher.join()
    message = str(refused.value)
    assert "other-host" in message and "4242" in message and "SPOT_FORCE_LOCK=1" in message
    assert CheckpointStore(url, storage_options=options).committed() == []  # nothing was written
    monkeypatch.setenv("SPOT_FORCE_LOCK", "1")  # the override takes the lock over
    second.start()
    second.save_state(step=3, epoch=0, state={"w": torch.ones(2)}, reason="steps")
    second.finish()
    assert CheckpointStore(url, storage_options=options).latest().step == 3


def test_a_fresh_lock_whose_owner_stopped_beating_is_taken_over_after_the_stale_time(
    lock_target, monkeypatch, caplog
) -> None:
    url, options = lock_target
    monkeypatch.delenv("SPOT_FORCE_LOCK", raising=False)
    monkeypatch.setenv("SPOT_LOCK_STALE_S", "2")
    _write_foreign_lock(url, options)  # kill -9'd a moment ago on another machine: fresh, never refreshed
    engine = _engine(url, options)
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        engine.start()  # waits until the heartbeats are missed instead of failing the restart
        engine.save_state(step=1, epoch=0, state={"w": torch.ones(2)}, reason="steps")  # waits for the lock
    assert "waiting up to 2s" in caplog.text and "taking over the run lock" in caplog.text
    assert (
        RunLock(CheckpointStore(url, storage_options=options)).holder()["run_id"] == engine.lease.lock.run_id
    )
    engine.finish()
    assert CheckpointStore(url, storage_options=options).latest().step == 1


def test_a_replacement_trains_while_a_dead_runs_lock_goes_stale_and_writes_only_once_it_holds_it(
    lock_target, monkeypatch, caplog
) -> None:
    url, options = lock_target
    monkeypatch.delenv("SPOT_FORCE_LOCK", raising=False)
    monkeypatch.setenv("SPOT_LOCK_STALE_S", "8")  # heartbeats every 2 s: missed after 4 s, stale after 8 s
    _write_foreign_lock(url, options)  # its owner was killed just now
    store = CheckpointStore(url, storage_options=options)
    engine = _engine(url, options)
    with caplog.at_level(logging.INFO, logger="spot_callbacks"):
        engine.start()  # returns once the heartbeats are missed, long before the lock is stale
        assert engine.lease.pending and engine.lease.lock is None
        assert RunLock(store).holder()["run_id"] == "f" * 32  # still the dead run's: nothing written
        assert "training starts while the run lock" in caplog.text
        engine.save_state(step=2, epoch=0, state={"w": torch.ones(2)}, reason="steps")
        assert not engine.lease.pending and engine.lease.lock is not None
        assert RunLock(store).holder()["run_id"] == engine.lease.lock.run_id  # taken over, then written
        engine.finish()
    assert (
        "the checkpoint waits for the run lock" in caplog.text and "taking over the run lock" in caplog.text
    )
    assert store.latest().step == 2


def test_a_lock_presumed_dead_whose_owner_beats_again_stops_the_run_before_it_writes(
    lock_target, monkeypatch
) -> None:
    url, options = lock_target
    monkeypatch.delenv("SPOT_FORCE_LOCK", raising=False)
    monkeypatch.setenv("SPOT_LOCK_STALE_S", "8")
    _write_foreign_lock(url, options)  # an owner whose store stalled its heartbeats...
    engine = _engine(url, options)
    engine.start()
    assert engine.lease.pending
    _write_foreign_lock(url, options)  # ...beats again before its lock is stale: it is alive
    with pytest.raises(RunLockedError) as refused:
        engine.save_state(step=2, epoch=0, state={"w": torch.ones(2)}, reason="steps")
    assert "other-host" in str(refused.value) and "4242" in str(refused.value)
    engine.stop()
    store = CheckpointStore(url, storage_options=options)
    assert store.committed() == [] and RunLock(store).holder()["run_id"] == "f" * 32  # nothing of ours


def test_the_lock_is_held_while_training_and_released_at_finish(lock_target) -> None:
    url, options = lock_target
    first = _engine(url, options)
    first.start()
    holder = RunLock(CheckpointStore(url, storage_options=options)).holder()
    assert (
        holder is not None
        and holder["run_id"] == first.lease.lock.run_id
        and holder["host"] == socket.gethostname()
    )
    first.save_state(step=1, epoch=0, state={"w": torch.ones(2)}, reason="steps")
    first.finish()
    assert RunLock(CheckpointStore(url, storage_options=options)).holder() is None


def test_a_stale_lock_is_taken_over_with_a_warning(lock_target, monkeypatch, caplog) -> None:
    url, options = lock_target
    # A heartbeat an hour old in a lock written just now: a vanished machine, or a live one whose
    # clock is an hour behind. The heartbeat's value decides nothing: the lock is watched until the
    # store's own clock says it has not been rewritten for SPOT_LOCK_STALE_S, then taken over.
    monkeypatch.setenv("SPOT_LOCK_STALE_S", "1")
    _write_foreign_lock(url, options, heartbeat=time.time() - 3600)
    engine = _engine(url, options)
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        engine.start()
    assert "taking over the run lock" in caplog.text
    assert "it was last written" in caplog.text and "by the store's clock" in caplog.text  # not the heartbeat
    engine.finish()


def test_a_lock_left_by_a_killed_process_on_this_host_is_taken_over_at_once(tmp_path) -> None:
    url = str(tmp_path / "run")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    _write_foreign_lock(url, {}, host=socket.gethostname(), pid=int(dead.stdout))  # fresh heartbeat, dead pid
    engine = _engine(url, {})
    engine.start()  # the resume after a kill -9 on the same machine is not blocked
    assert RunLock(CheckpointStore(url)).holder()["run_id"] == engine.lease.lock.run_id
    engine.finish()


def test_a_live_owner_keeps_its_heartbeat_fresh(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPOT_LOCK_STALE_S", "0.4")  # heartbeats every 0.1s
    lock = RunLock(CheckpointStore(str(tmp_path / "run")))
    lock.acquire()
    try:
        first = lock.holder()["heartbeat"]
        deadline = time.monotonic() + 30
        while lock.holder()["heartbeat"] == first:
            assert time.monotonic() < deadline, "the heartbeat never moved"
            time.sleep(0.05)  # polling a condition, with a deadline
    finally:
        lock.release()
    assert lock.holder() is None


def test_a_lightning_fit_refused_by_a_live_lock_writes_nothing_into_its_dirpath(
    lock_target, monkeypatch, tmp_path
):
    """Issue 14: before, the refused run committed a step-0 ``exception`` checkpoint into the live run's dirpath."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    from spot_callbacks.lightning import SpotCheckpoint

    url, options = lock_target
    monkeypatch.delenv("SPOT_FORCE_LOCK", raising=False)
    monkeypatch.setenv("SPOT_LOCK_STALE_S", "8")
    _write_foreign_lock(url, options)
    store = CheckpointStore(url, storage_options=options)
    before = sorted(store.fs.find(store.root))
    alive = threading.Event()

    def keep_beating() -> None:  # the live run's heartbeat (rewrites only its lock)
        while not alive.wait(0.5):
            _write_foreign_lock(url, options)

    refresher = threading.Thread(target=keep_beating, daemon=True)
    refresher.start()
    spot = SpotCheckpoint(dirpath=url, interval=None, every_n_steps=2, preemption=[], storage_options=options,
                          scratch_dir=str(tmp_path / "scratch"))  # fmt: skip
    trainer = pl.Trainer(callbacks=[spot], max_steps=4, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)  # fmt: skip
    try:
        with pytest.raises(RunLockedError, match="other-host"):
            trainer.fit(BoringModel(), ckpt_path="latest")
    finally:
        alive.set()
        refresher.join()
    after = sorted(
        CheckpointStore(url, storage_options={**options, "skip_instance_cache": True}).fs.find(store.root)
    )
    assert after == before  # the lock aside (rewritten in place), not one object more
    assert json.loads(store.fs.cat_file(f"{store.root}/{LOCK_NAME}"))["run_id"] == "f" * 32


def test_a_start_whose_preflight_listed_no_lock_creates_it_without_reading_it_first(
    s3_server, tmp_path
) -> None:
    """Issue 28: the preflight's listing of the run folder, just taken, showed no lock: the lock is created
    by a conditional write straight away (no HEAD of a missing lock, no s3fs LIST after its 404)."""
    import s3fs.core

    url, options = f"s3://{s3_server.bucket}/lock-{tmp_path.name}", dict(s3_server.storage_options)
    engine = _engine(url, options)
    on_lock: list[str] = []
    call_s3 = s3fs.core.S3FileSystem._call_s3

    async def recorded(self, method, *args, **kwargs):
        name = getattr(method, "__name__", method)
        if kwargs.get("Key", "").endswith(LOCK_NAME) or kwargs.get("Prefix", "").startswith(
            f"lock-{tmp_path.name}/{LOCK_NAME}"
        ):
            on_lock.append(name)
        return await call_s3(self, method, *args, **kwargs)

    s3fs.core.S3FileSystem._call_s3 = recorded
    try:
        engine.start()
    finally:
        s3fs.core.S3FileSystem._call_s3 = call_s3
    try:
        assert on_lock == ["put_object"]
        assert RunLock(engine.store).holder()["run_id"] == engine.lease.lock.run_id
    finally:
        engine.finish()


def test_a_lock_created_after_the_listing_that_showed_none_refuses_the_late_run(s3_server, tmp_path) -> None:
    """The listing said no lock, but another run created one since: the conditional create is refused and
    the late run raises, naming the winner (as when holder() read none and the create was refused)."""
    url, options = f"s3://{s3_server.bucket}/lock-{tmp_path.name}", dict(s3_server.storage_options)
    _write_foreign_lock(url, options)  # the winner, after the late run's listing
    late = RunLock(CheckpointStore(url, storage_options=options))
    late.listed_absent = True
    with pytest.raises(RunLockedError, match="another run took the run lock first.*other-host"):
        late.acquire()
    assert RunLock(CheckpointStore(url, storage_options=options)).holder()["run_id"] == "f" * 32
