"""The run lock under races and hard losses, on moto's S3 (conditional writes) and the local disk.

Two processes racing for one stale lock: exactly one owns it every round, the other's error names
the winner; a lock whose owner vanished (a hard kill: no release) is taken over by a new host within
15 s of its start with the default stale time; ages come from the store's clock, not this host's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from spot_callbacks import CheckpointStore, RunLockedError
from spot_callbacks.store.layout import is_local_fs
from spot_callbacks.store.runlock import CLOCK_PROBE_PREFIX, LOCK_NAME, RunLock, has_conditional_writes

RACER = Path(__file__).parent / "scripts" / "lock_racer.py"
ROUNDS = 20


@pytest.fixture(params=["s3", "file"])
def lock_target(request, tmp_path):
    if request.param == "file":
        return str(tmp_path / "run"), {}
    info = request.getfixturevalue("s3_server")
    return f"s3://{info.bucket}/race-{tmp_path.name}", dict(info.storage_options)


def _foreign_lock(url: str, options: dict, run_id: str) -> None:
    """A lock as a run on another machine writes it (``put_bytes``: whole or not at all)."""
    store = CheckpointStore(url, storage_options=options)
    doc = {"host": "vanished-host", "pid": 4242, "run_id": run_id, "started": "2026-01-01T00:00:00+00:00",
           "heartbeat": time.time()}  # fmt: skip
    from spot_callbacks.store.transfer import put_bytes

    if is_local_fs(store.fs):
        store.fs.makedirs(store.root, exist_ok=True)
    put_bytes(store.fs, f"{store.root}/{LOCK_NAME}", json.dumps(doc).encode())


def _racer(url: str, options: dict, host: str) -> subprocess.Popen[str]:
    racer = subprocess.Popen(
        [sys.executable, str(RACER), url, json.dumps(options), "1", host],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert racer.stdout is not None and racer.stdout.readline().strip() == "ready"
    return racer


def test_two_hosts_racing_for_one_stale_lock_never_both_hold_it(lock_target) -> None:
    url, options = lock_target
    store = CheckpointStore(url, storage_options=options)
    for round_ in range(ROUNDS):
        _foreign_lock(url, options, run_id=f"{round_:032x}")  # the dead run's lock, stale after 1 s
        racers = [_racer(url, options, f"host-{round_}-{side}") for side in "ab"]
        for racer in racers:
            assert racer.stdin is not None
            racer.stdin.write("go\n")
            racer.stdin.flush()
        results = [json.loads(racer.stdout.readline()) for racer in racers if racer.stdout is not None]
        holder = RunLock(store).holder()
        for racer in racers:
            racer.communicate("release\n", timeout=60)
        winners = [result for result in results if result["won"]]
        assert len(winners) == 1, f"round {round_}: {results}"
        loser = next(result for result in results if not result["won"])
        assert holder is not None and holder["run_id"] == winners[0]["run_id"], f"round {round_}"
        assert winners[0]["run_id"][:8] in loser["error"], loser["error"]  # the error names the winner
    store.fs.invalidate_cache()
    assert not [name for name in store.fs.find(store.root) if CLOCK_PROBE_PREFIX in name]  # no probe left


def test_a_new_host_takes_over_a_vanished_owners_lock_within_15s(lock_target, monkeypatch) -> None:
    url, options = lock_target
    monkeypatch.delenv("SPOT_LOCK_STALE_S", raising=False)  # the default stale time is the feature
    store = CheckpointStore(url, storage_options=options)
    owner = RunLock(store)
    owner._owner["host"] = "vanished-host"  # another machine (on this one its dead pid would tell)
    owner.acquire()
    owner._stop.set()  # the machine vanished: its heartbeat stops, nothing releases the lock
    assert owner._thread is not None
    owner._thread.join(timeout=30)
    started = time.monotonic()
    replacement = RunLock(CheckpointStore(url, storage_options=options))
    replacement.acquire()
    took_s = time.monotonic() - started
    try:
        assert replacement.holder()["run_id"] == replacement.run_id
        assert replacement.taken_from is not None and replacement.taken_from["run_id"] == owner.run_id
        assert took_s <= 15.0, f"the replacement waited {took_s:.1f}s on a dead run's lock"
    finally:
        replacement.release()


def test_a_live_owner_keeps_its_lock_against_a_new_host(lock_target) -> None:
    url, options = lock_target
    owner = RunLock(CheckpointStore(url, storage_options=options), stale_s=2.0)
    owner._owner["host"] = "live-host"  # another machine, alive: its heartbeat goes on
    owner.acquire()
    try:
        second = RunLock(CheckpointStore(url, storage_options=options), stale_s=2.0)
        with pytest.raises(RunLockedError, match=owner.run_id[:8]):
            second.acquire()  # watched for longer than the stale time: the heartbeat kept it fresh
        assert not owner.lost and owner.holder()["run_id"] == owner.run_id
    finally:
        owner.release()


def test_an_owner_whose_lock_was_taken_over_learns_it_at_its_next_heartbeat(lock_target) -> None:
    url, options = lock_target
    owner = RunLock(CheckpointStore(url, storage_options=options), stale_s=2.0)
    lost = threading.Event()
    owner.on_lost = lambda reason: lost.set()
    owner.acquire()
    try:
        _foreign_lock(url, options, run_id="e" * 32)  # another run overwrote it (e.g. SPOT_FORCE_LOCK)
        assert lost.wait(timeout=30), "the heartbeat never noticed the lock was another run's"
        assert owner.lost and "eeeeeeee" in (owner.lost_reason or "")
        assert RunLock(CheckpointStore(url, storage_options=options)).holder()["run_id"] == "e" * 32
    finally:
        owner.release()  # not ours any more: left in place


def test_s3_uses_conditional_writes_and_the_local_disk_its_atomic_link(lock_target) -> None:
    url, options = lock_target
    store = CheckpointStore(url, storage_options=options)
    assert has_conditional_writes(store.fs) is url.startswith("s3://")


def test_a_take_over_conditions_on_the_lock_it_judged_not_on_a_racing_winners(s3_server, tmp_path) -> None:
    """Of two hosts taking over one stale lock, the slower one's If-Match is on the ETag of the lock it
    read and judged: a winner that wrote in between is never overwritten (before: the ETag came from a
    later look at the object, the winner's, and both hosts held the lock)."""
    url, options = f"s3://{s3_server.bucket}/toctou-{tmp_path.name}", dict(s3_server.storage_options)
    _foreign_lock(url, options, run_id="d" * 32)  # the dead run's lock
    winner = RunLock(CheckpointStore(url, storage_options=options), stale_s=0.5)
    slower = RunLock(CheckpointStore(url, storage_options=options), stale_s=0.5)
    judge = slower._why_free

    def judged_stale_while_the_winner_takes_it(doc: dict) -> str:
        winner.acquire()  # the other host takes the lock between our read of it and our judgement
        judge(doc)  # looks at the object again, as a judgement does (the winner's object now)
        return "judged stale (as read)"

    slower._why_free = judged_stale_while_the_winner_takes_it  # type: ignore[method-assign]
    try:
        with pytest.raises(RunLockedError, match=winner.run_id[:8]):
            slower.acquire()
        assert RunLock(CheckpointStore(url, storage_options=options)).holder()["run_id"] == winner.run_id
        assert not winner.lost
    finally:
        winner.release()
        slower.release()


def test_a_watcher_whose_lock_is_taken_over_mid_look_names_the_new_owner(tmp_path) -> None:
    """A lock rewritten between the watcher's read of its content and of its stamp is refused in the
    name of whoever holds it now, not of the run it had read (CI once named the dead run)."""
    url = str(tmp_path / "run")
    _foreign_lock(url, {}, run_id="c" * 32)  # fresh: watched, not taken over at once
    watcher = RunLock(CheckpointStore(url), stale_s=30.0)
    read = watcher.holder
    reads = 0

    def read_then_another_host_takes_it_over() -> dict | None:
        nonlocal reads
        doc = read()
        reads += 1
        if reads == 2:  # the watch's first look: its content is read, its stamp not yet
            _foreign_lock(url, {}, run_id="f" * 32)
        return doc

    watcher.holder = read_then_another_host_takes_it_over  # type: ignore[method-assign]
    with pytest.raises(RunLockedError, match="ffffffff"):
        watcher.acquire()
    assert reads >= 3
