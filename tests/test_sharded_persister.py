"""ShardedPersister in one process (a world of one gloo rank): newest wins, failures, a round trip.

The multi-process behaviour (every rank uploading, rank 0 committing, resharding) is covered by
tests/test_sharded.py with real FSDP runs; these pin the pipeline's rules cheaply.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
from helpers.faultfs import FaultyFileSystem
from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

from spot_callbacks import CheckpointStore, PersistError, load_sharded_state
from spot_callbacks.persist import CheckpointPersister
from spot_callbacks.persist.sharded import ShardedPersister
from spot_callbacks.store.retry import RetryPolicy

FAST_RETRY = RetryPolicy(attempts=2, initial_backoff_s=0.001, max_backoff_s=0.01)


def sharded_state(mesh: DeviceMesh, value: float) -> dict:
    return {"model": {"w": distribute_tensor(torch.full((8, 4), value), mesh, [Shard(0)])}, "step": value}


def test_the_newest_written_checkpoint_wins_and_round_trips_through_dcp(one_rank, tmp_path, caplog):
    store = CheckpointStore((tmp_path / "store").as_uri(), retry=FAST_RETRY)
    faulty = FaultyFileSystem(store.fs)
    faulty.gate = threading.Event()
    store.fs = faulty
    persister = ShardedPersister(store, scratch_root=tmp_path / "scratch", keep_last=0)
    assert isinstance(persister, CheckpointPersister)
    caplog.set_level(logging.INFO, logger="spot_callbacks")
    for step in (1, 2, 3):
        persister.submit_state(
            step, "steps", "test", sharded_state(one_rank, float(step)), meta={"epoch": step}
        )
        if step == 1:
            assert faulty.held.wait(timeout=60)  # step 1 is uploading, held at the gate
    assert persister.wait_written(timeout=60)  # 2 and 3 are on scratch, waiting for the uploader
    faulty.gate.set()
    assert persister.wait(timeout=60)
    assert [info.step for info in store.committed()] == [1, 3]
    assert any("dropping sharded checkpoint of step 2" in r.message for r in caplog.records)
    assert not any("step-000000002" in path for _, path in faulty.calls)
    latest = store.latest()
    assert {".metadata", "__0_0.distcp", "meta.pt"} == set(latest.files)
    assert latest.extra["sharded"]["world_size"] == 1 and store.verify(3, deep=True)
    # The staged copy was taken at submit: the values are step 3's, not a later state's.
    target = sharded_state(one_rank, 0.0)
    meta = load_sharded_state(store.pull(3, tmp_path / "pulled"), target)
    assert torch.equal(target["model"]["w"].full_tensor(), torch.full((8, 4), 3.0)) and target["step"] == 3.0
    assert meta == {"epoch": 3}
    assert persister.close(timeout=60)
    assert not list((tmp_path / "scratch").rglob("*.distcp"))  # scratch copies go once settled


def test_a_failed_upload_commits_nothing_and_names_the_rank(one_rank, tmp_path):
    store = CheckpointStore((tmp_path / "store").as_uri(), retry=FAST_RETRY)
    persister = ShardedPersister(store, scratch_root=tmp_path / "scratch")
    persister.submit_state(5, "steps", "test", sharded_state(one_rank, 5.0))
    assert persister.wait_for_step(5, timeout=60)
    faulty = FaultyFileSystem(store.fs)
    faulty.permanent = True
    store.fs = faulty
    persister.submit_state(6, "steps", "test", sharded_state(one_rank, 6.0))
    assert not persister.wait_for_step(6, timeout=60)
    [failure] = persister.new_failures()
    assert isinstance(failure, PersistError) and failure.step == 6
    assert "rank 0: PermissionError" in str(failure) and "step-000000006" in str(failure)
    store.fs = faulty.inner
    assert [info.step for info in store.committed()] == [5] and store.verify(5, deep=True)
    assert persister.close(timeout=60)


def test_an_expedited_checkpoint_skips_retention_and_a_late_commit_is_said(one_rank, tmp_path, caplog):
    store = CheckpointStore((tmp_path / "store").as_uri(), retry=FAST_RETRY)
    persister = ShardedPersister(store, scratch_root=tmp_path / "scratch", keep_last=1)
    persister.submit_state(1, "steps", "test", sharded_state(one_rank, 1.0))
    assert persister.wait_for_step(1, timeout=60)
    faulty = FaultyFileSystem(store.fs)
    faulty.gate = threading.Event()
    store.fs = faulty
    persister.submit_state(2, "steps", "test", sharded_state(one_rank, 2.0))
    assert faulty.held.wait(timeout=60)  # step 2 is uploading, held at the gate
    assert persister.in_flight_step == 2
    persister.expedite(2, deadline=time.time() - 1)  # its deadline has passed already
    caplog.set_level(logging.WARNING, logger="spot_callbacks")
    faulty.gate.set()
    assert persister.wait_for_step(2, timeout=60)
    assert any("step 2 committed" in r.message and "after its deadline" in r.message for r in caplog.records)
    assert [info.step for info in store.committed()] == [1, 2]  # keep_last=1, yet no retention ran
    assert persister.close(timeout=60)


def test_shard_folders_a_dead_process_left_in_scratch_go_when_the_next_persister_starts(one_rank, tmp_path):
    rank_scratch = tmp_path / "scratch" / "shards" / "rank-0"
    leftover = rank_scratch / "step-000000007"
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"\0" * 4096)  # a kill -9 mid-write left it
    (rank_scratch / "notes.txt").write_text("not a step folder: not ours to judge")
    persister = ShardedPersister(
        CheckpointStore((tmp_path / "store").as_uri()), scratch_root=tmp_path / "scratch"
    )
    try:
        assert not leftover.exists() and (rank_scratch / "notes.txt").is_file()
        persister.submit_state(8, "steps", "test", sharded_state(one_rank, 8.0))
        assert persister.wait(timeout=60) and persister.last_committed.step == 8
    finally:
        assert persister.close(timeout=60)
    assert sorted(p.name for p in rank_scratch.iterdir()) == ["notes.txt"]


def test_local_shards_staged_in_a_staging_area_reuse_its_buffers_and_round_trip(one_rank, tmp_path):
    from spot_callbacks.persist.shards import local_shards
    from spot_callbacks.staging import StagingArea

    store = CheckpointStore((tmp_path / "store").as_uri(), retry=FAST_RETRY)
    persister = ShardedPersister(store, scratch_root=tmp_path / "scratch", keep_last=0)
    area = StagingArea()
    buffers = []
    try:
        for step in (1, 2):
            layouts: dict = {}
            staged = area.stage(local_shards(sharded_state(one_rank, float(step)), layouts), timeout=60)
            buffers.append(staged.state["model"]["w"])
            job = persister.job(
                step, "steps", "test", staged.state, layouts=layouts,
                before_write=staged.wait_copied, on_written=staged.release,
            )  # fmt: skip
            persister.submit(job)
            assert persister.wait_for_step(step, timeout=60)
    finally:
        assert persister.close()
    assert (
        buffers[0] is buffers[1] and area.plan_builds == 1
    )  # the second checkpoint refilled the first's buffer
    state = {"model": {"w": distribute_tensor(torch.zeros(8, 4), one_rank, [Shard(0)])}, "step": 0.0}
    load_sharded_state(store.pull(2, tmp_path / "pulled"), state)
    assert torch.equal(state["model"]["w"].full_tensor(), torch.full((8, 4), 2.0)) and state["step"] == 2.0


def test_rank_meta_is_gathered_by_the_writer_into_meta_pt_and_later_changes_do_not_reach_it(
    one_rank, tmp_path
):
    store = CheckpointStore((tmp_path / "store").as_uri(), retry=FAST_RETRY)
    persister = ShardedPersister(store, scratch_root=tmp_path / "scratch")
    rng = {"torch": torch.get_rng_state(), "python": {"version": 3, "gauss": None}}
    meta = {"epoch": 1, "callbacks": {"Spot": {"batches_done_in_epoch": 4}}}
    staged, _ = persister.stage(sharded_state(one_rank, 7.0))
    job = persister.job(
        7, "steps", "test", staged, meta=meta, rank_meta={("callbacks", "Spot", "rng"): rng, ("new", "x"): 2}
    )
    meta["callbacks"]["Spot"]["batches_done_in_epoch"] = 99  # the snapshot was taken by job()
    persister.submit(job)
    assert persister.wait_for_step(7, timeout=60)
    written = load_sharded_state(store.pull(7, tmp_path / "pulled"), sharded_state(one_rank, 0.0))
    assert written["epoch"] == 1 and written["new"] == {"x": [2]}
    spot = written["callbacks"]["Spot"]
    assert spot["batches_done_in_epoch"] == 4 and list(spot) == ["batches_done_in_epoch", "rng"]
    [only] = spot["rng"]  # one rank: a list of one, as an all-gather in the loop would have made
    assert torch.equal(only["torch"], rng["torch"]) and only["torch"].dtype == torch.uint8
    assert only["python"] == {"version": 3, "gauss": None}
    assert persister.close(timeout=60)
