"""Issue 15 hardening of the store: links, the run lock, refused deletes, lost answers, damaged
manifests, resource bounds, pull destinations and the CLI's verdicts, against real stores."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import posixpath
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.request import Request, urlopen

import pytest

from spot_callbacks import CheckpointStore
from spot_callbacks.cli import main
from spot_callbacks.errors import DeleteIncompleteError, RunLockedError, UnsafeDestinationError
from spot_callbacks.store import MANIFEST_NAME, step_dirname
from spot_callbacks.store.checkpoint_store import manifest_verdicts, newest_valid
from spot_callbacks.store.retry import RetryPolicy
from spot_callbacks.store.runlock import RunLock
from spot_callbacks.store.writer import CommitWriter
from tests.helpers.faultfs import FaultyFileSystem

FAST_RETRY = RetryPolicy(attempts=2, initial_backoff_s=0.01, max_backoff_s=0.05)


def commit(store: CheckpointStore, tmp_path: Path, step: int, reason: str = "interval") -> bytes:
    folder = tmp_path / f"src-{step}-{reason}"
    folder.mkdir(parents=True, exist_ok=True)
    data = f"{step}:state:".encode() * 100
    (folder / "state.pt").write_bytes(data)
    CommitWriter(store).write_checkpoint(step, folder, reason=reason, framework="test")
    return data


def local_store(path: Path) -> CheckpointStore:
    return CheckpointStore(path.as_uri(), retry=FAST_RETRY)


def manifest_path(store: CheckpointStore, step: int) -> str:
    return posixpath.join(store.step_path(step), MANIFEST_NAME)


# ------------------------------------------------------------------ 6: never delete through a link
def test_a_step_folder_linked_from_another_run_is_never_pruned_or_removed(tmp_path, caplog):
    other, ours = local_store(tmp_path / "other"), local_store(tmp_path / "ours")
    commit(other, tmp_path, 1)
    commit(ours, tmp_path, 5)
    commit(ours, tmp_path, 6)
    before = {p.name: p.read_bytes() for p in Path(other.step_path(1)).iterdir()}
    os.symlink(other.step_path(1), ours.step_path(1), target_is_directory=True)

    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        assert [info.step for info in ours.committed()] == [5, 6]
        assert ours.prune(keep_last=1) == [5]
    assert "symbolic link" in caplog.text and step_dirname(1) in caplog.text
    assert main(["rm", ours.url, "--step", "1", "--yes", "--force"]) == 1
    assert {p.name: p.read_bytes() for p in Path(other.step_path(1)).iterdir()} == before
    assert os.path.islink(ours.step_path(1)) and [info.step for info in other.committed()] == [1]


# ------------------------------------------------------------------ 8: one run lock at a time, locally
def _take_lock(url: str, start: Any, results: Any, done: Any) -> None:
    lock = RunLock(CheckpointStore(url), stale_s=2.0)
    start.wait()
    try:
        lock.acquire()
    except RunLockedError:
        results.put("refused")
        return
    results.put("took")
    done.wait(60)
    lock.release()


def test_of_simultaneous_starts_on_a_local_dirpath_exactly_one_takes_the_lock(tmp_path):
    context = multiprocessing.get_context("spawn")
    starters = 8
    start, done, results = context.Barrier(starters), context.Event(), context.Queue()
    url = (tmp_path / "run").as_uri()
    procs = [context.Process(target=_take_lock, args=(url, start, results, done)) for _ in range(starters)]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    done.set()
    for proc in procs:
        proc.join(60)
    assert sorted(outcomes) == ["refused"] * (starters - 1) + ["took"]


def test_a_run_whose_lock_was_taken_over_finds_out_at_its_next_heartbeat(tmp_path):
    store = local_store(tmp_path / "run")
    lost = threading.Event()
    lock = RunLock(store, stale_s=0.4, on_lost=lambda reason: lost.set())
    lock.acquire()
    intruder = {"host": "elsewhere", "pid": 1, "run_id": "f" * 32, "started": "now", "heartbeat": 1e12}
    Path(lock.path).write_text(json.dumps(intruder))
    assert lost.wait(30) and lock.lost
    assert "lost its run lock" in lock.lost_reason and "elsewhere" in lock.lost_reason
    lock.release()
    assert json.loads(Path(lock.path).read_text())["run_id"] == "f" * 32  # not ours: left alone


class WatchedTakeOver(RunLock):
    """A run taking the lock over that lets the lock's owner read it just before each of its writes
    (``_claim``, ``_write``): the moments a take-over could show the owner no lock at all."""

    def __init__(self, store: CheckpointStore, owner: RunLock) -> None:
        super().__init__(store, stale_s=owner.stale_s)
        self.owner = owner
        self.owner_read: list[Any] = []

    def _claim(self) -> bool:
        self.owner_read.append(self.owner.holder())
        return super()._claim()

    def _write(self) -> None:
        self.owner_read.append(self.owner.holder())
        super()._write()


def test_a_forced_take_over_replaces_the_lock_in_place_and_its_owner_is_told_who(tmp_path, monkeypatch):
    store = local_store(tmp_path / "run")
    lost = threading.Event()
    owner = RunLock(store, stale_s=0.4, on_lost=lambda reason: lost.set())
    owner.acquire()
    monkeypatch.setenv("SPOT_FORCE_LOCK", "1")
    taker = WatchedTakeOver(local_store(tmp_path / "run"), owner)
    taker.acquire()
    # Before: renamed aside, then created: the owner's heartbeat could read "deleted" in between.
    assert taker.owner_read and None not in taker.owner_read, taker.owner_read
    assert lost.wait(30) and owner.lost
    assert f"run {taker.run_id[:8]}" in owner.lost_reason and "deleted" not in owner.lost_reason
    owner.release()
    taker.release()
    assert not Path(taker.path).exists()


# ------------------------------------------------------------------ 10: a lost answer to the manifest PUT
class LostAnswerFileSystem(FaultyFileSystem):
    """Writes the manifest, then raises as if the answer never came back."""

    def pipe_file(self, path: str, value: bytes, *args: Any, **kwargs: Any) -> Any:
        self.inner.pipe_file(path, value, *args, **kwargs)
        if path.endswith(MANIFEST_NAME):
            raise ConnectionError(f"injected: the answer to writing {path} was lost")


# Object stores only: a local manifest is written beside and renamed, never by pipe_file.
@pytest.mark.parametrize(
    "store_url",
    [
        pytest.param(b, id=b, marks=[pytest.mark.remote_store] if b != "memory" else [])
        for b in ("memory", "s3", "az", "gs")
    ],
    indirect=True,
)
def test_a_manifest_that_landed_although_its_answer_was_lost_is_committed(store_url, tmp_path, caplog):
    store = CheckpointStore(store_url.url, storage_options=store_url.storage_options, retry=FAST_RETRY)
    store.fs = LostAnswerFileSystem(store.fs)
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        info = commit(store, tmp_path, 3) and store.latest()
    assert info is not None and info.step == 3
    assert "is committed" in caplog.text


# ------------------------------------------------------------------ 11 + 2: damaged manifests fall back
DEGENERATE = {
    "ledger Infinity": lambda doc: {**doc, "extra": {"ledger": {"train_s": "INF"}}},
    "wrong step": lambda doc: {**doc, "step": 7},
    "reason a list": lambda doc: {**doc, "reason": ["end"]},
    "negative size": lambda doc: {**doc, "files": {"state.pt": {**doc["files"]["state.pt"], "size": -1}}},
    "huge size": lambda doc: {**doc, "files": {"state.pt": {**doc["files"]["state.pt"], "size": 10**18}}},
    "epoch a string": lambda doc: {**doc, "epoch": "1"},
}


@pytest.mark.parametrize("damage", list(DEGENERATE))
def test_a_degenerate_manifest_is_damaged_warned_and_skipped_and_ls_agrees(damage, tmp_path, caplog, capsys):
    store = local_store(tmp_path / "run")
    commit(store, tmp_path, 1)
    commit(store, tmp_path, 2)
    path = Path(manifest_path(store, 2))
    doc = DEGENERATE[damage](json.loads(path.read_bytes()))
    raw = json.dumps(doc).replace('"INF"', "Infinity").encode()
    path.write_bytes(raw)
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        assert store.latest().step == 1
        assert [info.step for info in store.committed()] == [1]
    assert f"{step_dirname(2)}" in caplog.text and path.read_bytes() == raw  # named, never deleted
    capsys.readouterr()
    assert main(["ls", store.url]) == 0
    lines = capsys.readouterr().out.splitlines()[1:-1]
    rows = {line.split()[1] if line.startswith("*") else line.split()[0]: line for line in lines}
    assert rows["1"].startswith("*") and rows["1"].endswith("ok") and not rows["2"].endswith("ok")


def test_a_checkpoint_deleted_between_listing_and_reading_is_damaged_not_fatal(tmp_path, caplog):
    store = local_store(tmp_path / "run")
    commit(store, tmp_path, 1)
    commit(store, tmp_path, 2)
    infos = store.committed()
    os.remove(posixpath.join(store.step_path(2), "state.pt"))
    os.remove(manifest_path(store, 2))
    skipped: list[tuple[int, str]] = []
    assert newest_valid(store, infos, on_damaged=lambda info, why: skipped.append((info.step, why))).step == 1
    assert [step for step, _ in skipped] == [2] and "missing" in skipped[0][1]


def test_a_manifest_bomb_is_refused_before_any_payload_is_read(tmp_path, monkeypatch):
    store = local_store(tmp_path / "run")
    commit(store, tmp_path, 1)
    os.makedirs(store.step_path(2))
    deep = b"[" * 100_000 + b"]" * 100_000
    many = {f"f{i}": {"size": 1, "checksum": "xxh3_64:00"} for i in range(50)}
    doc = json.loads(Path(manifest_path(store, 1)).read_bytes())
    for raw, why in (
        (deep, "nests deeper"),
        (json.dumps({**doc, "step": 2, "files": many}).encode(), "lists 50 files"),
        (b'{"format": "spot_callbacks.checkpoint"' + b" " * 9000 + b"}", "SPOT_MANIFEST_MAX_BYTES"),
    ):
        monkeypatch.setenv("SPOT_MANIFEST_MAX_FILES", "20")
        monkeypatch.setenv("SPOT_MANIFEST_MAX_BYTES", "8000" if why != "nests deeper" else "10000000")
        Path(manifest_path(store, 2)).write_bytes(raw)
        verdicts = {verdict.step: verdict.problem for verdict in manifest_verdicts(store)}
        assert verdicts[1] is None and why in verdicts[2]
        assert store.latest().step == 1


# ------------------------------------------------------------------ 9: deletes the store refuses per key
class _RefusingProxy(BaseHTTPRequestHandler):
    """In front of moto: a DeleteObjects of keys under ``refuse`` answers 200 with a per-key AccessDenied
    (as S3 does under a bucket policy or an object lock) and deletes nothing; all else passes through."""

    upstream = ""
    refuse = ""
    protocol_version = "HTTP/1.1"  # answers botocore's Expect: 100-continue

    def do_POST(self) -> None:
        body = self._body() or b""
        keys = re.findall(rb"<Key>([^<]+)</Key>", body)
        if "delete" in self.path and any(self.refuse.encode() in key for key in keys):
            errors = b"".join(
                b"<Error><Key>%s</Key><Code>AccessDenied</Code><Message>Access Denied</Message></Error>" % key
                for key in keys
            )
            self._answer(200, b'<?xml version="1.0"?><DeleteResult>%s</DeleteResult>' % errors, {})
            return
        self._forward(body)

    def do_GET(self) -> None:
        self._forward(None)

    do_PUT = do_DELETE = do_HEAD = lambda self: self._forward(self._body())  # noqa: E731

    def _body(self) -> bytes | None:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0], 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length", 0))
        return self.rfile.read(length) if length else None

    def _forward(self, body: bytes | None) -> None:
        headers = {
            k: v
            for k, v in self.headers.items()
            if k.lower() not in ("host", "content-length", "expect", "transfer-encoding")
        }
        headers.setdefault("Content-Type", "application/octet-stream")  # urllib's default is a form
        request = Request(self.upstream + self.path, data=body, headers=headers, method=self.command)
        try:
            with urlopen(request, timeout=30) as answer:
                self._answer(answer.status, answer.read(), dict(answer.headers))
        except Exception as err:  # noqa: BLE001 - HTTP errors pass through as they are
            self._answer(err.code, err.read(), dict(err.headers))  # type: ignore[attr-defined]

    def _answer(self, status: int, payload: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for key, value in headers.items():
            if key.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                self.send_header(key, value)
        self.send_header(
            "Content-Length",
            str(len(payload) if self.command != "HEAD" else headers.get("Content-Length", 0)),
        )
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def refusing_s3(s3_server):
    handler = type(
        "Handler", (_RefusingProxy,), {"upstream": s3_server.endpoint_url, "refuse": "step-000000001"}
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    options = {**s3_server.storage_options, "endpoint_url": f"http://127.0.0.1:{server.server_port}"}
    yield s3_server, options
    server.shutdown()


@pytest.mark.remote_store
def test_deletes_the_store_refuses_per_key_are_reported_not_claimed(refusing_s3, tmp_path, caplog, capsys):
    s3_server, options = refusing_s3
    url = f"s3://{s3_server.bucket}/refused-{os.getpid()}-{id(tmp_path)}"
    store = CheckpointStore(url, storage_options={**options, "skip_instance_cache": True}, retry=FAST_RETRY)
    for step in (1, 2, 3):
        commit(store, tmp_path, step)
    with caplog.at_level(logging.INFO, logger="spot_callbacks"):
        assert store.prune(keep_last=1) == [2]
    assert "retention could not delete" in caplog.text and step_dirname(1) in caplog.text
    assert [info.step for info in store.committed()] == [1, 3]  # still committed and whole
    assert store.verify(1)
    with pytest.raises(DeleteIncompleteError) as refused:
        store.delete(1)
    assert refused.value.remaining and MANIFEST_NAME in refused.value.remaining[0]
    capsys.readouterr()
    code = main(["--storage-options", json.dumps(options), "rm", url, "--step", "1", "--yes"])
    out, err = capsys.readouterr()
    assert code == 1 and "deleted" not in out and f"{step_dirname(1)}/{MANIFEST_NAME}" in err


# ------------------------------------------------------------------ pull refuses what is not its own
def test_the_library_pull_refuses_the_working_directory_a_link_and_a_users_folder(tmp_path, monkeypatch):
    store = local_store(tmp_path / "run")
    data = commit(store, tmp_path, 1)
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    monkeypatch.chdir(user)
    for dest, why in ((".", "current directory"), (str(user), "current directory")):
        with pytest.raises(UnsafeDestinationError, match=why):
            store.pull(1, dest)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsafeDestinationError, match="not empty"):
        store.pull(1, user)
    (tmp_path / "link").symlink_to(user, target_is_directory=True)
    with pytest.raises(UnsafeDestinationError, match="symbolic link"):
        store.pull(1, tmp_path / "link", force=True)
    assert sorted(p.name for p in user.iterdir()) == ["notes.txt"]
    staged = tmp_path / "staged"  # the run's own staging of that step: its files, no manifest
    staged.mkdir()
    (staged / "state.pt").write_bytes(b"partial")
    assert (store.pull(1, staged) / "state.pt").read_bytes() == data


# ------------------------------------------------------------------ 16: missing folders and buckets
def test_ls_of_a_missing_folder_or_bucket_is_an_error_and_an_empty_folder_too(tmp_path, s3_server, capsys):
    assert main(["ls", str(tmp_path / "nonexistent")]) == 1
    assert "no such folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()  # as empty as an object store's prefix with nothing under it (issue 23)
    assert main(["ls", str(tmp_path / "empty")]) == 1
    assert "nothing is stored under" in capsys.readouterr().err
    options = json.dumps(s3_server.storage_options)
    assert main(["--storage-options", options, "ls", "s3://no-such-bucket-h15/x"]) == 1
    err = capsys.readouterr().err
    assert "'no-such-bucket-h15' does not exist" in err and len(err.strip().splitlines()) == 1


def test_report_follows_the_newest_valid_checkpoint_and_names_a_newer_step_0_one(tmp_path, capsys):
    store = local_store(tmp_path / "run")
    for step in (10, 20):
        commit(store, tmp_path, step)
    commit(store, tmp_path, 0, reason="exception")  # a later run failed at once, from scratch
    assert main(["report", store.url]) == 0
    out = capsys.readouterr().out
    assert "not in this report: step 0 (exception" in out and "step 20, which this report follows" in out
