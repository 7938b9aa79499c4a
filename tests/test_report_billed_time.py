"""`spot-callbacks report` counts every billed second: each process from its start to its exit.

A run is killed outright (SIGKILL: no notice, nothing more written) in the middle of training, and
a second process resumes it on the same dirpath and finishes. From outside, the test measures what a
cloud bills (each process from spawn to exit) and the work the kill lost (the steps the second
process redid); the report, from the processes' attempt records alone, must agree.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from spot_callbacks.accounting.attempts import PROCESS_STARTED, AttemptRecord, attempt_outcomes, read_attempts
from spot_callbacks.cli import main
from spot_callbacks.config import SpotConfig
from spot_callbacks.engine import SpotEngine
from spot_callbacks.store import CheckpointStore
from spot_callbacks.store.preflight import PROBE_PREFIX
from tests.helpers.faultfs import FaultyFileSystem

SCRIPT = Path(__file__).parent / "scripts" / "paced_run.py"
STEPS, STEP_S, EVERY, KILL_AT = 45, 0.1, 20, 36
RECORD_S = 0.2
EXIT_S = 2.5  # an interpreter's exit after atexit, with torch loaded, on a busy 2-core machine


def _spawn(tmp_path: Path, url: str, machine: str) -> tuple[subprocess.Popen[str], float]:
    env = {
        **os.environ,
        "SPOT_SCRATCH": str(tmp_path / f"scratch-{machine}"),
        "SPOT_ATTEMPT_RECORD_S": str(RECORD_S),
    }
    spawned = time.time()
    child = subprocess.Popen(
        [sys.executable, str(SCRIPT), url, str(STEPS), str(STEP_S), str(EVERY)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip
    return child, spawned


def _steps(lines: list[str]) -> dict[int, float]:
    return {
        int(parts[1]): float(parts[2]) for parts in (line.split() for line in lines) if parts[:1] == ["step"]
    }


@pytest.mark.slow
def test_the_report_counts_billed_time_from_process_start_and_lost_work_from_the_step_records(
    tmp_path, capsys
) -> None:
    url = str(tmp_path / "run")
    first, first_spawned = _spawn(tmp_path, url, "a")
    assert first.stdout is not None
    first_lines = []
    for line in first.stdout:
        first_lines.append(line)
        if line.startswith(f"step {KILL_AT} "):
            first.send_signal(signal.SIGKILL)  # a hard loss: no handler runs, nothing more is written
            killed_at = time.time()
            break
    first.wait(timeout=60)
    first_billed = killed_at - first_spawned

    second, second_spawned = _spawn(tmp_path, url, "b")
    out, _ = second.communicate(timeout=240)
    second_exited = time.time()
    second_billed = second_exited - second_spawned
    assert second.returncode == 0 and "done" in out, out[-2000:]
    first_steps, second_steps = _steps(first_lines), _steps(out.splitlines())
    resumed_from = min(second_steps) - 1
    assert resumed_from < KILL_AT and max(second_steps) == STEPS
    # Measured from outside: the work redone is the first process's steps past the resume point, up to its kill.
    lost_measured = killed_at - first_steps[resumed_from]
    billed_measured = first_billed + second_billed
    trained = (max(first_steps) - min(first_steps) + 1 + max(second_steps) - min(second_steps) + 1) * STEP_S
    # What an uninterrupted run spends too: one start-up (spawn to its first step) and one end (its last step to exit).
    once = first_steps[min(first_steps)] - first_spawned + second_exited - second_steps[max(second_steps)]
    goodput_measured = (trained - lost_measured + once) / billed_measured

    assert main(["report", "--json", url]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["goodput_basis"] == "attempts"
    [killed, finished] = report["attempts"]
    assert killed["hard_loss"] and not finished["hard_loss"] and finished["resumed_from"] == resumed_from
    # Not seen by any record: the interpreter's own exit after its last write (1-2 s with torch loaded).
    assert abs(report["billed_s"] - billed_measured) <= 0.1 * billed_measured + 2 * EXIT_S, (
        report["billed_s"], billed_measured, first_billed, [a["billed_s"] for a in report["attempts"]],
    )  # fmt: skip
    assert abs(report["lost_work_s"] - lost_measured) <= 0.2 * lost_measured + RECORD_S, (
        report["lost_work_s"], lost_measured, json.dumps(report["attempts"][0]), max(first_steps),
    )  # fmt: skip
    assert abs(report["goodput"] - goodput_measured) <= 0.10, (report["goodput"], goodput_measured)
    # The imports and start-up before the first step are billed: the process start is the kernel's, not ours.
    assert finished["to_first_step_s"] >= second_steps[min(second_steps)] - second_spawned - 1.0
    assert "billed time" in report["summary"] and "2 processes" in report["summary"]["billed time"]


def test_a_record_no_run_writes_is_left_out_and_the_rest_are_counted(tmp_path, caplog) -> None:
    store = CheckpointStore(str(tmp_path / "run"))
    folder = tmp_path / "run" / ".spot-attempts"
    folder.mkdir(parents=True)
    good = {"version": 1, "run_id": "a" * 32, "host": "h", "started": 100.0, "alive_at": 160.0,
            "first_step": 1, "first_step_at": 110.0, "last_step": 50, "last_step_at": 159.0}  # fmt: skip
    (folder / "0000000100000-a.json").write_text(json.dumps(good))
    forged = [
        {**good, "started": -5.0},  # out of range
        {**good, "alive_at": 50.0},  # written before it started
        {**good, "last_step": 10**40},  # a step no run reaches
        {**good, "first_step_at": None},  # a step without its time
        {**good, "host": "x" * 10_000},  # a text too long
    ]
    for index, doc in enumerate(forged):
        (folder / f"00000001000{index:02d}-f.json").write_text(json.dumps(doc))
    (folder / "0000000100099-big.json").write_bytes(b"{" + b" " * 100_000 + b"}")
    (folder / "0000000100098-nan.json").write_text('{"version": 1, "started": NaN}')
    records = read_attempts(store)
    assert [record.run_id for record in records] == ["a" * 32]
    assert "ignoring 7 attempt record(s)" in caplog.text


def test_a_process_that_never_trained_is_billed_and_loses_nothing() -> None:
    waited = AttemptRecord(
        "w", "h", started=0.0, alive_at=30.0, lock_wait_s=25.0, end="preempted", ended_at=30.0
    )
    trained = AttemptRecord("t", "h", 40.0, 100.0, first_step=1, first_step_at=45.0, last_step=56,
                            last_step_at=100.0, end="finished", ended_at=100.0)  # fmt: skip
    summary = attempt_outcomes([waited, trained], resume_point=56, period_s=1.0)
    assert [outcome.billed_s for outcome in summary.outcomes] == [30.0, 60.0]
    assert summary.lost_s == 0.0 and summary.outcomes[0].downtime_s is None
    assert summary.goodput == pytest.approx(56.0 / 90.0)


def test_records_on_s3_are_written_and_read_back_from_one_listing(s3_server, tmp_path) -> None:
    from spot_callbacks.accounting.attempts import AttemptLog

    store = CheckpointStore(
        f"s3://{s3_server.bucket}/attempts-{tmp_path.name}", storage_options=dict(s3_server.storage_options)
    )
    record = AttemptLog(store, period_s=0.1)
    record.begin()
    record.step(1)
    record.checkpoint_taken(1)
    record.step(2)
    record.close("finished")
    [read] = read_attempts(CheckpointStore(store.url, storage_options=dict(s3_server.storage_options)))
    assert (read.run_id, read.first_step, read.last_step, read.end) == (record.run_id, 1, 2, "finished")
    assert [step for step, _ in read.checkpoints] == [1]


class _ReadBackHeld(FaultyFileSystem):
    """Holds the preflight's read-back of its probe until ``go`` is set (a process stopped mid-preflight)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.reading, self.go = threading.Event(), threading.Event()

    def cat_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
        if PROBE_PREFIX in path:
            self.reading.set()
            self.go.wait(60)
        return self.inner.cat_file(path, *args, **kwargs)


def _engine(tmp_path: Path, name: str) -> SpotEngine:
    config = SpotConfig(dirpath=str(tmp_path / "run"), interval=None, preemption=[],
                        scratch_dir=str(tmp_path / f"scratch-{name}"))  # fmt: skip
    return SpotEngine(config, "test")


def test_a_process_stopped_inside_its_preflight_is_billed_from_its_start(tmp_path) -> None:
    engine = _engine(tmp_path, "a")
    engine.store.fs = held = _ReadBackHeld(engine.store.fs)
    starting = threading.Thread(target=engine.start, daemon=True)
    starting.start()
    try:
        assert held.reading.wait(60), "the preflight never read its probe back"
        # What a SIGKILL here leaves: the record is in the store already, from the process's own start.
        [record] = read_attempts(CheckpointStore(str(tmp_path / "run")))
        assert record.started == pytest.approx(PROCESS_STARTED, abs=0.001)
        assert record.first_step is None and record.end is None and record.alive_at >= record.started
        summary = attempt_outcomes([record], resume_point=None, period_s=1.0)
        assert summary.outcomes[0].billed_s >= record.alive_at - record.started > 0
    finally:
        held.go.set()
        starting.join(60)
    assert engine.lease.lock is not None, "the held preflight went on to take the lock"
    engine.finish()
    # One record per process: the thread rewrote the one written inside the preflight.
    # (A run a live lock refuses leaves none: tests/test_runlock.py, "writes nothing into its dirpath".)
    [record] = read_attempts(CheckpointStore(str(tmp_path / "run")))
    assert (record.run_id, record.end) == (engine.attempt.run_id, "finished")
