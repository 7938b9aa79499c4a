"""The local scratch disk: private to its user, no planted link followed, bounded (per dirpath and across
dirpaths: recorded, listed, held by live runs, cleaned), workers closed on every exit."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers.faultfs import FaultyFileSystem
from helpers.reliability_counts import FAULTS, record
from lightning.pytorch.demos.boring_classes import BoringModel

import spot_callbacks.persist.scratch_folders as scratch_folders
from spot_callbacks import CheckpointStore, ConfigError, SpotConfig
from spot_callbacks.cli import main
from spot_callbacks.engine import SpotEngine
from spot_callbacks.lightning import SpotCheckpoint
from spot_callbacks.persist.scratch import default_scratch_root
from spot_callbacks.persist.scratch_folders import RECORD_NAME, ScratchClaim, list_scratch, wait_for_sweeps
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
    # keep_last=2 of this run's own, plus the step it resumed from (retention never deletes that one)
    assert [info.step for info in CheckpointStore(url).committed()] == [step - 2, step - 1, step]


def test_a_resume_deletes_the_older_copies_in_scratch_before_any_commit(tmp_path) -> None:
    """Issue 23: a node that does not write (no persister prunes its scratch) kept the copy it pulled
    at every resume; now each resume drops the copies older than the step it resumed from."""
    url, here, elsewhere = str(tmp_path / "run"), str(tmp_path / "here"), str(tmp_path / "elsewhere")
    for step, scratch in ((5, here), (10, elsewhere)):
        engine = engine_on(url, scratch_dir=scratch, keep_last=0)
        engine.start()
        engine.save_state(step=step, epoch=0, state={"w": torch.full((8,), float(step))}, reason="steps")
        assert engine.wait_for_commit(timeout=60)
        engine.finish()
    resumed = engine_on(url, scratch_dir=here, keep_last=0)
    assert step_folders(resumed.scratch_root) == ["step-000000005"]  # this machine's copy of step 5
    assert resumed.pull_latest() == resumed.scratch_root / "step-000000010"
    assert step_folders(resumed.scratch_root) == ["step-000000010"]  # before any commit of this run
    assert resumed.last_saved_step == 10


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


# ------------------------------------------------------------------ across dirpaths (issues 21.7, 23)
DAY_S = 86400.0

HOLDER = """
import sys
from pathlib import Path
from spot_callbacks.persist.scratch_folders import claim_scratch
claim_scratch(Path(sys.argv[1]), sys.argv[2])
print("ready", flush=True)
sys.stdin.read()
"""


def make_folder(base: Path, url: str, payload_bytes: int = 1000, age_s: float = 0.0) -> Path:
    """A scratch folder of ``url`` as an earlier run left it: a record, a step folder, last used ``age_s`` ago."""
    folder = default_scratch_root(url, scratch_dir=str(base))
    (folder / "step-000000010").mkdir(parents=True)
    (folder / "step-000000010" / "state.ckpt").write_bytes(b"x" * payload_bytes)
    ScratchClaim(folder, url).release()
    then = time.time() - age_s
    record = folder / RECORD_NAME
    record.write_text(json.dumps({"dirpath": url, "last_used": then}))
    for path in [*folder.rglob("*"), folder]:
        os.utime(path, (then, then), follow_symlinks=False)
    return folder


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[Path]:
    """A scratch folder held by a live child process (a run on this host) for the test's duration."""
    folder = make_folder(tmp_path / "base", "s3://bucket/held", age_s=30 * DAY_S)
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder), "s3://bucket/held"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        yield folder
    finally:
        child.communicate(input="")
    assert child.returncode == 0


def test_the_engine_records_its_dirpath_and_holds_its_folder(tmp_path: Path) -> None:
    engine = SpotEngine(
        SpotConfig(
            dirpath=str(tmp_path / "store"), interval=None, preemption=[], scratch_dir=str(tmp_path / "s")
        ),
        "demo",
    )
    [folder] = list_scratch(tmp_path / "s")
    assert folder.path == engine.scratch_root
    assert folder.dirpath == engine.store.url
    assert folder.held_by == f"pid {os.getpid()}"
    assert time.time() - folder.last_used < 3600


def test_the_record_keeps_no_credentials(tmp_path: Path) -> None:
    folder = tmp_path / "0123456789ab"
    folder.mkdir()
    ScratchClaim(folder, "ftp://alice:hunter2@files.example:2121/runs/a").release()
    record = (folder / RECORD_NAME).read_text()
    assert "hunter2" not in record and "alice" not in record
    assert json.loads(record)["dirpath"] == "ftp://files.example:2121/runs/a"


def test_scratch_lists_each_folder_with_its_dirpath_size_and_holder(
    tmp_path: Path, holder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_folder(tmp_path / "base", "s3://bucket/old", payload_bytes=5_000_000, age_s=10 * DAY_S)
    assert main(["scratch", "--root", str(tmp_path / "base")]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"{tmp_path / 'base'}: 2 scratch folders, 5.0 MB"
    assert lines[1].split() == ["FOLDER", "DIRPATH", "SIZE", "LAST", "USE", "(UTC)", "HELD", "BY"]
    old = next(line for line in lines if "s3://bucket/old" in line)
    assert "5.0 MB" in old and old.rstrip().endswith("-")
    held = next(line for line in lines if "s3://bucket/held" in line)
    assert held.rstrip().endswith(f"pid {holder_pid(holder)}")
    assert sorted(path.name for path in (tmp_path / "base").iterdir()) == sorted(
        [holder.name, default_scratch_root("s3://bucket/old", str(tmp_path / "base")).name]
    )  # listing deletes nothing


def holder_pid(folder: Path) -> int:
    [marker] = folder.glob(".spot-scratch-live-*.json")
    return json.loads(marker.read_text())["pid"]


def test_clean_deletes_what_no_live_run_holds_and_nothing_through_a_link(
    tmp_path: Path, holder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = tmp_path / "base"
    idle = make_folder(base, "s3://bucket/idle", age_s=DAY_S)
    dead = make_folder(base, "s3://bucket/dead")
    # A folder whose run died: its marker names a process that is gone.
    gone = subprocess.run([sys.executable, "-c", HOLDER, str(dead), "s3://bucket/dead"], input="", text=True)
    assert gone.returncode == 0 and list(dead.glob(".spot-scratch-live-*.json"))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("the user's")
    (base / "fedcba987654").symlink_to(outside)  # a link with a scratch folder's name
    (idle / "step-000000010" / "escape").symlink_to(outside)  # a link inside a folder being deleted
    assert main(["scratch", "--root", str(base), "--clean"]) == 0
    out = capsys.readouterr().out
    assert "deleted 2 folders" in out and "kept 1 a live run holds" in out
    assert not idle.exists() and not dead.exists()
    assert holder.is_dir() and (holder / "step-000000010" / "state.ckpt").is_file()
    assert (outside / "keep.txt").read_text() == "the user's" and (base / "fedcba987654").is_symlink()


def test_clean_dry_run_lists_what_clean_would_delete_and_whose_it_was_and_deletes_nothing(
    tmp_path: Path, holder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = tmp_path / "base"
    idle = make_folder(base, "s3://bucket/idle", payload_bytes=2_000_000, age_s=DAY_S)
    assert main(["scratch", "--root", str(base), "--clean", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    summary = next(line for line in lines if line.startswith("would delete"))
    assert summary.startswith(
        "would delete 1 folder (2.0 MB); would keep 1 a live run holds; nothing deleted"
    )
    listed = [line for line in lines if line.startswith("  ")]
    assert len(listed) == 1 and idle.name in listed[0] and "s3://bucket/idle" in listed[0], lines
    assert idle.is_dir() and holder.is_dir()  # nothing deleted
    assert main(["scratch", "--root", str(base), "--dry-run"]) == 1  # --dry-run alone is refused
    assert "--dry-run goes with --clean" in capsys.readouterr().err


def test_clean_older_than_keeps_recent_folders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = tmp_path / "base"
    old = make_folder(base, "s3://bucket/old", age_s=8 * DAY_S)
    recent = make_folder(base, "s3://bucket/recent", age_s=DAY_S)
    assert main(["scratch", "--root", str(base), "--clean", "--older-than", "7d"]) == 0
    assert "deleted 1 folder (" in capsys.readouterr().out
    assert not old.exists() and recent.is_dir()


def test_a_new_run_deletes_other_dirpaths_folders_past_the_keep_time(
    tmp_path: Path, holder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = tmp_path / "base"
    old = make_folder(base, "s3://bucket/old", age_s=8 * DAY_S)
    recent = make_folder(base, "s3://bucket/recent", age_s=6 * DAY_S)
    stranger = base / "notes"  # not a scratch folder's name: never touched
    stranger.mkdir()
    os.utime(stranger, (0, 0))
    SpotEngine(
        SpotConfig(dirpath=str(tmp_path / "store"), interval=None, preemption=[], scratch_dir=str(base)),
        "demo",
    )
    assert wait_for_sweeps(timeout_s=60)
    # Seen once in CI under load (not reproduced): old still there. What the sweep saw, if it happens again.
    seen = [
        (f.path.name, f.dirpath, f.held_by, round(time.time() - f.last_used))
        for f in scratch_folders.list_scratch(base)
    ]
    assert not old.exists(), seen
    assert recent.is_dir() and holder.is_dir() and stranger.is_dir()  # newer than 7 days; held by a live run


def test_the_start_does_not_wait_for_the_sweep_of_old_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 28: on a machine reused for many runs, sizing and deleting old folders is not paid before
    the first step: the engine is made (its folder recorded and held) while the sweep is still blocked."""
    base = tmp_path / "base"
    old = make_folder(base, "s3://bucket/old", age_s=8 * DAY_S)
    release, sweeping = threading.Event(), threading.Event()
    sweep = scratch_folders.sweep_scratch

    def blocked_sweep(*args, **kwargs):
        sweeping.set()
        assert release.wait(timeout=60)
        return sweep(*args, **kwargs)

    monkeypatch.setattr(scratch_folders, "sweep_scratch", blocked_sweep)
    try:
        engine = SpotEngine(
            SpotConfig(dirpath=str(tmp_path / "store"), interval=None, preemption=[], scratch_dir=str(base)),
            "demo",
        )
        assert sweeping.wait(timeout=60)
        held = {folder.path: folder.held_by for folder in list_scratch(base)}
        assert held == {engine.scratch_root: f"pid {os.getpid()}", old: None}  # made, held; nothing swept yet
        assert not wait_for_sweeps(timeout_s=0)  # the sweep still runs
    finally:
        release.set()
    with caplog.at_level("INFO", logger="spot_callbacks"):
        assert wait_for_sweeps(timeout_s=60)
    assert not old.exists() and engine.scratch_root.is_dir()
    assert any("deleted 1 folder of other dirpaths" in r.getMessage() for r in caplog.records)


def test_a_sweep_reads_only_the_records_of_folders_used_within_the_keep_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep sizes (walks) only the folders whose record is older than the keep time."""
    base = tmp_path / "base"
    old = make_folder(base, "s3://bucket/old", age_s=8 * DAY_S)
    recents = [make_folder(base, f"s3://bucket/recent-{i}", age_s=DAY_S) for i in range(3)]
    walked: list[Path] = []
    walk = scratch_folders._walk
    monkeypatch.setattr(scratch_folders, "_walk", lambda folder: walked.append(folder) or walk(folder))
    deleted = scratch_folders.sweep_scratch(base, older_than_s=7 * DAY_S)
    assert [folder.path for folder in deleted] == [old] and walked == [old]
    assert all(folder.is_dir() for folder in recents)


def test_the_keep_time_is_a_knob(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = tmp_path / "base"
    old = make_folder(base, "s3://bucket/old", age_s=30 * DAY_S)
    monkeypatch.setenv("SPOT_SCRATCH_KEEP_S", "off")
    SpotEngine(
        SpotConfig(dirpath=str(tmp_path / "a"), interval=None, preemption=[], scratch_dir=str(base)), "demo"
    )
    assert wait_for_sweeps(timeout_s=60)
    assert old.is_dir()
    monkeypatch.setenv("SPOT_SCRATCH_KEEP_S", "1h")
    SpotEngine(
        SpotConfig(dirpath=str(tmp_path / "b"), interval=None, preemption=[], scratch_dir=str(base)), "demo"
    )
    assert wait_for_sweeps(timeout_s=60)
    assert not old.exists()


def test_a_marker_with_an_impossible_pid_or_time_is_unknown_not_an_exception(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 31: a pid of 10**30 (or a last-use time of 10**400) read back from disk once made
    ``os.kill``/``float`` raise OverflowError in a training start and in ``spot-callbacks scratch``."""
    url, base = CheckpointStore(str(tmp_path / "store")).url, tmp_path / "s"
    folder = default_scratch_root(url, str(base))
    folder.mkdir(parents=True)
    (folder / ".spot-scratch-live-1.json").write_text(
        json.dumps({"pid": 10**30, "host": os.uname().nodename, "started": None})
    )
    (folder / RECORD_NAME).write_text(json.dumps({"dirpath": url, "last_used": 10**400}))
    assert main(["scratch", "--root", str(base)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if url in line)
    assert line.rstrip().endswith("-")  # no live holder: the impossible pid names nobody
    engine = SpotEngine(SpotConfig(dirpath=url, interval=None, preemption=[], scratch_dir=str(base)), "demo")
    [listed] = list_scratch(base)
    assert listed.path == engine.scratch_root == folder
    assert listed.held_by == f"pid {os.getpid()}"
    assert not (folder / ".spot-scratch-live-1.json").exists()  # forgotten: it names no process


# ----------------------------------------------------------------- a start that never ran
def test_a_start_refused_by_the_store_leaves_the_scratch_base_as_it_was(tmp_path) -> None:
    from conftest import closed_port_url

    from spot_callbacks.errors import StoreUnavailableError

    base = tmp_path / "scratch"
    base.mkdir()
    (base / "notes.txt").write_text("the user's own file")
    before = sorted(path.name for path in base.iterdir())
    options = {"key": "k", "secret": "s", "endpoint_url": closed_port_url()}
    spot = SpotCheckpoint(
        dirpath="s3://bucket/refused-run", interval=None, preemption=[], scratch_dir=str(base),
        storage_options=options,
    )  # fmt: skip
    assert spot.engine.scratch_root.is_dir()  # made when the callback was
    trainer = pl.Trainer(max_steps=2, callbacks=[spot], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu")  # fmt: skip
    with pytest.raises(StoreUnavailableError):
        trainer.fit(BoringModel(), ckpt_path="latest")
    assert sorted(path.name for path in base.iterdir()) == before

    # HF's latest() asks the store before train(): refused there too, nothing stays.
    from spot_callbacks.hf import SpotCheckpointCallback

    callback = SpotCheckpointCallback(
        dirpath="s3://bucket/refused-run", interval=None, preemption=[], scratch_dir=str(base),
        storage_options=options,
    )  # fmt: skip
    with pytest.raises(Exception, match="endpoint"):
        callback.latest()
    assert sorted(path.name for path in base.iterdir()) == before


def test_a_failed_start_keeps_a_scratch_folder_an_earlier_run_left(tmp_path) -> None:
    from conftest import closed_port_url

    from spot_callbacks.errors import StoreUnavailableError

    options = {"key": "k", "secret": "s", "endpoint_url": closed_port_url()}
    earlier = default_scratch_root(SpotConfig(dirpath="s3://bucket/kept-run").dirpath, str(tmp_path))
    (earlier / "step-000000004").mkdir(parents=True)  # a copy a restart here may use
    config = SpotConfig(
        dirpath="s3://bucket/kept-run", interval=None, preemption=[], scratch_dir=str(tmp_path),
        storage_options=options,
    )  # fmt: skip
    engine = SpotEngine(config, "test")
    assert engine.scratch_root == earlier
    with pytest.raises(StoreUnavailableError):
        engine.start()
    engine.stop()
    assert (earlier / "step-000000004").is_dir()
