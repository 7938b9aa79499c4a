"""The local scratch disk: private to its user, no planted link followed, bounded, workers closed on every exit."""

from __future__ import annotations

import os
import stat
import tempfile
import threading
import uuid
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers.faultfs import FaultyFileSystem
from helpers.reliability_counts import FAULTS, record
from lightning.pytorch.demos.boring_classes import BoringModel

from spot_callbacks import CheckpointStore, ConfigError, SpotConfig
from spot_callbacks.engine import SpotEngine
from spot_callbacks.lightning import SpotCheckpoint
from spot_callbacks.store import MANIFEST_NAME, parse_step_dirname, transfer
from spot_callbacks.store.retry import RetryPolicy

NOBODY = 65534
FAST_RETRY = RetryPolicy(attempts=2, initial_backoff_s=0.001, max_backoff_s=0.01)
WORKER_NAMES = ("spot-writer", "spot-uploader", "spot-emergency", "spot-lock-release")


@pytest.fixture
def temp_dir(tmp_path, monkeypatch) -> Path:
    """The system temp dir, as tempfile sees it, moved under this test."""
    base = tmp_path / "systemp"
    base.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    monkeypatch.delenv("SPOT_SCRATCH", raising=False)
    return base


def engine_on(url: str, scratch_dir: str | None = None, **kwargs) -> SpotEngine:
    return SpotEngine(
        SpotConfig(dirpath=url, interval=None, preemption=[], scratch_dir=scratch_dir, **kwargs), "test"
    )


def step_folders(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if parse_step_dirname(p.name) is not None)


def spot_workers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.is_alive() and t.name.startswith(WORKER_NAMES)]


# ------------------------------------------------------------------------------ private
def test_the_default_scratch_is_a_per_user_folder_only_its_user_can_enter(temp_dir, tmp_path) -> None:
    engine = engine_on(str(tmp_path / "run"))
    base = engine.scratch_root.parent
    assert base == temp_dir / f"spot-callbacks-{os.getuid()}"
    for folder in (base, engine.scratch_root):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.getuid()
    engine.start()
    engine.save_state(step=1, epoch=0, state={"w": torch.ones(4)}, reason="steps")
    engine.finish()
    assert step_folders(engine.scratch_root) == [
        "step-000000001"
    ]  # the copy a restart reuses, in the 0700 folder
    if os.geteuid() == 0:  # the attack itself: another local user tries to plant a link where the run writes
        _assert_other_user_cannot_write_into(engine.scratch_root)


def _assert_other_user_cannot_write_into(folder: Path) -> None:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.symlink("/etc/passwd", folder / "step-000000002")
            os._exit(1)  # planted: the folder was open to other users
        except PermissionError:
            os._exit(0)
        except BaseException:  # noqa: BLE001
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not (folder / "step-000000002").exists()


def test_a_default_scratch_folder_made_by_another_user_is_refused_with_the_fix(temp_dir, tmp_path) -> None:
    planted = temp_dir / f"spot-callbacks-{os.getuid()}"
    planted.mkdir(mode=0o777)
    os.chown(planted, NOBODY, NOBODY)  # as another user would have made it before this run
    with pytest.raises(ConfigError) as refused:
        engine_on(str(tmp_path / "run"))
    message = str(refused.value)
    assert str(planted) in message and "another user" in message
    assert "scratch_dir" in message and "SPOT_SCRATCH" in message


def test_a_link_planted_at_the_default_scratch_folder_is_refused(temp_dir, tmp_path) -> None:
    victim = tmp_path / "victim-home"
    victim.mkdir()
    (temp_dir / f"spot-callbacks-{os.getuid()}").symlink_to(victim)
    with pytest.raises(ConfigError, match="is a link"):
        engine_on(str(tmp_path / "run"))
    assert list(victim.iterdir()) == []


def test_a_shared_scratch_folder_left_open_is_tightened_to_0700(tmp_path) -> None:
    shared = tmp_path / "shared"
    engine = engine_on(str(tmp_path / "run"), scratch_dir=str(shared))
    os.chmod(engine.scratch_root, 0o777)
    again = engine_on(str(tmp_path / "run"), scratch_dir=str(shared))
    assert stat.S_IMODE(again.scratch_root.stat().st_mode) == 0o700


def test_a_link_planted_at_a_local_write_s_temporary_name_is_never_followed(tmp_path, monkeypatch) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    folder = tmp_path / "store" / "step-000000001"
    folder.mkdir(parents=True)
    fixed = uuid.UUID(int=0xDEADBEEF)
    planted = folder / f".{MANIFEST_NAME}.{fixed.hex[:8]}.tmp"
    planted.symlink_to(victim)
    names = iter([fixed, fixed, uuid.uuid4()])  # the attacker guessed the first names drawn
    monkeypatch.setattr(transfer.uuid, "uuid4", lambda: next(names))
    store = CheckpointStore(str(tmp_path / "store"))
    transfer.put_bytes(store.fs, str(folder / MANIFEST_NAME), b'{"step": 1}')
    assert victim.read_text() == "precious"
    assert (folder / MANIFEST_NAME).read_bytes() == b'{"step": 1}' and not (
        folder / MANIFEST_NAME
    ).is_symlink()


def test_a_link_planted_at_the_local_copy_s_manifest_is_replaced_not_written_through(tmp_path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    engine = engine_on(str(tmp_path / "run"), scratch_dir=str(tmp_path / "scratch"))
    target = engine.scratch_root / "step-000000003" / MANIFEST_NAME
    target.parent.mkdir(parents=True)
    target.symlink_to(victim)
    engine.start()
    engine.save_state(step=3, epoch=0, state={"w": torch.ones(4)}, reason="steps")
    engine.finish()
    assert victim.read_text() == "precious"
    assert not target.is_symlink() and target.read_bytes() == engine.store.fs.cat_file(
        f"{engine.store.step_path(3)}/{MANIFEST_NAME}"
    )


# ------------------------------------------------------------------------------ bounded
def test_scratch_holds_one_checkpoint_however_many_resumes_on_this_machine(tmp_path) -> None:
    url, scratch = str(tmp_path / "run"), str(tmp_path / "scratch")
    step = 0
    for _ in range(6):
        engine = engine_on(url, scratch_dir=scratch, keep_last=2)
        engine.pull_latest()
        engine.start()
        for _ in range(2):
            step += 1
            engine.save_state(
                step=step, epoch=0, state={"w": torch.full((1000,), float(step))}, reason="steps"
            )
            assert engine.wait_for_commit(timeout=60)
        engine.finish()
        assert step_folders(engine.scratch_root) == [f"step-{step:09d}"]
    assert [info.step for info in CheckpointStore(url).committed()] == [step - 1, step]


def test_thirty_failing_checkpoints_in_a_row_leave_one_failed_copy(tmp_path, caplog) -> None:
    engine = engine_on(str(tmp_path / "run"), scratch_dir=str(tmp_path / "scratch"), keep_last=0)
    engine.start()
    engine.save_state(step=1, epoch=0, state={"w": torch.ones(100)}, reason="steps")
    assert engine.wait_for_commit(timeout=60)
    faulty = FaultyFileSystem(engine.store.fs)
    faulty.permanent = True
    engine.store.fs, engine.store.retry = faulty, FAST_RETRY
    caplog.set_level("INFO", logger="spot_callbacks")
    for step in range(2, 32):
        engine.save_state(step=step, epoch=0, state={"w": torch.full((100,), float(step))}, reason="steps")
        engine.wait_for_commit(timeout=60)
        folders = step_folders(engine.scratch_root)
        uncommitted = [name for name in folders if not (engine.scratch_root / name / MANIFEST_NAME).exists()]
        assert uncommitted == [f"step-{step:09d}"], folders  # the newest failed copy only
        assert "step-000000001" in folders  # and the newest committed one, for a restart here
    assert len(engine.new_failures()) == 30
    assert any("kept step-000000001, step-000000031" in r.getMessage() for r in caplog.records)
    engine.store.fs = faulty.inner
    with pytest.raises(Exception, match="step 31"):
        engine.finish()  # the newest checkpoint failed: the run fails
    assert spot_workers() == []
    record(FAULTS, faulty.injected)


class FailsAtStep(BoringModel):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.fail_at = step

    def training_step(self, batch, batch_idx):
        if self.global_step == self.fail_at:
            raise ValueError("the user's bug")
        return super().training_step(batch, batch_idx)


def test_no_worker_thread_outlives_a_failing_or_succeeding_fit(tmp_path) -> None:
    url, scratch = str(tmp_path / "run"), str(tmp_path / "scratch")
    assert spot_workers() == []
    for fails in (True, False, True, False):
        spot = SpotCheckpoint(dirpath=url, interval=None, every_n_steps=2, keep_last=2, preemption=[],
                              scratch_dir=scratch)  # fmt: skip
        latest = spot.store.latest()
        start = latest.step if latest is not None else 0
        trainer = pl.Trainer(callbacks=[spot], logger=False, enable_progress_bar=False,
                             enable_model_summary=False, max_steps=start + 6)  # fmt: skip
        if fails:
            with pytest.raises(ValueError, match="the user's bug"):
                trainer.fit(FailsAtStep(start + 3), ckpt_path="latest")
        else:
            trainer.fit(BoringModel(), ckpt_path="latest")
        assert spot_workers() == []
        assert len(step_folders(spot.engine.scratch_root)) == 1
