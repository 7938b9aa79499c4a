"""Issue 28: the round trips of a resume. The manifest of the checkpoint resumed from is read once (the
walk down's read serves the damage check and the pull), and its step folder is not listed again: its
files' sizes come from the run folder's recursive listing the resume took."""

from __future__ import annotations

import logging
import posixpath
import uuid
from pathlib import Path
from typing import Any

import pytest
import s3fs.core
import torch
from helpers.s3_engines import committed_s3_run, s3_engine

from spot_callbacks.engine import STATE_FILE
from spot_callbacks.resume import pull_newest_valid
from spot_callbacks.store import CheckpointStore
from spot_callbacks.store.checkpoint_store import WalkReads, walk_down
from spot_callbacks.store.layout import MANIFEST_NAME, step_dirname
from spot_callbacks.store.writer import CommitWriter


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every S3 request from now on, as (operation, key or listing prefix)."""
    requests: list[tuple[str, str]] = []
    call_s3 = s3fs.core.S3FileSystem._call_s3

    async def recorded(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
        requests.append((getattr(method, "__name__", method), kwargs.get("Key", kwargs.get("Prefix", ""))))
        return await call_s3(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.core.S3FileSystem, "_call_s3", recorded)
    return requests


@pytest.mark.parametrize("newest_damaged", [False, True], ids=["intact", "newest-truncated"])
def test_a_resume_reads_the_manifest_once_and_lists_no_step_folder(
    s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any, newest_damaged: bool
) -> None:
    run = uuid.uuid4().hex
    writer = committed_s3_run(s3_server, run, tmp_path / "a", (10, 20), numel=1000)
    if newest_damaged:
        path = posixpath.join(writer.store.step_path(20), STATE_FILE)
        writer.store.fs.pipe_file(path, writer.store.fs.cat_file(path)[:-7])
    expected = 10 if newest_damaged else 20

    requests = _recording(monkeypatch)
    fresh = s3_engine(s3_server, run, tmp_path / "b")
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        local = fresh.pull_latest()
    assert local is not None and local.name == step_dirname(expected)
    assert torch.load(local / STATE_FILE, weights_only=True)["w"][0].item() == float(expected)
    manifest_gets = [key for op, key in requests if op == "get_object" and key.endswith(MANIFEST_NAME)]
    assert sorted(manifest_gets) == sorted(
        f"{run}/{step_dirname(step)}/{MANIFEST_NAME}" for step in (10, 20)
    )  # one batch read of both, none again for the damage check or the pull
    assert not [op for op, key in requests if op == "head_object" and key.endswith(MANIFEST_NAME)]
    step_listings = [key for op, key in requests if op == "list_objects_v2" and "/step-" in key]
    assert step_listings == []
    assert (local / MANIFEST_NAME).read_bytes() == writer.store.fs.cat_file(
        posixpath.join(writer.store.step_path(expected), MANIFEST_NAME)
    )  # the bytes read once are the ones written into the pulled folder
    if newest_damaged:
        lines = [r.getMessage() for r in caplog.records]
        assert any(
            "skipping damaged checkpoint" in line
            and step_dirname(20) in line
            and "trying the previous" in line
            for line in lines
        ), lines


def _commit(store: CheckpointStore, step: int, payload: bytes, tmp_path: Path) -> None:
    source = tmp_path / f"src-{step}-{len(payload)}"
    source.mkdir()
    (source / "state.bin").write_bytes(payload)
    CommitWriter(store).write_checkpoint(step, source, reason="manual", framework="demo")


def test_sizes_come_from_the_listing_only_when_it_holds_the_manifest_read(tmp_path: Path) -> None:
    """A listing taken before the commit (or before another commit of the step) does not vouch for the
    files: the damage check lists the folder then."""
    store = CheckpointStore(f"memory://roundtrips-{uuid.uuid4().hex}/run")
    _commit(store, 5, b"x" * 100, tmp_path)
    reads = WalkReads()
    found, _ = walk_down(store, lambda info: store.damage(info, reads.sizes_of(store, info)), reads=reads)
    assert found is not None and found.step == 5
    sizes = reads.sizes_of(store, found)
    assert sizes is not None and sizes["state.bin"] == 100
    assert sizes[MANIFEST_NAME] == len(reads.manifests[5])

    stale = WalkReads(objects=reads.objects, manifests={5: reads.manifests[5] + b" "})  # another commit
    assert stale.sizes_of(store, found) is None
    before = WalkReads(objects={}, manifests=reads.manifests)  # listed before the manifest was written
    assert before.sizes_of(store, found) is None
    assert WalkReads(objects=None, manifests=reads.manifests).sizes_of(store, found) is None


def test_a_payload_the_listing_shows_truncated_is_damage_on_every_backend(
    store_url: Any, tmp_path: Path, caplog: Any
) -> None:
    """The sizes a resume takes from its listing say what the step folder's own listing said: a truncated
    payload is damage, the previous checkpoint is resumed, with the one line; object stores list no
    step folder for it."""
    store = CheckpointStore(store_url.url, storage_options=store_url.storage_options)
    _commit(store, 4, b"a" * 50, tmp_path)
    _commit(store, 5, b"b" * 100, tmp_path)
    store.fs.pipe_file(posixpath.join(store.step_path(5), "state.bin"), b"b" * 60)
    store.fs.invalidate_cache()
    listed: list[str] = []
    real_find = store.fs.find

    def find(path: str, *args: Any, **kwargs: Any) -> Any:
        listed.append(path)
        return real_find(path, *args, **kwargs)

    store.fs.find = find  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        found = pull_newest_valid(store, lambda step: tmp_path / "local" / step_dirname(step))
    assert found is not None and found.step == 4
    assert (tmp_path / "local" / step_dirname(4) / "state.bin").read_bytes() == b"a" * 50
    lines = [r.getMessage() for r in caplog.records]
    assert any(
        "skipping damaged checkpoint" in line and "60 bytes but the manifest says 100" in line
        for line in lines
    ), lines
    step_listings = [path for path in listed if "/step-" in path]
    if store_url.backend == "file":  # the local disk lists each candidate's folder (and looks for fifos)
        assert len(step_listings) == 2, listed
    else:
        assert step_listings == [], listed
