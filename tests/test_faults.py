"""Flaky storage end to end: 30% of writes fail transiently, and every checkpoint still lands."""

from __future__ import annotations

import pytest
import torch
from faultfs import FaultyFileSystem

from spot_callbacks import CheckpointStore, RetryPolicy, SpotConfig
from spot_callbacks.engine import SpotEngine
from spot_callbacks.store import step_dirname

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
