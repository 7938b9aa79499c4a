"""Signals and hung stores at the end of a run, in real processes: every wait bounded, every commit kept."""

from __future__ import annotations

import gc
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

from spot_callbacks import CheckpointStore
from spot_callbacks.preemption import exit_guard
from spot_callbacks.store.runlock import LOCK_NAME

SCRIPT = Path(__file__).parent / "scripts" / "exit_signals_run.py"


def ctrl_c_as_in_a_terminal() -> None:
    # A test run started in the background (`cmd &`, nohup, some CI runners) ignores SIGINT, and
    # children inherit that; a person's terminal delivers it. The run under test is the latter.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(tmp_path: Path, *extra: str, grace_s: float = 30.0) -> subprocess.Popen:
    env = {**os.environ, "SPOT_SIGNAL_GRACE_S": str(grace_s), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--dirpath", str(tmp_path / "run"), "--scratch", str(tmp_path / "scratch"),
         *extra],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        preexec_fn=ctrl_c_as_in_a_terminal,
    )  # fmt: skip


def read_until(process: subprocess.Popen, marker: str) -> list[str]:
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith(marker):
            return lines
    raise AssertionError(f"the run ended before {marker!r}:\n{''.join(lines)}")


def release(process: subprocess.Popen) -> None:
    try:
        process.stdin.write("go\n")
        process.stdin.flush()
    except BrokenPipeError:
        pass  # the process is gone already


def test_sigterm_while_the_end_checkpoint_uploads_commits_it_and_exits_143(tmp_path) -> None:
    process = start(tmp_path)
    read_until(process, "UPLOADING 6")
    process.send_signal(signal.SIGTERM)  # the notice lands while the last upload is in flight
    said = read_until(process, "spot_callbacks: SIGTERM notice while the last checkpoint uploads")
    release(process)
    output, _ = process.communicate(timeout=120)
    output = "".join(said) + output
    assert process.returncode == 143, output
    store = CheckpointStore(str(tmp_path / "run"))
    assert store.latest().step == 6 and store.latest().reason == "end" and store.verify(6)
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # the lock was released
    assert "SIGTERM notice while the last checkpoint uploads: step 6 goes first" in output
    assert "stopping as preempted (SIGTERM at the end of training): exit 143" in output
    assert "FIT RETURNED" not in output
    assert frozen_at_exit(output) > 0  # the stopped run's exit skipped the final collections


def frozen_at_exit(output: str) -> int:
    [line] = [line for line in output.splitlines() if line.startswith("GC FROZEN AT EXIT ")]
    return int(line.split()[-1])


def test_a_hung_store_at_the_end_never_holds_the_exit_past_the_deadline(tmp_path) -> None:
    grace_s = 8.0
    process = start(tmp_path, "--hang", grace_s=grace_s)
    read_until(process, "UPLOADING 6")
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    ended_s = time.monotonic() - sent
    assert process.returncode == 143, output
    assert ended_s < grace_s, output  # before the SIGKILL the grace announces
    store = CheckpointStore(str(tmp_path / "run"))
    assert store.latest() is None  # nothing half-committed
    misses = [line for line in output.splitlines() if "did not commit before the deadline" in line]
    assert len(misses) == 1, output  # said once
    assert "waiting at most" in output


def test_a_writer_held_inside_the_state_write_at_a_missed_deadline_exits_143_not_abort(tmp_path) -> None:
    process = start(
        tmp_path, "--hold-write", "--hang", "--every-n-steps", "3", "--max-steps", "6", grace_s=4.0
    )
    read_until(process, "WRITING 6")
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 143, output
    assert CheckpointStore(str(tmp_path / "run")).latest().step == 3
    assert "spot-writer did not finish in time; exiting with 143 now" in output
    assert output.count("did not commit before the deadline") == 1, output  # the miss is said once


def test_a_grace_at_or_below_the_exit_margin_is_warned_at_start(tmp_path) -> None:
    process = start(tmp_path, grace_s=1.0)
    said = read_until(process, "UPLOADING 6")
    release(process)
    output, _ = process.communicate(timeout=120)
    output = "".join(said) + output
    assert process.returncode == 0, output
    assert "SPOT_SIGNAL_GRACE_S=1 leaves no time for an emergency checkpoint after SIGTERM" in output


def test_a_first_ctrl_c_checkpoints_the_last_completed_step_commits_and_stops(tmp_path) -> None:
    process = start(tmp_path, "--preemption", "auto", "--max-steps", "100000", "--ready-at", "20")
    said = read_until(process, "READY 20")
    process.send_signal(signal.SIGINT)  # a person's Ctrl-C, mid-training
    output, _ = process.communicate(timeout=120)
    output = "".join(said) + output
    assert process.returncode == 143, output  # stopped to be resumed, by the adapter's exit code
    latest = CheckpointStore(str(tmp_path / "run")).latest()
    assert latest.reason == "preemption" and 20 <= latest.step < 100000
    assert "Ctrl-C: checkpointing the last completed step, then stopping once it is committed" in output
    assert "press Ctrl-C again to stop at once" in output
    assert f"stopping after Ctrl-C: step {latest.step} is committed; run the same command again" in output
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    assert "KeyboardInterrupt" not in output
    assert frozen_at_exit(output) > 0


def test_a_second_ctrl_c_stops_at_once_without_waiting_for_a_hung_upload(tmp_path) -> None:
    process = start(tmp_path, "--preemption", "auto", "--hang")
    said = read_until(process, "UPLOADING 6")
    process.send_signal(signal.SIGINT)
    said += read_until(process, "spot_callbacks: SIGINT notice while the last checkpoint uploads")
    assert "waiting until it commits (the notice has no deadline)" in said[-1]
    process.send_signal(signal.SIGINT)  # the upload hangs: a person stops it
    output, _ = process.communicate(timeout=60)  # well inside the store's upload timeouts
    output = "".join(said) + output
    assert process.returncode == 130, output
    assert "second Ctrl-C: stopping at once, not waiting for uploads" in output
    assert CheckpointStore(str(tmp_path / "run")).latest() is None


class _FinishingWorker:
    """A persister whose one worker finishes the bookkeeping after its commit once ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.thread = threading.Thread(target=self.release.wait, name="spot-emergency", daemon=True)
        self.thread.start()

    @property
    def idle(self) -> bool:
        return not self.thread.is_alive()

    def worker_threads(self) -> list[threading.Thread]:
        return [self.thread]


def test_the_exit_waits_quietly_for_a_worker_that_finishes_soon_and_warns_for_one_that_does_not(
    caplog, monkeypatch
) -> None:
    # This process's own persisters and armed exit (of earlier tests in it) are not this test's to park.
    monkeypatch.setattr(exit_guard, "_open", weakref.WeakSet())
    monkeypatch.setattr(exit_guard, "_armed", {})
    caplog.set_level(logging.INFO, logger="spot_callbacks")
    soon = _FinishingWorker()
    exit_guard.guard(soon)
    threading.Timer(0.1, soon.release.set).start()  # a worker 0.1 s from done: the exit waits, says nothing
    exit_guard.park_workers_at_exit()
    assert soon.idle and not [r for r in caplog.records if "still works" in r.getMessage()]

    late = _FinishingWorker()
    exit_guard.guard(late)
    threading.Timer(exit_guard.QUIET_WAIT_S + 0.5, late.release.set).start()  # past the quiet wait
    exit_guard.park_workers_at_exit()  # nothing armed: waits up to UNARMED_EXIT_WAIT_S, then returns
    assert late.idle
    [line] = [r.getMessage() for r in caplog.records if "still works" in r.getMessage()]
    assert line.startswith("spot_callbacks: exiting while spot-emergency still works; waiting at most")


def test_only_an_armed_exit_leaves_the_objects_uncollected(monkeypatch) -> None:
    monkeypatch.setattr(exit_guard, "_open", weakref.WeakSet())
    monkeypatch.setattr(exit_guard, "_armed", {})
    assert gc.get_freeze_count() == 0
    try:
        exit_guard.park_workers_at_exit()  # a plain end of the script: collected as usual
        assert gc.get_freeze_count() == 0
        exit_guard.arm(time.time() + 30, 143)
        exit_guard.park_workers_at_exit()  # a stopped run: its objects are left to the process's end
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
