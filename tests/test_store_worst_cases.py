"""Worst cases, each with its bounded behaviour (from issue 21 item 11).

Control characters from a store never reach a terminal; stray entries in a local store are
skipped or refused; ``latest()`` on thousands of step folders reads a bounded number of
manifests; run locks judged by this host's own clock; the ledger counts a dead previous run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import torch

from spot_callbacks import CheckpointStore, RunLockedError, SpotConfig
from spot_callbacks.cli import main as cli_main
from spot_callbacks.engine import SpotEngine
from spot_callbacks.errors import CorruptCheckpointError, ForeignCheckpointError, ManifestError
from spot_callbacks.store.checkpoint_store import manifest_verdicts
from spot_callbacks.store.layout import MANIFEST_NAME, step_dirname
from spot_callbacks.store.runlock import LOCK_NAME, RunLock
from spot_callbacks.store.writer import CommitWriter
from tests.helpers.faultfs import FaultyFileSystem

EVIL = "\x1b[2J\x1b]0;pwned\x07"
RAW_CONTROLS = ("\x1b", "\x07", "\x9b")


def _payload(tmp_path: Path, size: int = 10) -> Path:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "state.ckpt").write_bytes(b"x" * size)
    return src


def _commit(store: CheckpointStore, step: int, src: Path, **extra: Any) -> None:
    CommitWriter(store).write_checkpoint(
        step, src, reason="interval", framework="lightning", extra=extra or None
    )


def _tamper(root: Path, step: int, **fields: Any) -> None:
    """What a writer of the bucket does: rewrite a committed manifest's free-form strings."""
    path = root / step_dirname(step) / MANIFEST_NAME
    doc = json.loads(path.read_text())
    doc.update(fields)
    path.write_text(json.dumps(doc))


# ------------------------------------------------------------------ control characters


def test_ls_and_report_never_print_a_manifests_control_characters(tmp_path: Path, capsys) -> None:
    root = tmp_path / "store"
    store = CheckpointStore(str(root))
    _commit(store, 5, _payload(tmp_path), note=EVIL)
    _commit(store, 6, _payload(tmp_path))
    _tamper(root, 5, reason="interval" + EVIL, framework="lightning" + EVIL)
    _tamper(root, 6, reason="end" + EVIL + "\x9b31m", framework="lightning" + EVIL)
    for command in ("ls", "report"):
        assert cli_main([command, str(root)]) == 0
        out, err = capsys.readouterr()
        assert not [c for c in RAW_CONTROLS if c in out + err], (command, out + err)
        assert "\\x1b[2J" in out  # shown, escaped: the operator sees what the manifest says


def test_log_lines_quoting_the_store_are_escaped(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="spot_callbacks"):
        logging.getLogger("spot_callbacks").warning("resumed from %s\nnext line", "step" + EVIL)
    assert not [c for c in RAW_CONTROLS if c in caplog.text]
    assert "step\\x1b[2J" in caplog.text and "\nnext line" in caplog.text  # our own newlines stay


# ------------------------------------------------------------------ stray entries


def _store_with_strays(tmp_path: Path) -> tuple[Path, CheckpointStore]:
    root = tmp_path / "store"
    store = CheckpointStore(str(root))
    src = _payload(tmp_path)
    for step in (1, 2, 3):
        _commit(store, step, src)
    (root / step_dirname(7)).write_bytes(b"not a folder")  # a file named like a step folder
    os.mkfifo(root / step_dirname(8))  # a fifo named like one
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(root / step_dirname(9)))
    sock.close()
    (root / step_dirname(10)).mkdir()
    (root / step_dirname(10) / MANIFEST_NAME).mkdir()  # a folder named manifest.json
    (root / step_dirname(11)).mkdir()
    os.mkfifo(root / step_dirname(11) / MANIFEST_NAME)  # a fifo named manifest.json: a read blocks
    return root, store


def _in_thread(call, timeout_s: float = 60.0) -> Any:
    """Run ``call``; a reader that blocks on a fifo fails the test instead of hanging the suite."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = call()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            result["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), "the reader blocked (on a fifo?)"
    if "error" in result:
        raise result["error"]
    return result.get("value")


def test_stray_entries_in_a_local_store_are_skipped_by_every_reader(tmp_path: Path, capsys, caplog) -> None:
    root, store = _store_with_strays(tmp_path)
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        assert _in_thread(store.latest).step == 3
        assert [info.step for info in _in_thread(store.committed)] == [1, 2, 3]
    assert "it is a file, not a folder" in caplog.text and "named pipe" in caplog.text
    assert "socket" in caplog.text and "it is a folder, not a file" in caplog.text
    assert _in_thread(lambda: cli_main(["ls", str(root)])) == 0
    out = capsys.readouterr().out
    assert "step 3" in out and "named pipe" in out  # step 11's fifo manifest listed as damaged
    assert _in_thread(lambda: cli_main(["verify", str(root), "--step", "3"])) == 0
    assert _in_thread(lambda: cli_main(["verify", str(root), "--step", "11"])) == 1


@pytest.mark.parametrize("step", [7, 8, 10, 11])
def test_rm_refuses_a_stray_entry_in_one_line(step: int, tmp_path: Path, capsys) -> None:
    root, store = _store_with_strays(tmp_path)
    before = sorted(os.listdir(root))
    assert _in_thread(lambda: cli_main(["rm", str(root), "--step", str(step), "--yes"])) == 1
    err = capsys.readouterr().err
    assert "remove it by hand" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert sorted(os.listdir(root)) == before
    with pytest.raises(ForeignCheckpointError):
        store.delete(step)


def test_a_fifo_listed_as_payload_is_damage_not_a_blocked_read(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = CheckpointStore(str(root))
    src = _payload(tmp_path)
    _commit(store, 1, src)
    (src / "empty.bin").write_bytes(b"")
    _commit(store, 2, src)
    os.remove(root / step_dirname(2) / "empty.bin")
    os.mkfifo(root / step_dirname(2) / "empty.bin")  # size 0, as the manifest says
    assert _in_thread(store.latest).step == 1
    assert _in_thread(lambda: cli_main(["verify", str(root), "--step", "2"])) == 1


class RefusingFileSystem(FaultyFileSystem):
    """A real filesystem that refuses to read one folder (what a bucket policy or a mode-000
    folder does; the tests run as root, for whom a chmod refuses nothing)."""

    def __init__(self, inner: Any, refused: str) -> None:
        super().__init__(inner)
        self.refused = refused

    def cat(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        paths = [path] if isinstance(path, str) else list(path)
        if any(self.refused in p for p in paths):
            raise PermissionError(13, "Permission denied", self.refused)
        return self.inner.cat(path, *args, **kwargs)

    def cat_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
        if self.refused in path:
            raise PermissionError(13, "Permission denied", path)
        return self.inner.cat_file(path, *args, **kwargs)


def test_an_unreadable_step_folder_is_damage_and_the_others_are_read(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = CheckpointStore(str(root))
    src = _payload(tmp_path)
    for step in (1, 2, 3):
        _commit(store, step, src)
    store.fs = RefusingFileSystem(store.fs, step_dirname(3))
    assert store.latest().step == 2
    verdicts = {verdict.step: verdict.problem for verdict in manifest_verdicts(store)}
    assert verdicts[1] is None and verdicts[2] is None and "Permission denied" in verdicts[3]


# ------------------------------------------------------------------ thousands of step folders


class CountingFileSystem(FaultyFileSystem):
    """A real filesystem that counts the manifests read through it."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.manifests_read = 0

    def cat(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        paths = [path] if isinstance(path, str) else list(path)
        self.manifests_read += sum(p.endswith(MANIFEST_NAME) for p in paths)
        return self.inner.cat(path, *args, **kwargs)

    def cat_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self.manifests_read += path.endswith(MANIFEST_NAME)
        return self.inner.cat_file(path, *args, **kwargs)


def _many_steps(tmp_path: Path, count: int) -> tuple[Path, CheckpointStore]:
    root = tmp_path / "store"
    store = CheckpointStore(str(root))
    _commit(store, 0, _payload(tmp_path), lineage={"id": "a" * 32, "resumed_from": None})
    first = root / step_dirname(0)
    doc = json.loads((first / MANIFEST_NAME).read_text())
    for step in range(1, count):  # copies of one committed checkpoint, renumbered
        folder = root / step_dirname(step)
        shutil.copytree(first, folder)
        (folder / MANIFEST_NAME).write_text(json.dumps({**doc, "step": step}))
    return root, store


def test_latest_on_2000_step_folders_reads_a_bounded_number_of_manifests(tmp_path: Path) -> None:
    from spot_callbacks.store.checkpoint_store import LATEST_BATCH

    root, store = _many_steps(tmp_path, 2000)
    counting = CountingFileSystem(store.fs)
    store.fs = counting
    assert store.latest().step == 1999
    assert counting.manifests_read <= LATEST_BATCH
    # The newest 100 damaged: the walk goes on a batch at a time, still not reading everything.
    for step in range(1900, 2000):
        os.remove(root / step_dirname(step) / "state.ckpt")
    counting.manifests_read = 0
    assert store.latest().step == 1899
    assert counting.manifests_read <= 2 * LATEST_BATCH


def test_a_resume_past_damage_on_2000_step_folders_reads_a_bounded_number_of_manifests(
    tmp_path: Path,
) -> None:
    from spot_callbacks.resume import pull_newest_valid
    from spot_callbacks.store.checkpoint_store import LATEST_BATCH

    root, store = _many_steps(tmp_path, 2000)
    for step in range(1950, 2000):  # the newest 50 damaged: the resume falls back past them
        os.remove(root / step_dirname(step) / "state.ckpt")
    counting = CountingFileSystem(store.fs)
    store.fs = counting
    pulled = tmp_path / "pulled"
    found = pull_newest_valid(store, lambda step: pulled / step_dirname(step))
    assert found is not None and found.step == 1949
    assert (pulled / step_dirname(1949) / "state.ckpt").is_file()
    # Two pulls' second reads aside, the manifests of one batch: not all 2,000 (before: every one).
    assert counting.manifests_read <= LATEST_BATCH + 2


# ------------------------------------------------------------------ run-lock clocks


class TimelessFileSystem(FaultyFileSystem):
    """A real filesystem whose ``info`` tells no modification time (as some backends do): the
    lock is then judged by its heartbeat value and this host's own clock alone."""

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        found = dict(self.inner.info(path, **kwargs))
        for key in ("LastModified", "last_modified", "mtime", "updated", "created"):
            found.pop(key, None)
        return found


def _lock_store(tmp_path: Path, timeless: bool) -> CheckpointStore:
    store = CheckpointStore(str(tmp_path / "run"))
    store.fs.makedirs(store.root, exist_ok=True)
    if timeless:
        store.fs = TimelessFileSystem(store.fs)
    return store


@pytest.mark.parametrize("timeless", [False, True], ids=["store-mtime", "no-mtime"])
def test_a_dead_owners_lock_with_a_heartbeat_in_the_future_does_not_block_forever(
    timeless: bool, tmp_path: Path
) -> None:
    store = _lock_store(tmp_path, timeless)
    doc = {
        "host": "other-host",
        "pid": 4242,
        "run_id": "f" * 32,
        "started": "2026-01-01T00:00:00+00:00",
        "heartbeat": time.time() + 3600,
    }  # fmt: skip - a host whose clock runs an hour ahead, then died
    (Path(store.root) / LOCK_NAME).write_text(json.dumps(doc))
    lock = RunLock(store, stale_s=0.4)
    _in_thread(lock.acquire, timeout_s=30)
    assert lock.holder()["run_id"] == lock.run_id
    lock.release()


@pytest.mark.parametrize("timeless", [False, True], ids=["store-mtime", "no-mtime"])
def test_a_live_owner_whose_clock_is_an_hour_behind_is_not_evicted(timeless: bool, tmp_path: Path) -> None:
    store = _lock_store(tmp_path, timeless)
    owner = RunLock(store, stale_s=0.4)
    owner._owner["host"] = "other-host"  # another machine...
    behind = lambda: json.dumps({**owner._owner, "heartbeat": time.time() - 3600}).encode()  # noqa: E731
    owner._encoded = behind  # ...whose clock runs an hour behind ours (ours runs ahead of it)
    owner.acquire()
    try:
        with pytest.raises(RunLockedError, match="in use by another run"):
            _in_thread(RunLock(store, stale_s=0.4).acquire, timeout_s=30)
        assert not owner.lost and owner.holder()["run_id"] == owner.run_id
    finally:
        owner.release()


def test_a_lock_the_store_says_is_hours_old_is_taken_over_at_once(tmp_path: Path, caplog) -> None:
    store = _lock_store(tmp_path, timeless=False)
    path = Path(store.root) / LOCK_NAME
    path.write_text(
        json.dumps({"host": "other-host", "pid": 4242, "run_id": "f" * 32, "heartbeat": time.time()})
    )
    os.utime(path, (time.time() - 7200, time.time() - 7200))  # a machine that vanished two hours ago
    lock = RunLock(store, stale_s=60)  # a watch would take 45 s at least
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        _in_thread(lock.acquire, timeout_s=30)
    assert "by the store's clock" in caplog.text and "waiting up to" not in caplog.text
    lock.release()


# ------------------------------------------------------------------ the ledger sees a dead run


def _engine(url: str) -> SpotEngine:
    return SpotEngine(SpotConfig(dirpath=url, interval=None, preemption=[]), "test")


def _resume(engine: SpotEngine) -> None:
    """What an adapter does at the start of a resumed fit: the lock, the pull, the engine's state."""
    engine.start()
    assert engine.pull_latest() is not None
    engine.load_state_dict(engine.resumed.info.extra.get("engine", {}))


def test_a_run_killed_before_its_first_commit_is_an_interruption_in_report_and_auto(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("SPOT_LOCK_STALE_S", "0.4")
    root = tmp_path / "store"
    url = str(root)
    # Run 1: SIGTERM, its emergency checkpoint commits (100 s ago, by a fake clock: the manifest's time).
    first = _engine(url)
    first.start()
    first.save_state(step=5, epoch=0, state={"w": torch.ones(2)}, reason="preemption")
    first.finish()
    t0 = time.time() - 100
    _tamper(root, 5, created=datetime.fromtimestamp(t0, timezone.utc).isoformat())
    # Run 2: resumes (10 s after that commit), trains 40 s and is killed -9 before committing anything.
    second = _engine(url)
    _resume(second)
    second.lease.lock._stop.set()  # kill -9: nothing more is written, nothing is released
    second.lease.lock._thread.join()
    lock_path = root / LOCK_NAME
    doc = json.loads(lock_path.read_text())
    started = datetime.fromtimestamp(t0 + 10, timezone.utc).isoformat()
    lock_path.write_text(
        json.dumps({**doc, "host": "vanished-host", "started": started, "heartbeat": t0 + 50})
    )
    # Run 3: sees run 2's stale lock, resumes step 5 again, commits.
    third = _engine(url)
    _resume(third)
    assert third.accounts.interruption_history()[0] == 2  # what interval="auto" is fed
    third.save_state(step=6, epoch=0, state={"w": torch.ones(2)}, reason="interval")
    third.finish()
    assert cli_main(["report", url]) == 0
    rows = dict(
        line.strip().split("  ", 1)
        for line in capsys.readouterr().out.splitlines()[1:]
        if "  " in line.strip()
    )
    assert rows["interruptions"].strip().startswith("2 (2 resumed"), rows
    assert "in 3 runs" in rows["training time"], rows
    # The ledger keeps its estimate of run 2's loss (its lock's start to its last heartbeat); the report's
    # lost-work row comes from the processes' own step records (accounting/attempts.py) where they exist.
    assert cli_main(["report", "--json", url]) == 0
    ledger = json.loads(capsys.readouterr().out)["ledger"]
    assert ledger["lost_work_estimated_s"] == 40.0, ledger


# ------------------------------------------------------------------ payload names a disk cannot hold


def _rename_payload(root: Path, step: int, renames: dict[str, str]) -> None:
    """What a writer of the bucket does: list payload names of its own (sizes and checksums kept)."""
    path = root / step_dirname(step) / MANIFEST_NAME
    doc = json.loads(path.read_text())
    files = doc["files"]
    for old, new in renames.items():
        files[new] = files[old] if old in files else dict(next(iter(files.values())))
    doc["files"] = files
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("renames", "said"),
    [
        ({"state.ckpt": "state.ckpt/inner.bin"}, "both as a file and as the folder of"),  # together
        ({"state.ckpt": "STATE.CKPT"}, "one file on a case-insensitive disk"),  # together, on some disks
        ({"x": "p" * 300}, "over 255 bytes"),  # at all: one part past NAME_MAX
        ({"x": "bad\x00name"}, "a control character"),  # at all
    ],
    ids=["file-and-folder", "case-only", "part-too-long", "nul"],
)
def test_payload_names_a_disk_cannot_hold_are_damage_and_latest_falls_back(
    tmp_path: Path, caplog, renames: dict[str, str], said: str
) -> None:
    root = tmp_path / "store"
    store = CheckpointStore(str(root))
    _commit(store, 4, _payload(tmp_path))
    _commit(store, 5, _payload(tmp_path))
    _rename_payload(root, 5, renames)
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        assert store.latest().step == 4
    lines = [r.getMessage() for r in caplog.records if step_dirname(5) in r.getMessage()]
    assert any(said in line for line in lines), lines
    assert (root / step_dirname(5)).is_dir()  # damaged, never deleted


# ------------------------------------------------------------------ the manifest read again by a pull


def _after_the_first_read(store: CheckpointStore, monkeypatch, change) -> None:  # noqa: ANN001
    """Another writer changes the store between the pull's first manifest read and its second."""
    real_read = store.read_manifest

    def read_then_change(step: int) -> Any:
        info = real_read(step)
        change()
        return info

    monkeypatch.setattr(store, "read_manifest", read_then_change)


def test_a_manifest_replaced_during_a_pull_is_never_written_into_the_pulled_folder(
    tmp_path: Path, monkeypatch
) -> None:
    root = tmp_path / "store"
    store = CheckpointStore(str(root))
    _commit(store, 5, _payload(tmp_path))
    manifest = root / step_dirname(5) / MANIFEST_NAME
    doc = json.loads(manifest.read_text())
    doc["created"] = "2030-01-01T00:00:00+00:00"  # the same files, another commit
    _after_the_first_read(store, monkeypatch, lambda: manifest.write_text(json.dumps(doc)))
    with pytest.raises(CorruptCheckpointError, match="changed during the pull"):
        store.pull(5, tmp_path / "pulled")
    assert not (tmp_path / "pulled").exists()


def test_the_pulls_second_manifest_read_is_bounded(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "store"
    store = CheckpointStore(str(root))
    _commit(store, 5, _payload(tmp_path))
    manifest = root / step_dirname(5) / MANIFEST_NAME
    real_open, read_sizes = store.fs.open, []

    def counting_open(path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        handle = real_open(path, mode, *args, **kwargs)
        if str(path).endswith(MANIFEST_NAME):
            real_read = handle.read
            handle.read = lambda n=-1: read_sizes.append(n) or real_read(n)
        return handle

    def grow() -> None:  # a 4 MB answer to the second read
        manifest.write_bytes(manifest.read_bytes() + b" " * (4 * 1024 * 1024))
        monkeypatch.setattr(store.fs, "open", counting_open)

    monkeypatch.setenv("SPOT_MANIFEST_MAX_BYTES", "65536")
    _after_the_first_read(store, monkeypatch, grow)
    with pytest.raises(ManifestError, match="SPOT_MANIFEST_MAX_BYTES"):
        store.pull(5, tmp_path / "pulled")
    assert read_sizes == [65537]  # at most the limit and one byte, never the 4 MB answer
    assert not (tmp_path / "pulled").exists()
