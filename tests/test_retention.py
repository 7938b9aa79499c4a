"""Retention's cost (spot_callbacks/store/retention.py): bounded by what it may delete, not by the
step folders a store holds (issue 21 item 11: "retention 277 s for 5,000" on S3).

Counted through a wrapper around a real filesystem (local disk, moto S3): the manifests read and
the calls made, which the old prune paid once per step folder at every commit."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest

from spot_callbacks import CheckpointStore
from spot_callbacks.store.layout import MANIFEST_NAME, step_dirname
from spot_callbacks.store.writer import CommitWriter
from tests.helpers.faultfs import FaultyFileSystem

OLD, OURS = "a" * 32, "b" * 32


class CountingFileSystem(FaultyFileSystem):
    """A real filesystem that counts the manifests read and every call of the store's kind."""

    COUNTED = ("cat", "cat_file", "find", "ls", "rm", "exists", "info", "pipe_file", "put_file")

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.manifests_read = 0
        self.calls_made = 0

    def __getattr__(self, name: str) -> Any:
        found = getattr(self.inner, name)
        if name in self.COUNTED and name not in ("cat", "cat_file"):
            self.calls_made += 1
        return found

    def cat(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        paths = [path] if isinstance(path, str) else list(path)
        self.manifests_read += sum(p.endswith(MANIFEST_NAME) for p in paths)
        self.calls_made += 1
        return self.inner.cat(path, *args, **kwargs)

    def cat_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self.manifests_read += path.endswith(MANIFEST_NAME)
        self.calls_made += 1
        return self.inner.cat_file(path, *args, **kwargs)

    def reset(self) -> None:
        self.manifests_read = self.calls_made = 0


def _payload(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "state.ckpt").write_bytes(b"x" * 10)
    return src


def _commit(store: CheckpointStore, step: int, src: Path, lineage: str, resumed_from: int | None = None):
    return CommitWriter(store).write_checkpoint(
        step, src, reason="interval", framework="lightning",
        extra={"lineage": {"id": lineage, "resumed_from": resumed_from}},
    )  # fmt: skip


def _copies(root: Path, first: int, steps: range) -> None:
    """Renumbered copies of the committed checkpoint ``first`` (its lineage): a store's history."""
    template = root / step_dirname(first)
    doc = json.loads((template / MANIFEST_NAME).read_text())
    for step in steps:
        folder = root / step_dirname(step)
        shutil.copytree(template, folder)
        (folder / MANIFEST_NAME).write_text(json.dumps({**doc, "step": step}))


def test_a_fresh_run_on_2000_old_checkpoints_reads_them_once_not_at_every_commit(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = CheckpointStore(str(root))
    src = _payload(tmp_path)
    _commit(store, 0, src, OLD)
    _copies(root, 0, range(1, 2000))  # another run's 2,000 checkpoints: never retention's to delete
    counting = CountingFileSystem(store.fs)
    store.fs = counting
    reads = []
    for step in range(3000, 3006):  # a fresh run on that dirpath commits six times, keep_last=2
        info = _commit(store, step, src, OURS)
        counting.reset()
        CommitWriter(store).settle(info, keep_last=2, deadline=None)
        reads.append(counting.manifests_read)
    assert reads[0] <= 2000 + 1  # the first prune of this store reads each manifest once
    # Every later one reads its own lineage's (keep_last + the new one), not the 2,000 others (before: 2,003+).
    assert max(reads[1:]) <= 4, reads
    committed = {info.step for info in store.committed()}
    assert committed == set(range(2000)) | {3004, 3005}  # the other run's untouched


def test_memory_never_decides_about_the_pruned_lineage(tmp_path: Path) -> None:
    """What a prune remembers of a folder is never trusted for the lineage it prunes: a checkpoint
    the run lost (manifest gone after a failed rewrite) is not counted, a renamed lineage is re-read."""
    store = CheckpointStore(str(tmp_path / "store"))
    src = _payload(tmp_path)
    for step in (1, 2, 3):
        CommitWriter(store).settle(_commit(store, step, src, OURS), keep_last=2, deadline=None)
    assert [info.step for info in store.committed()] == [2, 3]
    os.remove(Path(store.step_path(3)) / MANIFEST_NAME)  # a rewrite of 3 that died after clearing it
    info = _commit(store, 4, src, OURS)
    CommitWriter(store).settle(info, keep_last=2, deadline=None)
    # 3 is no checkpoint any more: 2 and 4 are the two kept (a remembered 3 would have cost 2).
    assert [info.step for info in store.committed()] == [2, 4]


def test_the_first_prune_after_keep_last_0_deletes_1000_checkpoints_in_a_few_calls(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = CheckpointStore(str(root))
    _commit(store, 0, _payload(tmp_path), OURS)
    _copies(root, 0, range(1, 1000))  # keep_last=0 for a long stretch
    counting = CountingFileSystem(store.fs)
    store.fs = counting
    assert store.prune(keep_last=2, lineage=OURS) == list(range(998))
    assert sorted(int(p.name.split("-")[1]) for p in root.iterdir() if p.name.startswith("step-")) == [
        998,
        999,
    ]
    # One listing, one concurrent read of the manifests, two size checks, bulk deletes and the listings
    # that confirm them: a number of calls that does not grow with the 998 deleted (before: ~6 per step).
    assert counting.calls_made <= 20, counting.calls_made
    assert store.verify(999) and store.verify(998)


@pytest.mark.remote_store
def test_retention_on_s3_deletes_500_checkpoints_in_bulk(s3_server: Any, tmp_path: Path) -> None:
    url = f"s3://{s3_server.bucket}/retention-{uuid.uuid4().hex}"
    options = {**s3_server.storage_options, "skip_instance_cache": True}
    store = CheckpointStore(url, storage_options=options)
    first = _commit(store, 0, _payload(tmp_path), OURS)
    fs, _ = fsspec.core.url_to_fs(url, **options)
    manifest = fs.cat_file(f"{store.step_path(0)}/{MANIFEST_NAME}")
    payload = fs.cat_file(f"{store.step_path(0)}/state.ckpt")
    doc = json.loads(manifest)
    objects = {}
    for step in range(1, 500):  # payload first, then the manifest: each one committed as the protocol does
        objects[f"{store.step_path(step)}/state.ckpt"] = payload
    fs.pipe(objects)
    fs.pipe(
        {
            f"{store.step_path(s)}/{MANIFEST_NAME}": json.dumps({**doc, "step": s}).encode()
            for s in range(1, 500)
        }
    )
    assert first.step == 0
    counting = CountingFileSystem(store.fs)
    store.fs = counting
    assert store.prune(keep_last=1, lineage=OURS) == list(range(499))
    assert counting.calls_made <= 20, counting.calls_made
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[1] for p in fs.find(store.root)) == [MANIFEST_NAME, "state.ckpt"]
    assert [info.step for info in store.committed()] == [499] and store.verify(499)


def test_retention_counts_only_what_the_run_wrote_or_resumed_from(tmp_path: Path, caplog) -> None:
    """A manifest of the run's lineage that the run did not write (put there by hand, or by a process
    that should not be writing there) neither pushes the run's own checkpoints out nor is deleted."""
    store = CheckpointStore(str(tmp_path / "store"))
    src = _payload(tmp_path)
    for step in (10, 20):
        _commit(store, step, src, OURS)  # the lineage's earlier process
    run = CommitWriter(store)  # this process resumed from step 20
    foreign = _commit(store, 35, src, OURS, resumed_from=20)  # same lineage; no writer of this run
    for step in (30, 40):
        info = run.write_checkpoint(
            step, src, reason="interval", framework="lightning", extra={"lineage": {"id": OURS, "resumed_from": 20}}
        )  # fmt: skip
        run.settle(info, keep_last=2, deadline=None)
    committed = {info.step for info in store.committed()}
    assert {30, 40} <= committed, committed  # before: 35 counted as one of the 2 kept, and 30 was deleted
    assert 35 in committed and 20 in committed  # not deleted; the resume point stays while the run runs
    assert 10 not in committed  # below the resume point: older history goes as before
    assert f"{foreign.url} continues this run's lineage but this run did not write it" in caplog.text
