"""Every store operation is bounded: a hung listing, read, delete or existence check is abandoned
after its attempt timeout, retried, and ends as a reported error (never a stalled step)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.faultfs import FaultyFileSystem

from spot_callbacks import PersistError, SpotConfig
from spot_callbacks.engine import SpotEngine
from spot_callbacks.errors import AttemptTimeoutError
from spot_callbacks.store import CheckpointStore
from spot_callbacks.store.retry import (
    DEFAULT_STORE_TIMEOUT_S,
    STORE_TIMEOUT_ENV,
    RetryPolicy,
    is_transient,
    store_timeout_from_env,
)
from spot_callbacks.store.writer import CommitWriter

ATTEMPT_S = 0.5
QUICK = RetryPolicy(attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05, attempt_timeout_s=ATTEMPT_S)


class HangingFileSystem(FaultyFileSystem):
    """A real filesystem whose reads, listings, deletes and existence checks can hang.

    The first ``hang_reads`` calls of an operation in ``hang_ops`` wait on ``gate`` (``None``: every
    call does) before running: a connection that accepted the request and never answered.
    """

    def __init__(self, inner: Any, hang_ops: set[str], hang_reads: int | None = 1) -> None:
        super().__init__(inner)
        self.hang_ops = hang_ops
        self.hang_reads = hang_reads
        self.release = threading.Event()
        self.hung = 0

    def _maybe_hang(self, op: str, call: Callable[[], Any]) -> Any:
        if op in self.hang_ops:
            with self._lock:
                hang = self.hang_reads is None or self.hung < self.hang_reads
                self.hung += hang
            if hang:
                self.release.wait()
        return call()

    def ls(self, path: str, *args: Any, **kwargs: Any) -> Any:
        return self._maybe_hang("ls", lambda: self.inner.ls(path, *args, **kwargs))

    def find(self, path: str, *args: Any, **kwargs: Any) -> Any:
        return self._maybe_hang("find", lambda: self.inner.find(path, *args, **kwargs))

    def cat_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
        return self._maybe_hang("cat_file", lambda: self.inner.cat_file(path, *args, **kwargs))

    def cat(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        return self._maybe_hang("cat", lambda: self.inner.cat(path, *args, **kwargs))

    def exists(self, path: str, *args: Any, **kwargs: Any) -> Any:
        return self._maybe_hang("exists", lambda: self.inner.exists(path, *args, **kwargs))

    def rm(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        return self._maybe_hang("rm", lambda: self.inner.rm(path, *args, **kwargs))


@pytest.fixture(params=["file", "s3"])
def real_store(request, tmp_path: Path) -> Iterator[CheckpointStore]:
    if request.param == "file":
        store = CheckpointStore(str(tmp_path / "run"), retry=QUICK)
    else:
        server = request.getfixturevalue("s3_server")
        url = f"s3://{server.bucket}/bounded-{uuid.uuid4().hex}"
        store = CheckpointStore(url, storage_options=dict(server.storage_options), retry=QUICK)
    folder = tmp_path / "payload"
    folder.mkdir()
    (folder / "state.bin").write_bytes(b"weights" * 100)
    for step in (1, 2):
        CommitWriter(store).write_checkpoint(step, folder, reason="manual", framework="test")
    yield store


def hang(store: CheckpointStore, ops: set[str], times: int | None) -> HangingFileSystem:
    faulty = HangingFileSystem(store.fs, ops, times)
    store.fs = faulty
    return faulty


@pytest.mark.parametrize(
    ("ops", "operation"),
    [
        ({"ls"}, lambda store: store.step_folders()),
        ({"cat_file"}, lambda store: store.read_manifest(2)),
        ({"cat"}, lambda store: store.committed()),
        ({"find"}, lambda store: store.damage(store.read_manifest(2))),
        ({"exists", "rm"}, lambda store: store.delete(1)),
    ],
    ids=["listing", "read", "manifests", "sizes", "delete"],
)
def test_a_hung_call_is_abandoned_and_retried(real_store, ops, operation, caplog) -> None:
    faulty = hang(real_store, ops, times=1)
    try:
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
            operation(real_store)
        elapsed_s = time.monotonic() - started
    finally:
        faulty.release.set()
    assert faulty.hung == 1
    assert elapsed_s < ATTEMPT_S * len(ops) + 5, elapsed_s
    assert any("did not finish within 0.5s" in r.getMessage() and STORE_TIMEOUT_ENV in r.getMessage()
               for r in caplog.records)  # fmt: skip


@pytest.mark.parametrize("ops", [{"ls"}, {"cat_file"}, {"exists"}], ids=["listing", "read", "exists"])
def test_a_call_that_always_hangs_ends_as_an_error_within_its_attempts(real_store, ops) -> None:
    faulty = hang(real_store, ops, times=None)
    operation = {
        "ls": real_store.step_folders,
        "cat_file": lambda: real_store.read_manifest(2),
        "exists": lambda: real_store.delete(2),
    }[next(iter(ops))]
    try:
        started = time.monotonic()
        with pytest.raises(AttemptTimeoutError, match="did not finish within"):
            operation()
        elapsed_s = time.monotonic() - started
    finally:
        faulty.release.set()
    assert ATTEMPT_S * QUICK.attempts <= elapsed_s < ATTEMPT_S * QUICK.attempts + 5


def test_a_hung_listing_during_training_never_stalls_a_step_and_is_reported(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("SPOT_STRICT", "1")  # every failed checkpoint fails the end, not only the newest
    config = SpotConfig(dirpath=str(tmp_path / "run"), interval=None, preemption=[], keep_last=1,
                        scratch_dir=str(tmp_path / "scratch"))  # fmt: skip
    engine = SpotEngine(config, "test")
    engine.store.retry = RetryPolicy(
        attempts=2, initial_backoff_s=0.01, max_backoff_s=0.05, attempt_timeout_s=0.5
    )
    engine.start()
    try:
        faulty = hang(engine.store, {"exists", "ls", "cat", "find"}, times=None)
        started = time.monotonic()
        engine.save_state(step=1, epoch=0, state={"w": torch.ones(4)}, reason="steps")
        assert time.monotonic() - started < 2.0  # the step goes on while the upload is stuck
        deadline = time.monotonic() + 30
        failures = engine.new_failures()
        while not failures and time.monotonic() < deadline:
            time.sleep(0.1)
            failures = engine.new_failures()
        assert failures, "the hung checkpoint was never reported"
        faulty.release.set()
        faulty.hang_ops = set()
        engine.save_state(step=2, epoch=0, state={"w": torch.ones(4) * 2}, reason="steps")
        assert engine.wait_for_commit(timeout=30)  # training goes on and the next checkpoint lands
    finally:
        if isinstance(engine.store.fs, HangingFileSystem):
            engine.store.fs.release.set()
        with pytest.raises(PersistError, match="checkpoint of step 1 .* did not finish within 0.5s"):
            engine.finish()  # the failure is reported at the end too, as today
    assert engine.store.latest().step == 2


def test_the_attempt_timeout_has_a_documented_default_and_env(monkeypatch) -> None:
    assert store_timeout_from_env({}) == DEFAULT_STORE_TIMEOUT_S == 60.0
    assert store_timeout_from_env({STORE_TIMEOUT_ENV: "5"}) == 5.0
    assert store_timeout_from_env({STORE_TIMEOUT_ENV: "off"}) is None
    with pytest.raises(ValueError, match=STORE_TIMEOUT_ENV):
        store_timeout_from_env({STORE_TIMEOUT_ENV: "soon"})
    monkeypatch.setenv(STORE_TIMEOUT_ENV, "7")
    assert RetryPolicy().attempt_timeout_s == 7.0
    assert RetryPolicy(attempt_timeout_s=None).call(lambda: 1, "x") == 1


def test_a_4xx_answer_is_not_retried_but_throttling_and_5xx_are() -> None:
    class HttpResponseError(Exception):
        def __init__(self, status_code: int) -> None:
            super().__init__(f"HTTP {status_code}")
            self.status_code = status_code

    assert not is_transient(HttpResponseError(403))
    assert not is_transient(HttpResponseError(400))
    assert is_transient(HttpResponseError(429)) and is_transient(HttpResponseError(503))
    assert is_transient(AttemptTimeoutError("hung"))
