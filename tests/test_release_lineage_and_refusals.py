"""What a run holds is released on every exit, a lost
lock fails the run, retention follows the lineage, damage has one verdict, the ledger sees every
interruption, and URLs that cannot be what the user meant are refused before training."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pickle
import shutil
import socket
import struct
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import transformers
from lightning.pytorch.demos.boring_classes import BoringModel

from spot_callbacks import CheckpointStore, ConfigError, RunLockedError, SpotConfig
from spot_callbacks.cli import main as cli_main
from spot_callbacks.engine import SpotEngine
from spot_callbacks.errors import CorruptCheckpointError, LockLostError, StoreUnavailableError
from spot_callbacks.hf import SpotCheckpointCallback
from spot_callbacks.lightning import SpotCheckpoint
from spot_callbacks.store.runlock import RunLock
from spot_callbacks.store.writer import CommitWriter

# ------------------------------------------------------------------ item 4: misread URLs


@pytest.mark.parametrize(
    ("dirpath", "fix"),
    [
        ("s3:/bucket/run", "'s3://bucket/run'"),
        ("gs:/bucket/run", "'gs://bucket/run'"),
        ("az:/container/run", "'az://container/run'"),
        ("abfs:/container/run", "'abfs://container/run'"),
        ("s3:bucket/run", "'s3://bucket/run'"),
        ("file:/tmp/run", "'file:///tmp/run'"),
    ],
)
def test_a_url_with_one_slash_after_its_scheme_is_refused_before_anything_is_written(
    dirpath: str, fix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # where fsspec would have made the folder "s3:"
    for build in (SpotConfig, SpotCheckpoint, SpotCheckpointCallback):
        with pytest.raises(ConfigError) as refused:
            build(dirpath=dirpath, preemption=[])
        message = str(refused.value)
        assert f"dirpath={dirpath!r}" in message and fix in message and "local folder" in message
    assert cli_main(["ls", dirpath]) != 0
    assert list(tmp_path.iterdir()) == []  # no folder named "s3:" (or anything else)


@pytest.mark.parametrize("name", ["run[1]", "run*", "run?"])
def test_a_dirpath_fsspec_would_glob_on_delete_is_refused_and_another_runs_folder_keeps_its_files(
    name: str, tmp_path: Path
) -> None:
    # fsspec's rm expands *, ? and [ in a path: retention deleting under "run[1]" would match "run1".
    neighbour = CheckpointStore((tmp_path / "run1").as_uri())
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "state.ckpt").write_bytes(b"x" * 10)
    CommitWriter(neighbour).write_checkpoint(3, tmp_path / "src", reason="end", framework="test")
    dirpath = str(tmp_path / name)
    with pytest.raises(ConfigError) as refused:
        SpotConfig(dirpath=dirpath, preemption=[])
    assert f"dirpath={dirpath!r} contains {name[-1] if name[-1] != ']' else '['!r}" in str(refused.value)
    assert "name the folder without *, ? and [" in str(refused.value)
    with pytest.raises(StoreUnavailableError, match="which fsspec expands as a glob"):
        CheckpointStore(dirpath)
    assert cli_main(["rm", dirpath, "3"]) != 0
    assert [info.step for info in neighbour.committed()] == [3]


def test_urls_that_are_fine_are_not_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for dirpath in (
        "runs/exp:1",
        "C:/runs/a",
        "./s3:/bucket",
        "s3://bucket/run",
        "memory://x/run",
        "file:///tmp/r",
    ):
        assert SpotConfig(dirpath=dirpath).dirpath == dirpath


@pytest.mark.parametrize("dirpath", ["runs/exp1", "{tmp}/run", "file://{tmp}/run"])
def test_storage_options_for_a_local_path_are_refused_naming_the_fix(dirpath: str, tmp_path: Path) -> None:
    dirpath = dirpath.format(tmp=tmp_path)
    with pytest.raises(ConfigError) as refused:
        SpotConfig(dirpath=dirpath, storage_options={"key": "AKIA-hunter2", "endpoint_url": "http://x"})
    message = str(refused.value)
    assert "local folder" in message and "s3://bucket/run" in message and "drop storage_options" in message
    assert "endpoint_url" in message and "hunter2" not in message  # names the keys, never a value
    assert SpotConfig(dirpath=dirpath, storage_options={}).storage_options == {}
    assert not os.path.exists(tmp_path / "run")


# ------------------------------------------------------------------ item 5: every exit releases the lock
REPO_ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("hf_run", REPO_ROOT / "tests" / "scripts" / "hf_run.py")
hf_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_run)


def hf_trainer(output_dir: Path, callbacks: list, max_steps: int) -> transformers.Trainer:
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=8, learning_rate=5e-3,
        seed=1, save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    return transformers.Trainer(
        model=hf_run.build_model(), args=args, train_dataset=hf_run.TokenData(), callbacks=callbacks
    )


class Boom(RuntimeError):
    pass


class HfFailing(transformers.TrainerCallback):
    """A user's callback that fails in one event (at one step)."""

    def __init__(self, event: str, step: int = 0, error: type[BaseException] = Boom) -> None:
        self.event, self.step, self.error = event, step, error

    def __getattribute__(self, name: str):  # noqa: ANN204
        if name.startswith("on_") and name == object.__getattribute__(self, "event"):

            def fail(args, state, control, **kwargs):  # noqa: ANN001, ANN202
                if state.global_step >= self.step:
                    raise self.error(f"{name} at step {state.global_step}")

            return fail
        return object.__getattribute__(self, name)


def lock_of(url: str, options: dict | None = None) -> dict | None:
    return RunLock(CheckpointStore(url, storage_options=options)).holder()


def released(engine: Any) -> bool:
    return engine.lease.lock is None and not engine.running


@pytest.mark.parametrize(
    ("event", "step", "error"),
    [
        ("on_train_begin", 0, Boom),  # a user callback failing after ours started the run
        ("on_step_end", 5, Boom),  # an exception at step 5
        ("on_step_end", 3, KeyboardInterrupt),
    ],
)
def test_an_hf_train_that_raises_releases_the_run_lock(event: str, step: int, error, tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    spot = SpotCheckpointCallback(dirpath=url, interval=None, every_n_steps=2, preemption=[])
    trainer = hf_trainer(tmp_path / "out", [spot, HfFailing(event, step, error)], max_steps=10)
    with pytest.raises(error):
        trainer.train()
    assert lock_of(url) is None and released(spot.engine)
    if step == 5:  # what committed before the failure stays committed
        assert [info.step for info in spot.store.committed()] == [2, 4]


def test_an_hf_run_whose_start_fails_after_the_lock_releases_it(tmp_path: Path, monkeypatch) -> None:
    url = str(tmp_path / "store")
    spot = SpotCheckpointCallback(dirpath=url, interval=None, preemption=[])

    def failing_watch(is_writer: bool) -> None:
        assert lock_of(url) is not None  # the lock was taken: the start fails half-way
        raise OSError("no such device")

    monkeypatch.setattr(spot.engine.watch, "start", failing_watch)
    with pytest.raises(OSError, match="no such device"):
        hf_trainer(tmp_path / "out", [spot], max_steps=4).train()
    assert lock_of(url) is None and released(spot.engine)


def test_an_hf_run_on_s3_that_raises_at_step_5_lets_the_next_run_start_at_once(
    s3_server: Any, tmp_path: Path, monkeypatch, caplog
) -> None:
    url, options = f"s3://{s3_server.bucket}/unwind-{uuid.uuid4().hex[:8]}", dict(s3_server.storage_options)
    spot = SpotCheckpointCallback(dirpath=url, storage_options=options, interval=None, preemption=[])
    with pytest.raises(Boom):
        hf_trainer(tmp_path / "a", [spot, HfFailing("on_step_end", 5)], max_steps=10).train()
    assert lock_of(url, options) is None
    monkeypatch.setattr(socket, "gethostname", lambda: "another-host")  # the next run, on another machine
    caplog.set_level(logging.WARNING, logger="spot_callbacks")
    nxt = SpotCheckpointCallback(dirpath=url, storage_options=options, interval=None, preemption=[])
    hf_trainer(tmp_path / "b", [nxt], max_steps=2).train()
    assert "waiting up to" not in caplog.text  # no wait for a dead owner's lock
    assert [info.step for info in nxt.store.committed()] == [2]


class LightningFailing(pl.Callback):
    def __init__(self, step: int, error: type[BaseException] = Boom, fail_on_exception: bool = False) -> None:
        self.step, self.error, self.fail_on_exception = step, error, fail_on_exception

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_step >= self.step:
            raise self.error(f"at step {trainer.global_step}")

    def on_exception(self, trainer, pl_module, exception) -> None:  # noqa: ANN001
        if self.fail_on_exception:  # runs before ours (a Checkpoint goes last): ours never does
            raise Boom("on_exception failed too")


def lightning_fit(spot: Any, *callbacks: Any, max_steps: int = 10) -> None:
    trainer = pl.Trainer(
        callbacks=[spot, *callbacks], max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=True,
    )  # fmt: skip
    trainer.fit(BoringModel(), ckpt_path="latest")


@pytest.mark.parametrize(
    ("error", "fail_on_exception", "raised"),
    [(Boom, True, Boom), (KeyboardInterrupt, False, SystemExit), (Boom, False, Boom)],
)
def test_a_lightning_fit_that_raises_releases_the_run_lock(
    error, fail_on_exception: bool, raised, tmp_path: Path
) -> None:
    url = str(tmp_path / "store")
    spot = SpotCheckpoint(dirpath=url, interval=None, every_n_steps=2, preemption=[])
    with pytest.raises(raised):
        lightning_fit(spot, LightningFailing(5, error, fail_on_exception))
    assert lock_of(url) is None and released(spot.engine)
    assert 4 in [info.step for info in spot.store.committed()]


def test_a_lightning_run_whose_start_fails_after_the_lock_releases_it(tmp_path: Path, monkeypatch) -> None:
    url = str(tmp_path / "store")
    spot = SpotCheckpoint(dirpath=url, interval=None, preemption=[])
    monkeypatch.setattr(
        spot.engine.watch, "start", lambda is_writer: (_ for _ in ()).throw(OSError("no device"))
    )
    with pytest.raises(OSError, match="no device"):
        lightning_fit(spot)
    assert lock_of(url) is None and released(spot.engine)


# ------------------------------------------------------------------ item 10: a run that lost its lock fails
def take_the_lock_over(url: str, monkeypatch: pytest.MonkeyPatch, ours: Any) -> SpotEngine:
    """Another run starts on the same dirpath with SPOT_FORCE_LOCK=1; wait until our heartbeat saw it."""
    monkeypatch.setenv("SPOT_FORCE_LOCK", "1")
    for _ in range(20):
        other = SpotEngine(SpotConfig(dirpath=url, interval=None, preemption=[]), "other")
        try:
            other.start()
            break
        except RunLockedError:  # our heartbeat rewrote the lock between its read and its write: the
            other.stop()  # take-over is refused (read back), never shared; a second attempt takes it
    monkeypatch.delenv("SPOT_FORCE_LOCK")
    deadline = time.monotonic() + 30
    while not ours.lease.lost:  # polling a condition, with a deadline
        assert time.monotonic() < deadline, "the heartbeat never noticed the take-over"
        time.sleep(0.02)
    return other


class TakeOver:
    """At ``step``, another run takes the lock over (the hooks of both frameworks call ``at``)."""

    def __init__(self, url: str, monkeypatch: pytest.MonkeyPatch, spot: Any, step: int) -> None:
        self.url, self.monkeypatch, self.spot, self.step = url, monkeypatch, spot, step
        self.other: SpotEngine | None = None

    def at(self, step: int) -> None:
        if step == self.step and self.other is None:
            self.other = take_the_lock_over(self.url, self.monkeypatch, self.spot.engine)


def check_lost_lock_failure(
    error: LockLostError, url: str, other: SpotEngine, store: CheckpointStore
) -> None:
    message = str(error)
    assert isinstance(error, RuntimeError) and "lost the run lock" in message and url in message
    assert "at step 5" in message and "stopped checkpointing" in message, message
    # The heartbeat names the run that took the lock over: a take-over overwrites the lock in one
    # step, so there is no instant in which the old owner could read it as deleted.
    assert f"run {other.lease.lock.run_id[:8]}" in message and "it was deleted" not in message, message
    # Nothing after the loss. Step 2 may have been replaced by step 4 before its upload began (the
    # newest written checkpoint wins; the steps are ~1 ms apart here): seen once on a loaded box.
    assert [info.step for info in store.committed()] in ([2, 4], [4])
    assert lock_of(url)["run_id"] == other.lease.lock.run_id  # the other run's lock is left alone
    other.finish()


def test_a_lightning_run_that_lost_its_lock_fails_at_the_end_of_the_step(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPOT_LOCK_STALE_S", "0.4")  # heartbeats every 0.1 s
    url = str(tmp_path / "store")
    spot = SpotCheckpoint(dirpath=url, interval=None, every_n_steps=2, preemption=[])
    take = TakeOver(url, monkeypatch, spot, step=5)

    class AtStep(pl.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
            take.at(trainer.global_step)

    with pytest.raises(LockLostError) as failed:
        lightning_fit(spot, AtStep(), max_steps=20)
    check_lost_lock_failure(failed.value, url, take.other, spot.store)
    assert released(spot.engine)


def test_an_hf_run_that_lost_its_lock_fails_at_the_end_of_the_step(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPOT_LOCK_STALE_S", "0.4")
    url = str(tmp_path / "store")
    spot = SpotCheckpointCallback(dirpath=url, interval=None, every_n_steps=2, preemption=[])
    take = TakeOver(url, monkeypatch, spot, step=5)

    class AtStep(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs) -> None:  # noqa: ANN001, ANN003
            take.at(state.global_step)

    with pytest.raises(LockLostError) as failed:
        hf_trainer(tmp_path / "out", [AtStep(), spot], max_steps=20).train()
    check_lost_lock_failure(failed.value, url, take.other, spot.store)
    assert released(spot.engine)


# ------------------------------------------------------------------ item 8: retention by lineage
def committed_steps(store: CheckpointStore) -> list[int]:
    return [info.step for info in store.committed()]


def test_retention_keeps_the_resume_point_and_the_lineage_newest_past_an_unloadable_top(
    tmp_path: Path, caplog
) -> None:
    url = str(tmp_path / "store")
    first = SpotCheckpoint(
        dirpath=url,
        interval=None,
        every_n_steps=5,
        keep_last=0,
        preemption=[],
        scratch_dir=str(tmp_path / "first"),
    )  # each on a fresh machine

    class Settle(pl.Callback):  # each checkpoint commits before the next (newest wins would drop it)
        def on_train_batch_end(self, *args) -> None:  # noqa: ANN002
            assert first.engine.wait_for_commit(timeout=60)

    lightning_fit(first, Settle(), max_steps=20)
    assert committed_steps(first.store) == [5, 10, 15, 20]
    state = Path(first.store.step_path(20)) / "state.ckpt"
    state.write_bytes(b"\0" * state.stat().st_size)  # committed, right size, unloadable

    caplog.set_level(logging.WARNING, logger="spot_callbacks")
    second = SpotCheckpoint(
        dirpath=url,
        interval=None,
        every_n_steps=1,
        keep_last=1,
        preemption=[],
        scratch_dir=str(tmp_path / "second"),
    )  # each on a fresh machine
    lightning_fit(second, max_steps=18)
    assert second.engine.resumed.info.step == 15
    # 15: what this run resumed from; 18: the lineage's newest; 20: damaged, neither counted nor deleted.
    assert committed_steps(second.store) == [15, 18, 20]
    said = [r.getMessage() for r in caplog.records if "below step 20" in r.getMessage()]
    assert said and "resuming" in said[0] and "follows the lineage of the newest commit" in said[0], said

    third = SpotCheckpoint(
        dirpath=url,
        interval=None,
        every_n_steps=1,
        keep_last=1,
        preemption=[],
        scratch_dir=str(tmp_path / "third"),
    )  # each on a fresh machine
    lightning_fit(third, max_steps=19)
    assert third.engine.resumed.info.step == 18  # never a fresh start
    assert committed_steps(third.store) == [18, 19, 20]


def engine_for(url: str, keep_last: int) -> SpotEngine:
    config = SpotConfig(dirpath=url, interval=None, keep_last=keep_last, preemption=[])
    return SpotEngine(config, "test")


def save(engine: SpotEngine, step: int, reason: str = "steps") -> None:
    engine.save_state(step=step, epoch=0, state={"w": torch.full((4,), float(step))}, reason=reason)
    assert engine.wait_for_commit(timeout=60)


def test_a_fresh_run_on_an_old_dirpath_keeps_its_own_checkpoints_and_resumes_them(
    tmp_path: Path, caplog
) -> None:
    url = str(tmp_path / "store")
    old = engine_for(url, keep_last=0)
    old.start()
    for step in (30, 50):
        save(old, step)
    old.finish()

    caplog.set_level(logging.WARNING, logger="spot_callbacks")
    fresh = engine_for(url, keep_last=1)  # fit() without a resume, same dirpath
    fresh.start()
    fresh.step_boundary(1)
    for step in (5, 10):
        save(fresh, step)
    save(fresh, 12, reason="preemption")  # SIGTERM: the emergency checkpoint
    fresh.finish()
    assert committed_steps(fresh.store) == [12, 30, 50]  # its own never pruned for 30 and 50
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "holds checkpoints up to step 50 and this run started afresh" in said

    relaunch = engine_for(url, keep_last=1)
    assert relaunch.pull_latest() is not None
    assert relaunch.resumed.info.step == 12  # the new run's checkpoint, not the old run's step 50
    assert relaunch.store.latest().step == 12
    relaunch.start()
    save(relaunch, 13)
    relaunch.finish()
    assert committed_steps(relaunch.store) == [12, 13, 30, 50]  # 12 resumed from; 10 pruned


# ------------------------------------------------------------------ item 9: one damage verdict
@pytest.fixture(scope="module")
def hf_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """An HF run's store with steps 5 and 10 committed, and a pristine copy of step 10."""
    tmp = tmp_path_factory.mktemp("hf-damage")
    url = str(tmp / "store")
    spot = SpotCheckpointCallback(dirpath=url, interval=None, every_n_steps=5, keep_last=0, preemption=[])

    class Settle(transformers.TrainerCallback):  # each checkpoint commits before the next
        def on_step_begin(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            assert spot.engine.wait_for_commit(timeout=60)

    hf_trainer(tmp / "out", [spot, Settle()], max_steps=10).train()
    assert committed_steps(spot.store) == [5, 10]
    pristine = spot.store.pull(10, tmp / "pristine-10")
    return url, pristine


def _lying_safetensors(folder: Path) -> None:
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + length])
    name = next(key for key in header if key != "__metadata__")
    header[name]["data_offsets"] = [0, len(raw) * 4]  # points far past the end
    text = json.dumps(header).encode().ljust(length)
    path.write_bytes(raw[:8] + text[:length] + raw[8 + length :])


def _trainer_state(change) -> Any:  # noqa: ANN001
    def edit(folder: Path) -> None:
        doc = json.loads((folder / "trainer_state.json").read_text())
        change(doc)
        (folder / "trainer_state.json").write_text(json.dumps(doc))

    return edit


HOSTILE_HF = {
    "truncated optimizer.pt": lambda f: (f / "optimizer.pt").write_bytes(
        (f / "optimizer.pt").read_bytes()[:500]
    ),
    "a pickle in scheduler.pt": lambda f: (f / "scheduler.pt").write_bytes(pickle.dumps(datetime.now())),
    "wrong RNG values": lambda f: torch.save(
        {"python": "x", "numpy": 1, "cpu": torch.ones(3)}, f / "rng_state.pth"
    ),
    "a safetensors header that lies": _lying_safetensors,
    "no model.safetensors": lambda f: (f / "model.safetensors").unlink(),
    "an unknown trainer_state key": _trainer_state(lambda doc: doc.update(surprise=1)),
    "deep nesting": _trainer_state(lambda doc: doc.update(log_history=[json.loads("[" * 200 + "]" * 200)])),
    "global_step 10**15": _trainer_state(lambda doc: doc.update(global_step=10**15)),
    # Values of known keys that the Trainer uses unchecked (issue 21 item 11): each crashed train().
    "log_history a string": _trainer_state(lambda doc: doc.update(log_history="x" * 1000)),
    "logging_steps 0": _trainer_state(lambda doc: doc.update(logging_steps=0)),
    "train_batch_size a string": _trainer_state(lambda doc: doc.update(train_batch_size="8")),
    "total_flos a string": _trainer_state(lambda doc: doc.update(total_flos="1e400")),
    "stateful_callbacks a list": _trainer_state(lambda doc: doc.update(stateful_callbacks=[1, 2])),
}


@pytest.mark.parametrize("case", list(HOSTILE_HF))
def test_an_hf_checkpoint_the_trainer_cannot_load_is_damage_and_the_resume_falls_back(
    case: str, hf_store: tuple[str, Path], tmp_path: Path, caplog
) -> None:
    url, pristine = hf_store
    store = CheckpointStore(url)
    folder = tmp_path / "hostile"
    shutil.copytree(pristine, folder)
    HOSTILE_HF[case](folder)
    # Committed as a writer would: valid manifest, right sizes and checksums.
    CommitWriter(store).write_checkpoint(
        10, folder, reason="interval", framework="hf", extra=store.read_manifest(10).extra
    )
    caplog.set_level(logging.WARNING, logger="spot_callbacks")
    fresh = SpotCheckpointCallback(dirpath=url, interval=None, preemption=[], scratch_dir=str(tmp_path / "s"))
    trainer = hf_trainer(tmp_path / "out", [fresh], max_steps=12)
    assert fresh.latest() == str(tmp_path / "out" / "checkpoint-5")
    warned = [r.getMessage() for r in caplog.records if "skipping damaged checkpoint" in r.getMessage()]
    assert len(warned) == 1 and "step-000000010" in warned[0], warned
    if case == "truncated optimizer.pt":  # the Trainer resumes from what latest() gave it
        trainer.train(resume_from_checkpoint=fresh.latest())
        assert trainer.state.global_step == 12
        store.delete(12)  # the store stays 5 and 10 for the next case
    shutil.copytree(pristine, tmp_path / "again")  # put step 10 back for the next case
    CommitWriter(store).write_checkpoint(
        10, tmp_path / "again", reason="interval", framework="hf", extra=store.read_manifest(10).extra
    )


@pytest.mark.parametrize(
    ("framework", "files"), [("lightning", {}), ("lightning", {"other.bin"}), ("hf", {})]
)
def test_a_manifest_without_the_payload_its_framework_needs_is_damaged_everywhere(
    framework: str, files: set, tmp_path: Path, capsys
) -> None:
    store = CheckpointStore(str(tmp_path / "store"))
    good = tmp_path / "good"
    good.mkdir()
    (good / "state.ckpt").write_bytes(b"x" * 10)
    (good / "trainer_state.json").write_text("{}")
    CommitWriter(store).write_checkpoint(4, good, reason="interval", framework=framework)
    doc = json.loads(Path(store.step_path(4), "manifest.json").read_text())
    doc["step"] = 8
    doc["files"] = {name: doc["files"]["state.ckpt"] for name in files}
    Path(store.step_path(8)).mkdir()
    for name in files:
        Path(store.step_path(8), name).write_bytes(b"x" * 10)
    Path(store.step_path(8), "manifest.json").write_text(json.dumps(doc))
    assert store.latest().step == 4
    with pytest.raises(CorruptCheckpointError, match="lists no"):
        store.verify(8)
    capsys.readouterr()
    assert cli_main(["ls", store.url]) == 0
    rows = {
        line.split()[0].lstrip("*"): line
        for line in capsys.readouterr().out.splitlines()
        if line.strip()[:1].isdigit() or line.startswith("*")
    }
    assert "lists no" in rows["8"] and "newest valid" not in rows["8"]
