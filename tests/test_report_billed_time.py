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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from spot_callbacks.accounting.attempts import (
    PROCESS_STARTED,
    AttemptRecord,
    attempt_outcomes,
    attempts_of_lineage,
    read_attempts,
)
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


def _kill_at(child: subprocess.Popen[str], step: int) -> tuple[list[str], float]:
    """SIGKILL ``child`` at its step boundary ``step``: its output lines so far, and when it was killed."""
    assert child.stdout is not None
    lines = []
    for line in child.stdout:
        lines.append(line)
        if line.startswith(f"step {step} "):
            child.send_signal(signal.SIGKILL)  # a hard loss: no handler runs, nothing more is written
            killed_at = time.time()
            break
    child.wait(timeout=60)
    return lines, killed_at


@dataclass(frozen=True)
class _Measured:
    """What a cloud bills, measured from outside: a process killed at a step boundary, then one to the end."""

    first_spawned: float
    killed_at: float
    first_steps: dict[int, float]  # step -> when its boundary was printed
    second_spawned: float
    second_exited: float
    second_steps: dict[int, float]
    exit_s: float  # from ``fit`` returning to the second process's exit: the interpreter's own exit

    @property
    def billed_s(self) -> float:
        return self.killed_at - self.first_spawned + self.second_exited - self.second_spawned

    @property
    def once_s(self) -> float:
        """What an uninterrupted run spends too: one start-up (spawn to its first step) and one end (its last step to exit)."""
        first, second = self.first_steps, self.second_steps
        return first[min(first)] - self.first_spawned + self.second_exited - second[max(second)]


def _run_to_exit(child: subprocess.Popen[str]) -> tuple[list[str], float, float]:
    """``child``'s output lines, when it printed ``done`` (``fit`` returned) and when it exited."""
    assert child.stdout is not None
    stopper = threading.Timer(240, child.kill)  # a hung child fails the test, never hangs it
    stopper.start()
    try:
        lines, done_at = [], None
        for line in child.stdout:
            lines.append(line)
            if line.startswith("done"):
                done_at = time.time()
        child.wait()
        exited = time.time()
    finally:
        stopper.cancel()
    assert child.returncode == 0 and done_at is not None, "".join(lines)[-2000:]
    return lines, done_at, exited


def _kill_then_finish(tmp_path: Path, url: str, kill_at: int) -> _Measured:
    first, first_spawned = _spawn(tmp_path, url, "a")
    first_lines, killed_at = _kill_at(first, kill_at)
    second, second_spawned = _spawn(tmp_path, url, "b")
    lines, done_at, second_exited = _run_to_exit(second)
    second_steps = _steps(lines)
    assert max(second_steps) == STEPS
    return _Measured(
        first_spawned, killed_at, _steps(first_lines), second_spawned, second_exited, second_steps,
        second_exited - done_at,
    )  # fmt: skip


def _report(
    url: str, capsys: pytest.CaptureFixture[str], measured: _Measured, lost_s: float
) -> dict[str, Any]:
    """``report --json``, checked against what was measured: billed time, lost work, goodput."""
    assert main(["report", "--json", url]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["goodput_basis"] == "attempts"
    assert len(report["attempts"]) == 2, f"not every process is billed: {report['attempts']}"
    # Not seen by any record: the interpreter's own exit after its last write (1-2 s with torch loaded
    # on a quiet 2-core machine, over 10 s under a load of 10), measured from outside.
    billed_s = measured.billed_s
    assert abs(report["billed_s"] - billed_s) <= 0.1 * billed_s + measured.exit_s + EXIT_S, (
        report["billed_s"], billed_s, [a["billed_s"] for a in report["attempts"]], measured.exit_s,
    )  # fmt: skip
    assert abs(report["lost_work_s"] - lost_s) <= 0.2 * lost_s + RECORD_S, (
        report["lost_work_s"], lost_s, json.dumps(report["attempts"][0]), max(measured.first_steps),
    )  # fmt: skip
    first, second = measured.first_steps, measured.second_steps
    trained = (max(first) - min(first) + 1 + max(second) - min(second) + 1) * STEP_S
    goodput = (trained - lost_s + measured.once_s) / billed_s
    assert abs(report["goodput"] - goodput) <= 0.10, (report["goodput"], goodput)
    return report


@pytest.mark.slow
def test_the_report_counts_billed_time_from_process_start_and_lost_work_from_the_step_records(
    tmp_path, capsys
) -> None:
    url = str(tmp_path / "run")
    measured = _kill_then_finish(tmp_path, url, KILL_AT)
    resumed_from = min(measured.second_steps) - 1
    assert resumed_from < KILL_AT
    # Measured from outside: the work redone is the first process's steps past the resume point, up to its kill.
    report = _report(url, capsys, measured, lost_s=measured.killed_at - measured.first_steps[resumed_from])
    [killed, finished] = report["attempts"]
    assert killed["hard_loss"] and not finished["hard_loss"] and finished["resumed_from"] == resumed_from
    # The imports and start-up before the first step are billed: the process start is the kernel's, not ours.
    second_steps = measured.second_steps
    assert finished["to_first_step_s"] >= second_steps[min(second_steps)] - measured.second_spawned - 1.0
    assert "billed time" in report["summary"] and "2 processes" in report["summary"]["billed time"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_process_killed_before_its_first_commit_is_billed_to_the_run_that_started_over(
    tmp_path, capsys, request, backend
) -> None:
    # Killed before its first checkpoint committed: it wrote records under a lineage no manifest
    # names, and the next process, with nothing to resume, starts fresh under another lineage.
    url = str(tmp_path / "run")
    if backend == "s3":  # the children and the report find moto through the environment
        url = f"s3://{request.getfixturevalue('s3_env').bucket}/billed-{tmp_path.name}"
    measured = _kill_then_finish(tmp_path, url, EVERY - 4)
    assert min(measured.second_steps) == 1  # it started over
    # All the first process trained is lost: from the start of its first step to its kill.
    first_step_began = measured.first_steps[min(measured.first_steps)] - STEP_S
    report = _report(url, capsys, measured, lost_s=measured.killed_at - first_step_began)
    [killed, finished] = report["attempts"]
    assert killed["hard_loss"] and killed["resumed_from"] is None and finished["resumed_from"] is None
    killed_billed = measured.killed_at - measured.first_spawned
    assert abs(killed["billed_s"] - killed_billed) <= 0.1 * measured.billed_s + RECORD_S
    # Every step it recorded is lost (its record lags its kill by up to a period: the lost time says the rest).
    assert killed["lost_steps"] == killed["last_step"] - killed["first_step"] + 1 > 0


def test_another_jobs_records_stay_out_and_one_killed_before_its_first_commit_is_billed() -> None:
    other = AttemptRecord("o", "h", 0.0, 50.0, lineage="J1", end="finished", ended_at=50.0)  # committed
    during = AttemptRecord("d", "h", 40.0, 45.0, lineage="X")  # started while J1 ran: not J2's
    killed = AttemptRecord("k", "h", 60.0, 70.0, lineage="K")  # no manifest of K: killed before its commit
    fresh = AttemptRecord("f", "h", 72.0, 90.0, lineage="J2", end="finished", ended_at=90.0)
    records = [other, during, killed, fresh]
    assert [r.run_id for r in attempts_of_lineage(records, {"J2"}, {"J1", "J2"})] == ["k", "f"]
    assert [r.run_id for r in attempts_of_lineage(records, {"J1"}, {"J1", "J2"})] == ["o"]


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


def test_the_record_written_in_the_preflight_is_not_written_again_at_once(tmp_path, monkeypatch) -> None:
    """Issue 28: ``write_now`` (in the preflight) then ``begin``: one write at start, not two; the thread
    writes a period after it. A failed first write is retried by the thread at once."""
    import spot_callbacks.accounting.attempts as attempts

    writes: list[str] = []
    real_put = attempts.put_bytes
    failing: set[str] = set()  # records whose next write fails

    def counted(fs: Any, path: str, raw: bytes) -> None:
        writes.append(path)  # (other tests' records, still kept by their threads, are written too)
        if path in failing:
            failing.discard(path)
            raise ConnectionResetError("the first write's connection was reset")
        real_put(fs, path, raw)

    monkeypatch.setattr(attempts, "put_bytes", counted)
    record = attempts.AttemptLog(CheckpointStore(str(tmp_path / "run")), period_s=3600)
    record.write_now()
    record.begin()
    record.discard()  # stops the thread and waits for it: it wrote nothing more
    assert [path for path in writes if path == record.path] == [record.path]

    again = attempts.AttemptLog(CheckpointStore(str(tmp_path / "run2")), period_s=3600)
    failing.add(again.path)
    again.write_now()
    again.begin()
    again.discard()
    assert [path for path in writes if path == again.path] == [again.path] * 2  # the thread's, at once


def test_records_on_s3_are_read_with_one_get_each_and_no_head(s3_server, tmp_path, monkeypatch) -> None:
    """Issue 28: s3fs given a max_concurrency over 1 asks an object's size before a whole read: a HEAD
    where the listing just taken is not cached (``use_listings_cache=False``, or an expired cache)."""
    import s3fs.core

    from spot_callbacks.accounting.attempts import AttemptLog

    options = {**s3_server.storage_options, "max_concurrency": 4, "use_listings_cache": False}
    store = CheckpointStore(
        f"s3://{s3_server.bucket}/attempts-heads-{tmp_path.name}", storage_options=options
    )
    record = AttemptLog(store, period_s=3600)
    record.write_now()  # in this thread: nothing writes while the reads are counted
    requests: list[tuple[str, str]] = []
    call_s3 = s3fs.core.S3FileSystem._call_s3

    async def recorded(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
        requests.append((getattr(method, "__name__", str(method)), kwargs.get("Key", "")))
        return await call_s3(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.core.S3FileSystem, "_call_s3", recorded)
    [read] = read_attempts(CheckpointStore(store.url, storage_options=options))
    assert read.run_id == record.run_id
    # This store's keys only: another test's engine left running in this worker may write its own
    # attempt record (a .json too) through the same patched class meanwhile.
    ours = f"attempts-heads-{tmp_path.name}/"
    assert [method for method, key in requests if key.startswith(ours) and key.endswith(".json")] == [
        "get_object"
    ]
