"""The background persister: ordering, newest-wins, retries, failures, retention and scratch."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
from helpers.faultfs import FaultyFileSystem
from helpers.reliability_counts import FAULTS, record

from spot_callbacks import CheckpointStore, PersistError
from spot_callbacks.persist import Persister, PersistJob, default_scratch_root
from spot_callbacks.store import MANIFEST_NAME
from spot_callbacks.store.retry import RetryPolicy
from spot_callbacks.store.transfer import local_copy_matches

FAST_RETRY = RetryPolicy(attempts=4, initial_backoff_s=0.001, max_backoff_s=0.01)


def folder_for(tmp_path: Path, step: int, size: int = 4096) -> Path:
    folder = tmp_path / "scratch" / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / "state.pt").write_bytes(bytes([step % 251]) * size)
    (folder / "meta.json").write_text(f'{{"step": {step}}}')
    return folder


def job(tmp_path: Path, step: int, **kw) -> PersistJob:
    return PersistJob(
        step=step, reason="interval", framework="test", local_dir=folder_for(tmp_path, step), **kw
    )


@pytest.fixture
def store(store_url):
    return CheckpointStore(store_url.url, storage_options=store_url.storage_options, retry=FAST_RETRY)


def test_checkpoints_commit_in_order_with_retention(store, tmp_path):
    persister = Persister(store, keep_last=2)
    for step in (10, 20, 30):
        persister.submit(job(tmp_path, step))
        assert persister.wait(timeout=60)  # one at a time here: none is dropped
    assert persister.close(timeout=60)
    assert [i.step for i in store.committed()] == [20, 30]
    assert [r.info.step for r in persister.records] == [10, 20, 30]
    record = persister.records[-1]
    assert record.bytes == 4096 + len('{"step": 30}') and record.upload_s > 0 and record.mb_per_s > 0
    assert store.verify(30)


def test_newest_checkpoint_wins_when_uploads_fall_behind(store, tmp_path, caplog):
    faulty = FaultyFileSystem(store.fs)
    faulty.gate = threading.Event()
    store.fs = faulty
    persister = Persister(store, keep_last=0)
    caplog.set_level(logging.INFO, logger="spot_callbacks")
    persister.submit(job(tmp_path, 1))
    assert faulty.writes_started.wait(timeout=30)  # step 1 is uploading and held at the gate
    persister.submit(job(tmp_path, 2))
    persister.submit(job(tmp_path, 3))
    assert not persister.wait(timeout=0.2)
    faulty.gate.set()
    assert persister.wait(timeout=60)
    assert [i.step for i in store.committed()] == [1, 3]
    assert any("dropping checkpoint of step 2" in r.message for r in caplog.records)
    assert not (tmp_path / "scratch" / "step-2").exists()  # the obsolete local copy is cleaned
    uploads = [path for op, path in faulty.calls if op == "put_file"]
    assert not any("step-000000002" in p for p in uploads)  # 2 never interleaved with 1 or 3
    persister.close()


def test_transient_errors_are_retried_until_committed(store, tmp_path, caplog):
    faulty = FaultyFileSystem(store.fs)
    store.fs = faulty
    faulty.transient_failures = 3
    persister = Persister(store)
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        persister.submit(job(tmp_path, 5))
        assert persister.wait(timeout=60)
    assert persister.failures == [] and store.verify(5)
    assert sum("retrying" in r.message for r in caplog.records) == 3
    persister.close()
    record(FAULTS, faulty.injected)


def test_permanent_failure_is_reported_and_keeps_what_was_committed(store, tmp_path):
    persister = Persister(store)
    persister.submit(job(tmp_path, 1))
    assert persister.wait(timeout=60)
    faulty = FaultyFileSystem(store.fs)
    store.fs = faulty
    faulty.permanent = True
    persister.submit(job(tmp_path, 2))
    assert persister.wait(timeout=60)

    [failure] = persister.new_failures()
    assert isinstance(failure, PersistError) and failure.step == 2
    assert store.step_url(2) in str(failure) and "PermissionError" in str(failure)
    assert "local copy is kept" in str(failure) and (tmp_path / "scratch" / "step-2" / "state.pt").exists()
    assert persister.new_failures() == []  # reported once
    store.fs = faulty.inner
    assert store.latest().step == 1 and store.verify(1)
    persister.close()
    record(FAULTS, faulty.injected)


def test_scratch_keeps_only_the_newest_committed_copy_which_pull_reuses(store, tmp_path):
    persister = Persister(store, keep_last=3)
    for step in (1, 2, 3):
        persister.submit(job(tmp_path, step))
        assert persister.wait(timeout=60)
    persister.close()
    remaining = sorted(p.name for p in (tmp_path / "scratch").iterdir())
    assert remaining == ["step-3"]
    assert (tmp_path / "scratch" / "step-3" / MANIFEST_NAME).exists()
    info = store.latest()
    assert local_copy_matches(info, tmp_path / "scratch" / "step-3")


def test_failed_write_is_reported_and_releases_buffers(store, tmp_path):
    released = threading.Event()

    def broken_write(folder: Path):
        raise OSError(28, "No space left on device", str(folder))

    persister = Persister(store)
    persister.submit(
        PersistJob(step=4, reason="interval", framework="test", local_dir=tmp_path / "s4",
                   write=broken_write, on_written=released.set)
    )  # fmt: skip
    assert persister.wait(timeout=30)
    assert released.is_set()
    [failure] = persister.new_failures()
    assert "No space left on device" in str(failure)
    assert store.committed() == []
    persister.close()


def test_scratch_root_is_per_run(monkeypatch, tmp_path):
    monkeypatch.setenv("SPOT_SCRATCH", str(tmp_path))
    a = default_scratch_root("s3://bucket/run-a")
    b = default_scratch_root("s3://bucket/run-b")
    assert a.parent == tmp_path and b.parent == tmp_path and a != b
    assert default_scratch_root("s3://bucket/run-a", scratch_dir=str(tmp_path / "x")).parent == tmp_path / "x"


def test_the_kept_local_copy_gets_the_manifest_as_committed_without_reading_it_back(store, tmp_path):
    faulty = FaultyFileSystem(store.fs)
    store.fs = faulty
    reads: list[str] = []
    inner_cat_file = faulty.inner.cat_file

    def cat_file(path, *args, **kwargs):
        reads.append(path)
        return inner_cat_file(path, *args, **kwargs)

    faulty.cat_file = cat_file
    persister = Persister(store, keep_last=0)
    persister.submit(job(tmp_path, 7, owns_local_dir=True))
    assert persister.wait(timeout=60)
    persister.close(timeout=60)
    assert not [path for path in reads if path.endswith(MANIFEST_NAME)]  # one request less per commit
    local = tmp_path / "scratch" / "step-7" / MANIFEST_NAME
    assert local.read_bytes() == store.fs.cat_file(f"{store.step_path(7)}/{MANIFEST_NAME}")
    assert local_copy_matches(store.latest(), local.parent)


def test_a_save_in_a_workers_woken_after_block_is_written_after_it_and_a_wait_inside_wakes_them(tmp_path):
    """The adapters log a checkpoint's metrics before its writer's first Python takes the GIL."""
    from spot_callbacks.persist.tracking import workers_woken_after

    store = CheckpointStore((tmp_path / "store").as_uri())
    persister = Persister(store)
    writing = {1: threading.Event(), 2: threading.Event()}

    def job_writing(step: int) -> PersistJob:
        def write(folder: Path) -> dict:
            writing[step].set()
            folder.mkdir(parents=True)
            (folder / "state.pt").write_bytes(bytes([step]) * 1024)
            return {}

        return PersistJob(step=step, reason="interval", framework="test", local_dir=tmp_path / f"s{step}",
                          write=write)  # fmt: skip

    try:
        with workers_woken_after():
            persister.submit(job_writing(1))
            assert not writing[1].wait(0.5)  # queued; the writer is not woken inside the block
        assert writing[1].wait(30)  # woken when it ends
        # Settled before the next one is queued: a newer written checkpoint replaces one not yet uploading.
        assert persister.wait_for_step(1, timeout=30)
        with workers_woken_after():
            persister.submit(job_writing(2))
            assert persister.wait_for_step(2, timeout=30)  # a wait inside the block wakes them: no deadlock
        assert [info.step for info in store.committed()] == [1, 2]
    finally:
        persister.close()  # a failed assertion must not leave workers running into the next test
