"""Which lineage ``latest`` follows is decided by the store's clock, never by a writer's
(store/commit.py ``current_lineage``, store/checkpoint_store.py ``stored_times``; issue 31).

A manifest's ``created`` is its writer's clock: a host that runs 10 minutes ahead (inside the
15-minute future-dated slack) made an old run's step 50 look newer than a fresh run's step 6, and
the fresh run's relaunch resumed step 50. The order comes from when the store wrote each manifest
(S3 ``LastModified``, the local disk's ``mtime``), read from one listing; ``latest()``, the resume,
``spot-callbacks ls``, ``report`` and retention agree on it. Each attack runs on the local disk and
on moto S3."""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import StoreTarget
from lightning.pytorch.demos.boring_classes import BoringModel

from spot_callbacks import CheckpointStore, SpotConfig
from spot_callbacks.cli import main as cli_main
from spot_callbacks.engine import SpotEngine
from spot_callbacks.lightning import SpotCheckpoint
from spot_callbacks.store.checkpoint_store import stored_times
from spot_callbacks.store.commit import lineage_of
from spot_callbacks.store.layout import MANIFEST_NAME
from spot_callbacks.store.writer import CommitWriter

AHEAD = timedelta(minutes=10)  # inside the future-dated slack (15 min): today's clocks can be this far off
FORGED = "f" * 32


@pytest.fixture(params=["file", "s3"])
def store_at(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """A fresh run folder on the local disk or on moto S3: ``(url, storage_options)``."""
    if request.param == "file":
        return str(tmp_path / "store"), {}
    server = request.getfixturevalue("s3_server")
    return f"s3://{server.bucket}/lineage-{uuid.uuid4().hex}", dict(server.storage_options)


def fit(
    url: str, options: dict[str, Any], scratch: Path, ckpt_path: str | None, **kwargs: Any
) -> SpotCheckpoint:
    max_steps = kwargs.pop("max_steps")
    spot = SpotCheckpoint(
        dirpath=url,
        storage_options=options or None,
        interval=None,
        preemption=[],
        scratch_dir=str(scratch),
        **kwargs,
    )  # each on a fresh machine
    trainer = pl.Trainer(
        callbacks=[spot], max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=True,
    )  # fmt: skip
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)
    return spot


def rewrite_manifest(store: CheckpointStore, at: int, **changes: Any) -> None:
    """Rewrite the manifest of step ``at`` with ``changes`` (a host with another clock, or a forger)."""
    path = f"{store.step_path(at)}/{MANIFEST_NAME}"
    doc = json.loads(store.fs.cat_file(path))
    store.fs.pipe_file(path, json.dumps({**doc, **changes}).encode())
    if hasattr(store.fs, "invalidate_cache"):
        store.fs.invalidate_cache(store.root)


def dated(store: CheckpointStore, step: int, shift: timedelta) -> str:
    created = datetime.fromisoformat(
        json.loads(store.fs.cat_file(f"{store.step_path(step)}/{MANIFEST_NAME}"))["created"]
    )
    return (created + shift).isoformat()


def forge(store: CheckpointStore, source: int, step: int, created: datetime) -> None:
    """Copy checkpoint ``source`` to ``step`` under another lineage's id: right sizes, a sane date."""
    store.fs.makedirs(store.step_path(step), exist_ok=True)
    for name in store.fs.ls(store.step_path(source), detail=False):
        base = name.rstrip("/").rsplit("/", 1)[-1]
        store.fs.pipe_file(f"{store.step_path(step)}/{base}", store.fs.cat_file(name))
    rewrite_manifest(
        store,
        step,
        step=step,
        created=created.isoformat(),
        extra={"lineage": {"id": FORGED, "resumed_from": None}},
    )


def stamp(store: CheckpointStore, path: str) -> float:
    """When the store says it wrote ``path`` (S3 ``LastModified``, the local disk's ``mtime``)."""
    if hasattr(store.fs, "invalidate_cache"):
        store.fs.invalidate_cache(path)
    info = store.fs.info(path)
    return info["LastModified"].timestamp() if "LastModified" in info else float(info["mtime"])


def manifest_stamp(store: CheckpointStore, step: int) -> float:
    return stamp(store, f"{store.step_path(step)}/{MANIFEST_NAME}")


def store_clock_past(store: CheckpointStore, after: float, deadline_s: float = 10.0) -> None:
    """Return once the store stamps a new object later than ``after`` (S3 stamps whole seconds: a
    relaunch never lands in the second of the old run's last commit, a fast test could)."""
    probe = f"{store.root}/.clock-probe"
    give_up = time.monotonic() + deadline_s
    while True:
        store.fs.pipe_file(probe, b"")
        if stamp(store, probe) > after:
            store.fs.rm(probe)
            return
        assert time.monotonic() < give_up, f"the store's clock did not pass {after} in {deadline_s}s"
        time.sleep(0.05)


def cli(url: str, options: dict[str, Any], *argv: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert cli_main(["--storage-options", json.dumps(options), argv[0], url, *argv[1:], "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_host_clock_ten_minutes_ahead_does_not_move_a_fresh_runs_resume_point(
    store_at: tuple[str, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, options = store_at
    old = fit(url, options, tmp_path / "old", "latest", every_n_steps=10, keep_last=0, max_steps=50)
    store = CheckpointStore(url, options)
    old_steps = sorted(info.step for info in store.committed())
    assert old_steps[-1] == 50 and all(
        lineage_of(info) == old.engine.accounts.lineage["id"] for info in store.committed()
    )
    for step in old_steps:  # the old run's host clock ran 10 minutes ahead
        rewrite_manifest(store, step, created=dated(store, step, AHEAD))
    store_clock_past(store, max(manifest_stamp(store, step) for step in old_steps))

    fresh = fit(
        url, options, tmp_path / "fresh", None, every_n_steps=6, max_steps=6
    )  # no resume: a new lineage
    fresh_lineage = fresh.engine.accounts.lineage["id"]
    infos = {info.step: info for info in store.committed()}
    assert lineage_of(infos[6]) == fresh_lineage and infos[6].created < infos[50].created  # the clocks lie...
    assert manifest_stamp(store, 6) > max(
        manifest_stamp(store, step) for step in old_steps
    )  # ...the store's don't

    assert store.latest().step == 6
    listed = cli(url, options, "ls", capsys=capsys)
    assert listed["newest_valid_step"] == 6
    assert [c["step"] for c in listed["checkpoints"] if c["newest_valid"]] == [6]
    assert cli(url, options, "report", capsys=capsys)["newest_step"] == 6

    relaunch = fit(url, options, tmp_path / "relaunch", "latest", every_n_steps=6, max_steps=8)
    assert relaunch.engine.resumed.info.step == 6  # its own step 6, not the old run's step 50
    assert relaunch.engine.accounts.lineage["id"] == fresh_lineage
    assert CheckpointStore(url, options).latest().step == 8


def test_a_manifest_dated_ten_years_ahead_never_becomes_latest(
    store_at: tuple[str, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, options = store_at
    fit(url, options, tmp_path / "run", "latest", every_n_steps=4, max_steps=8)
    store = CheckpointStore(url, options)
    forge(
        store, 8, 900, datetime.now(timezone.utc) + timedelta(days=3652)
    )  # written last, by the store's clock
    assert store.latest().step == 8
    assert cli(url, options, "ls", capsys=capsys)["newest_valid_step"] == 8


def engine_for(url: str, options: dict[str, Any], keep_last: int) -> SpotEngine:
    return SpotEngine(
        SpotConfig(
            dirpath=url, storage_options=options or None, interval=None, keep_last=keep_last, preemption=[]
        ),
        "test",
    )


def save(engine: SpotEngine, step: int) -> None:
    engine.save_state(step=step, epoch=0, state={"w": torch.full((4,), float(step))}, reason="steps")
    assert engine.wait_for_commit(timeout=60)


def running(url: str, options: dict[str, Any], keep_last: int, steps: tuple[int, ...]) -> SpotEngine:
    """A fresh run, started, that committed ``steps``."""
    run = engine_for(url, options, keep_last)
    run.start()
    run.step_boundary(1)
    for step in steps:
        save(run, step)
    return run


def test_a_forged_manifest_of_another_lineage_does_not_move_a_running_runs_retention_or_resume(
    store_at: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, options = store_at
    run = running(url, options, keep_last=2, steps=(5, 10))
    # Mid-run, a manifest of another lineage appears at step 100: right sizes, dated sanely (10 min ahead).
    forge(run.store, 10, 100, datetime.now(timezone.utc) + AHEAD)
    store_clock_past(run.store, manifest_stamp(run.store, 100))
    for step in (15, 20):
        save(run, step)
    run.finish()

    store = CheckpointStore(url, options)
    # Retention followed the run's lineage: its newest two kept, the forged one neither counted nor deleted.
    assert sorted(info.step for info in store.committed()) == [15, 20, 100]
    assert store.latest().step == 20  # the run committed after the forgery: its lineage is the newest
    assert cli(url, options, "ls", capsys=capsys)["newest_valid_step"] == 20
    assert cli(url, options, "report", capsys=capsys)["newest_step"] == 20
    relaunch = engine_for(url, options, keep_last=2)
    assert relaunch.pull_latest() is not None
    assert relaunch.resumed.info.step == 20


def test_a_fresh_run_below_many_old_step_folders_is_followed(tmp_path: Path) -> None:
    """The first batch of manifests ``latest()`` reads holds the ones the store wrote last: a fresh
    run's step 6 under 150 step folders of an old run (keep_last=0) is found, not the old top."""
    store = CheckpointStore(str(tmp_path / "store"))
    running(store.url, {}, keep_last=0, steps=(10,)).finish()
    for step in range(11, 160):  # copies of the old run's checkpoint, renumbered
        store.fs.copy(store.step_path(10), store.step_path(step), recursive=True)
        rewrite_manifest(store, step, step=step)
    store_clock_past(store, manifest_stamp(store, 159))
    running(store.url, {}, keep_last=0, steps=(6,)).finish()
    assert store.latest().step == 6
    relaunch = engine_for(store.url, {}, keep_last=0)
    assert relaunch.pull_latest() is not None and relaunch.resumed.info.step == 6


def test_a_run_that_resumes_again_while_it_runs_follows_its_own_lineage(
    store_at: tuple[str, dict[str, Any]],
) -> None:
    url, options = store_at
    run = running(url, options, keep_last=2, steps=(5, 10))
    store_clock_past(run.store, manifest_stamp(run.store, 10))
    forge(run.store, 10, 100, datetime.now(timezone.utc))  # after the run's last commit, dated sanely
    # Written last by the store's clock: a relaunch cannot tell it from a run started since.
    assert CheckpointStore(url, options).latest().step == 100
    # The run itself can: it resumes its own lineage (a second train() in one process, say).
    assert run.pull_latest() is not None and run.resumed.info.step == 10
    save(run, 15)
    run.finish()
    assert sorted(info.step for info in CheckpointStore(url, options).committed()) == [10, 15, 100]


def test_every_backend_says_when_it_wrote_each_manifest(store_url: StoreTarget, tmp_path: Path) -> None:
    """The times that order lineages come from every backend's listing (S3 ``LastModified``, GCS
    ``updated``, Azure ``last_modified``, ``mtime``, memory ``created``), one for each manifest."""
    store = CheckpointStore(store_url.url, store_url.storage_options)
    (tmp_path / "state.ckpt").write_bytes(b"w" * 100)
    writer = CommitWriter(store)
    for step in (1, 2):
        writer.write_checkpoint(step, tmp_path, reason="steps", framework="demo")
    times = stored_times(store, store.step_folders())
    assert set(times) == {1, 2} and times[1] <= times[2]
    assert abs(times[2] - time.time()) < 3600  # a real time, on the store's clock (here: this machine's)


class ListingsAtOnce:
    """Delegates to ``inner``; a step listing (``ls``) waits until a recursive listing (``find``) has
    started, and records whether it had (it had not when the two go out one after the other)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.find_started = threading.Event()
        self.waited: list[bool] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def find(self, *args: Any, **kwargs: Any) -> Any:
        self.find_started.set()
        return self.inner.find(*args, **kwargs)

    def ls(self, *args: Any, **kwargs: Any) -> Any:
        self.waited.append(self.find_started.wait(timeout=30))
        return self.inner.ls(*args, **kwargs)


def test_latest_sends_its_two_listings_at_once_not_one_after_the_other(tmp_path):
    store = CheckpointStore(f"memory://listings-{uuid.uuid4().hex[:8]}/run")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "w.bin").write_bytes(b"weights")
    for step in (1, 2):
        CommitWriter(store).write_checkpoint(step, tmp_path / "src", reason="manual", framework="test")
    store.fs = wrapper = ListingsAtOnce(store.fs)
    found = store.latest()
    assert found is not None and found.step == 2
    assert wrapper.waited == [True]  # the step listing went out while the recursive one was in flight
