"""Notices during start-up are kept: a SIGTERM while the run waits for its lock, or while it pulls the
checkpoint it resumes from, ends the process at once with 143 and one line; the lock is released if
it was taken, and the store keeps what it had (the other run's lock, no new object)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from helpers.hostile import hostile_proxy
from test_dataplane_lies import payload

from spot_callbacks import CheckpointStore
from spot_callbacks.store.runlock import LOCK_NAME, RunLock
from spot_callbacks.store.transfer import put_bytes
from spot_callbacks.store.writer import CommitWriter

SCRIPT = Path(__file__).parent / "scripts" / "startup_notice.py"


def _start(url: str, options: dict[str, Any], **env: str) -> subprocess.Popen[str]:
    import os

    environ = {k: v for k, v in os.environ.items() if not k.startswith("SPOT_")}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), url, json.dumps(options)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**environ, **env},
    )  # fmt: skip


def _terminate(child: subprocess.Popen[str]) -> tuple[str, str, float]:
    """SIGTERM ``child``; its stdout, stderr and the seconds it took to exit after the signal."""
    signalled = time.monotonic()
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=30)
    return out, err, time.monotonic() - signalled


def _frozen_at_exit(out: str) -> int:
    """What the script's last atexit handler saw: the objects the exit left uncollected (exit_guard)."""
    [line] = [line for line in out.splitlines() if line.startswith("GC FROZEN AT EXIT ")]
    return int(line.split()[-1])


def _until(condition: Any, what: str, timeout_s: float = 60.0) -> None:
    waiter, deadline = threading.Event(), time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never saw {what}"
        waiter.wait(0.05)


def test_sigterm_while_waiting_for_the_run_lock_exits_143_at_once(s3_server, tmp_path: Path) -> None:
    url, options = f"s3://{s3_server.bucket}/startup-lock-{tmp_path.name}", dict(s3_server.storage_options)
    store = CheckpointStore(url, storage_options=options)
    lock_path = f"{store.root}/{LOCK_NAME}"
    alive = threading.Event()

    def another_live_run() -> None:  # its heartbeat keeps the lock fresh: the new run waits on it
        while not alive.is_set():
            doc = {"host": "other-host", "pid": 4242, "run_id": "a" * 32, "started": "2026-01-01T00:00:00+00:00",
                   "heartbeat": time.time()}  # fmt: skip
            put_bytes(store.fs, lock_path, json.dumps(doc).encode())
            alive.wait(0.5)

    beating = threading.Thread(target=another_live_run, daemon=True)
    beating.start()
    child = _start(url, options, SPOT_LOCK_STALE_S="30")
    try:
        assert child.stderr is not None
        lines: list[str] = []
        while not any("waiting up to" in line for line in lines):
            line = child.stderr.readline()
            assert line, "the child ended before waiting for the lock: " + "".join(lines)
            lines.append(line)
        out, err, took_s = _terminate(child)
    finally:
        child.kill()
        alive.set()
        beating.join(timeout=10)
    assert child.returncode == 143, err
    assert took_s <= 5.0, f"exited {took_s:.1f}s after SIGTERM"
    assert "SIGTERM while waiting for the store and the run lock" in err and "Traceback" not in err
    assert RunLock(store).holder()["run_id"] == "a" * 32  # the other run's lock is untouched
    assert _frozen_at_exit(out) > 0  # a prompt exit: the final collections skipped


def test_sigterm_while_pulling_the_resume_point_exits_143_and_releases_the_lock(
    s3_server, tmp_path: Path
) -> None:
    url = f"s3://{s3_server.bucket}/startup-pull-{tmp_path.name}"
    store = CheckpointStore(url, storage_options=dict(s3_server.storage_options))
    folder, _ = payload(tmp_path, 1, 4 * 2**20)
    CommitWriter(store).write_checkpoint(1, folder, reason="manual", framework="test")
    with hostile_proxy(s3_server.port, "state.pt", "trickle", trickle_s=0.5) as proxy:
        child = _start(url, {**s3_server.storage_options, "endpoint_url": proxy.url})
        try:
            _until(lambda: proxy.answered["GET"] >= 1, "the pull's first GET")
            out, err, took_s = _terminate(child)
        finally:
            child.kill()
    assert child.returncode == 143, err
    assert "started" in out and "pulled" not in out
    assert took_s <= 10.0, f"exited {took_s:.1f}s after SIGTERM"
    assert "SIGTERM while pulling the checkpoint to resume from" in err and "Traceback" not in err
    assert RunLock(store).holder() is None  # released on the way out
    assert [info.step for info in store.committed()] == [1]  # nothing written to the store
    assert _frozen_at_exit(out) > 0
