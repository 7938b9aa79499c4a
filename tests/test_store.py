"""The commit protocol of CheckpointStore, run against file://, memory://, s3://, az:// and gs://."""

from __future__ import annotations

import json
import logging
import os
import posixpath
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timezone
from pathlib import Path

import fsspec
import pytest
from helpers.reliability_counts import DAMAGED, record

from spot_callbacks import (
    CheckpointNotFoundError,
    CheckpointStore,
    CorruptCheckpointError,
    ManifestError,
)
from spot_callbacks.store import (
    MANIFEST_NAME,
    local_payload_names,
    parse_manifest,
    step_dirname,
)
from spot_callbacks.store.checksums import FileDigest
from spot_callbacks.store.layout import open_filesystem, url_of
from spot_callbacks.store.manifest import encode_manifest, new_manifest
from spot_callbacks.store.retry import RetryPolicy
from spot_callbacks.store.transfer import call_in_time, put_bytes, put_file, staged_folder
from spot_callbacks.store.writer import CommitWriter

FAST_RETRY = RetryPolicy(attempts=2, initial_backoff_s=0.01, max_backoff_s=0.05)


def make_payload(folder: Path, step: int, sizes: dict[str, int] | None = None) -> dict[str, bytes]:
    """Files whose bytes depend on the step, so a mix-up between checkpoints is visible."""
    sizes = sizes or {"state.pt": 3000, "extra/rng.bin": 17}
    contents = {}
    for name, size in sizes.items():
        data = (f"{step}:{name}:".encode() * (size // 8 + 1))[:size]
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
        contents[name] = data
    return contents


@pytest.fixture
def store(store_url):
    return CheckpointStore(store_url.url, storage_options=store_url.storage_options, retry=FAST_RETRY)


def commit_step(store: CheckpointStore, tmp_path: Path, step: int, reason: str = "interval", **kw):
    folder = tmp_path / f"src-{step}"
    folder.mkdir()
    contents = make_payload(folder, step, **kw)
    info = CommitWriter(store).write_checkpoint(
        step, folder, reason=reason, framework="test", epoch=step // 10
    )
    return info, contents


def remote_file(store: CheckpointStore, step: int, name: str) -> str:
    return posixpath.join(store.step_path(step), name)


def test_round_trip_commit_list_verify_pull(store, store_url, tmp_path):
    assert store.committed() == [] and store.latest() is None
    info, contents = commit_step(store, tmp_path, 1200)

    assert store.url.split("://")[0] == store_url.url.split("://")[0]
    assert info.url == store.step_url(1200) and info.url.endswith(step_dirname(1200))
    if store_url.backend in ("s3", "az", "gs", "memory"):
        assert info.url.startswith(f"{store_url.backend}://"), info.url  # never loses the protocol
    assert info.size_bytes == sum(len(b) for b in contents.values())
    assert (info.reason, info.framework, info.epoch) == ("interval", "test", 120)
    assert info.created.tzinfo == timezone.utc

    [listed] = store.committed()
    assert listed.step == 1200 and listed.files == info.files
    assert store.latest().step == 1200
    assert store.verify(1200) is True

    dest = store.pull(1200, tmp_path / "pulled")
    for name, data in contents.items():
        assert (dest / name).read_bytes() == data
    assert json.loads((dest / MANIFEST_NAME).read_text())["step"] == 1200
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".pulled")]  # no staging left


def test_dcp_metadata_is_payload_while_hidden_temporaries_are_not(store, tmp_path):
    # HF/accelerate FSDP (SHARDED_STATE_DICT) writes torch.distributed.checkpoint folders into
    # checkpoint-N: `.metadata` is hidden, and the shards beside it cannot be loaded without it.
    source = tmp_path / "checkpoint-7"
    payload = make_payload(source, 7, sizes={
        "pytorch_model_fsdp_0/.metadata": 900, "pytorch_model_fsdp_0/__0_0.distcp": 4000,
        "pytorch_model_fsdp_0/__1_0.distcp": 4000, "optimizer_0/.metadata": 700,
        "optimizer_0/__0_0.distcp": 8000, "optimizer_0/__1_0.distcp": 8000, "trainer_state.json": 50,
    })  # fmt: skip
    make_payload(source, 7, sizes={
        "optimizer_0/.metadata.tmp": 10, ".manifest.json.1a2b3c4d.tmp": 10, ".cache/.metadata": 10,
        "pytorch_model_fsdp_0/.partial": 10,
    })  # fmt: skip
    assert local_payload_names(source) == sorted(payload)

    info = CommitWriter(store).write_checkpoint(7, source, reason="steps", framework="hf")
    assert sorted(info.files) == sorted(payload)
    assert store.verify(7, deep=True) is True
    pulled = store.pull(7, tmp_path / "pulled")
    assert {name: (pulled / name).read_bytes() for name in payload} == payload
    assert local_payload_names(pulled) == sorted(payload)


def test_checkpoint_without_manifest_is_invisible(store, tmp_path):
    commit_step(store, tmp_path, 10)
    folder = tmp_path / "partial"
    folder.mkdir()
    make_payload(folder, 20)
    writer = CommitWriter(store)
    writer.begin(20)
    writer.upload_file(folder / "state.pt", 20, "state.pt")  # payload durable, never committed

    assert [info.step for info in store.committed()] == [10]
    assert store.latest().step == 10
    with pytest.raises(CheckpointNotFoundError, match="step 20"):
        store.verify(20)
    assert 20 in store.step_folders()


def test_truncated_payload_is_skipped_by_latest_and_fails_verify(store, tmp_path, caplog):
    commit_step(store, tmp_path, 1)
    info, contents = commit_step(store, tmp_path, 2)
    store.fs.pipe_file(remote_file(store, 2, "state.pt"), contents["state.pt"][:100])

    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        assert store.latest().step == 1
    assert any(
        "skipping damaged checkpoint" in r.message and step_dirname(2) in r.message for r in caplog.records
    )
    with pytest.raises(CorruptCheckpointError, match=r"state\.pt is 100 bytes but the manifest says 3000"):
        store.verify(2)
    assert [i.step for i in store.committed()] == [1, 2]  # skipped, never silently deleted
    record(DAMAGED)


def test_altered_payload_fails_verify_and_pull_with_checksums(store, tmp_path):
    _, contents = commit_step(store, tmp_path, 7)
    flipped = bytearray(contents["state.pt"])
    flipped[1234] ^= 0x01
    store.fs.pipe_file(remote_file(store, 7, "state.pt"), bytes(flipped))

    assert store.verify(7, deep=False) is True  # sizes alone cannot see a flipped bit
    with pytest.raises(CorruptCheckpointError, match=r"state\.pt does not match its manifest: checksum"):
        store.verify(7)
    with pytest.raises(CorruptCheckpointError, match="downloaded as"):
        store.pull(7, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()
    record(DAMAGED)


def test_missing_payload_file_is_named(store, tmp_path):
    commit_step(store, tmp_path, 3)
    store.fs.rm(remote_file(store, 3, "extra/rng.bin"))
    with pytest.raises(CorruptCheckpointError, match=r"extra/rng\.bin is missing"):
        store.verify(3)
    assert store.latest() is None
    record(DAMAGED)


@pytest.mark.parametrize(
    ("manifest_bytes", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"format": "spot_callbacks.checkpoint", "format_version": 99, "step": 5, "files": {}}', "upgrade"),
        (b'{"format": "something-else"}', "not a spot_callbacks manifest"),
    ],
)
def test_unreadable_manifests_are_ignored_with_a_warning(store, tmp_path, caplog, manifest_bytes, message):
    commit_step(store, tmp_path, 4)
    _, _ = commit_step(store, tmp_path, 5)
    store.fs.pipe_file(remote_file(store, 5, MANIFEST_NAME), manifest_bytes)
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        assert store.latest().step == 4
    assert any(message in r.message for r in caplog.records)
    with pytest.raises(ManifestError, match=message):
        store.verify(5)
    record(DAMAGED)


@pytest.mark.parametrize("name", ["../escape.bin", "/etc/passwd", "s3://other/x", "a/../../b", "C:/x"])
def test_manifest_naming_a_file_outside_its_folder_is_refused(store, tmp_path, name):
    info, _ = commit_step(store, tmp_path, 6)
    path = remote_file(store, 6, MANIFEST_NAME)
    doc = json.loads(store.fs.cat_file(path))
    doc["files"][name] = {"size": 1, "checksum": "xxh3_64:00"}
    store.fs.pipe_file(path, json.dumps(doc).encode())
    assert store.committed() == []
    with pytest.raises(ManifestError, match="not a plain relative path"):
        store.pull(6, tmp_path / "out")
    assert not (tmp_path / "escape.bin").exists()
    record(DAMAGED)


def test_prune_keeps_the_newest_and_deletes_manifest_first(store, tmp_path):
    for step in (1, 2, 3, 4):
        commit_step(store, tmp_path, step)
    deleted_order = []
    real_rm = store.fs.rm

    def recording_rm(path, *args, **kwargs):  # retention deletes in bulk: a list of paths per call
        deleted_order.extend(
            posixpath.relpath(p, store.root) for p in ([path] if isinstance(path, str) else path)
        )
        return real_rm(path, *args, **kwargs)

    store.fs.rm = recording_rm
    try:
        assert store.prune(keep_last=2) == [1, 2]
    finally:
        del store.fs.rm
    manifest_1 = f"{step_dirname(1)}/{MANIFEST_NAME}"
    payload_1 = [
        i for i, path in enumerate(deleted_order) if path.startswith(step_dirname(1)) and path != manifest_1
    ]
    assert deleted_order[0] == manifest_1 and payload_1 and min(payload_1) > 0
    assert [i.step for i in store.committed()] == [3, 4]
    assert set(store.step_folders()) == {3, 4}
    assert store.prune(keep_last=0) == []


def test_prune_never_deletes_the_newest_valid_checkpoint(store, tmp_path):
    commit_step(store, tmp_path, 1)
    for step in (2, 3):
        _, contents = commit_step(store, tmp_path, step)
        store.fs.pipe_file(remote_file(store, step, "state.pt"), b"short")  # damaged
    store.prune(keep_last=1)
    assert store.latest().step == 1
    assert store.verify(1)
    # Damaged checkpoints are neither counted nor deleted (issue 21 item 8): 1 is the valid one kept.
    assert [i.step for i in store.committed()] == [1, 2, 3]


def test_prune_racing_a_commit_never_touches_the_new_checkpoint(store, tmp_path):
    for step in (1, 2):
        commit_step(store, tmp_path, step)
    real_step_folders = store.step_folders

    def listing_then_concurrent_commit():
        seen = real_step_folders()
        commit_step(store, tmp_path, 3)  # another writer commits right after prune listed
        return seen

    store.step_folders = listing_then_concurrent_commit
    try:
        assert store.prune(keep_last=1) == [1]
    finally:
        del store.step_folders
    assert [i.step for i in store.committed()] == [2, 3]
    assert store.latest().step == 3 and store.verify(3)


def test_rewriting_an_existing_step_drops_its_manifest_before_any_payload(store, tmp_path):
    commit_step(store, tmp_path, 50)
    writer = CommitWriter(store)
    writer.begin(50)
    assert store.committed() == []
    folder = tmp_path / "again"
    folder.mkdir()
    make_payload(folder, 5050, sizes={"state.pt": 10})
    writer.upload_file(folder / "state.pt", 50, "state.pt")
    assert store.committed() == []  # the stale manifest is gone while the new payload lands
    assert not store.fs.exists(remote_file(store, 50, "extra/rng.bin"))


def test_pull_reuses_a_matching_local_copy_and_replaces_a_stale_one(store, tmp_path):
    _, contents = commit_step(store, tmp_path, 9)
    dest = store.pull(9, tmp_path / "cache")
    calls = []
    plane = store.data_plane  # what moves payload bytes (on s3, not fsspec's get_file)
    real_download = plane.download
    plane.download = lambda *a, **k: calls.append(a) or real_download(*a, **k)
    try:
        store.pull(9, dest)
        assert calls == []  # verified local copy: nothing downloaded
        (dest / "state.pt").write_bytes(b"x" * len(contents["state.pt"]))  # same size, other bytes
        store.pull(9, dest)
        assert len(calls) == 2
    finally:
        del plane.download
    assert (dest / "state.pt").read_bytes() == contents["state.pt"]


def test_pull_latest_and_nothing_committed(store, tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        store.pull(None, tmp_path / "x")
    commit_step(store, tmp_path, 1)
    commit_step(store, tmp_path, 2)
    assert json.loads((store.pull(None, tmp_path / "y") / MANIFEST_NAME).read_text())["step"] == 2


def test_listing_thousands_of_checkpoints_reads_manifests_only(tmp_path):
    store = CheckpointStore(f"memory://many-{os.getpid()}-{tmp_path.name}/run")
    folder = tmp_path / "one"
    folder.mkdir()
    make_payload(folder, 0, sizes={"state.pt": 64})
    for step in range(1500):
        CommitWriter(store).write_checkpoint(step, folder, reason="steps", framework="test")
    opened = []
    real_open, real_cat_file = store.fs.open, store.fs.cat_file
    store.fs.open = lambda path, *a, **k: opened.append(path) or real_open(path, *a, **k)
    store.fs.cat_file = lambda path, *a, **k: opened.append(path) or real_cat_file(path, *a, **k)
    try:
        infos = store.committed()
        latest = store.latest()
    finally:
        del store.fs.open, store.fs.cat_file
    assert len(infos) == 1500 and [i.step for i in infos] == sorted(i.step for i in infos)
    assert latest.step == 1499
    assert all(p.endswith(MANIFEST_NAME) for p in opened)


KILL_CHILD = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from spot_callbacks import CheckpointStore
    from spot_callbacks.persist import Persister, PersistJob

    url, options, src = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    store = CheckpointStore(url, storage_options=options)
    persister = Persister(store, keep_last=1)
    real_upload = persister.writer.upload_file
    def upload_then_hang(local, step, name, *rest, **options):
        if name == "b.bin":
            store.fs.makedirs(store.step_path(step), exist_ok=True)
            with store.fs.open(store.step_path(step) + "/b.bin", "wb") as out:
                out.write(Path(local).read_bytes()[:1000])
                out.flush()
                print("MID-UPLOAD", flush=True)
                sys.stdin.read()  # the parent kills us here, mid-transfer
        return real_upload(local, step, name, *rest, **options)
    persister.writer.upload_file = upload_then_hang
    persister.submit(PersistJob(step=2, reason="interval", framework="test", local_dir=src, owns_local_dir=False))
    persister.wait()
    """
)


@pytest.mark.parametrize("store_url", ["file", "s3", "az", "gs"], indirect=True)  # memory:// is per-process
def test_persister_killed_mid_upload_leaves_previous_latest_intact(store, store_url, tmp_path):
    commit_step(store, tmp_path, 1)
    src = tmp_path / "next"
    src.mkdir()
    make_payload(src, 2, sizes={"a.bin": 5000, "b.bin": 200_000})
    child = subprocess.Popen(
        [sys.executable, "-c", KILL_CHILD, store_url.url, json.dumps(store_url.storage_options), str(src)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "MID-UPLOAD"
    finally:
        child.kill()
        child.wait()
    assert store.latest().step == 1 and store.verify(1)
    assert [i.step for i in store.committed()] == [1]


def test_s3_uploads_hold_a_bounded_number_of_parts_in_ram_unless_the_user_says_otherwise():
    # s3fs's default (10 parts of 50 MiB in flight per file, each held twice) costs ~1 GB of RAM
    # per file uploading, on top of the staged checkpoint (benchmarks/sharded.py measured it).
    from spot_callbacks.store import S3_UPLOAD_CONCURRENCY

    assert CheckpointStore("s3://bucket/run", storage_options={"anon": True}).fs.max_concurrency == (
        S3_UPLOAD_CONCURRENCY
    )
    chosen = CheckpointStore("s3://bucket/run", storage_options={"anon": True, "max_concurrency": 16})
    assert chosen.fs.max_concurrency == 16


# ----------------------------------------------------------------- the protocol's rules, one by one
# store/commit.py, store/manifest.py, store/layout.py and store/transfer.py on their own, against
# real file:// and memory:// stores (no server needed).
LOCAL_BACKENDS = ["file", "memory"]


@pytest.mark.parametrize("store_url", LOCAL_BACKENDS, indirect=True)
def test_payload_lands_uncommitted_and_the_manifest_is_written_last(store, tmp_path):
    commit_step(store, tmp_path, 8)  # a stale checkpoint of the same step: rewritten below
    seen_during_upload = []
    writer = CommitWriter(store)
    real_upload = writer.upload_file

    def upload_and_look(local, step, name, *rest, **options):
        sent = real_upload(local, step, name, *rest, **options)
        seen_during_upload.append([info.step for info in store.committed()])
        return sent

    writer.upload_file = upload_and_look
    source = tmp_path / "again"
    contents = make_payload(source, 808)
    info = writer.write_checkpoint(8, source, reason="steps", framework="test")
    assert seen_during_upload == [[], []]  # the stale manifest went first; the new one comes last
    assert [i.step for i in store.committed()] == [8] and info.metrics["upload_s"] >= 0
    assert {name: (store.pull(8, tmp_path / "out") / name).read_bytes() for name in contents} == contents


@pytest.mark.parametrize("store_url", LOCAL_BACKENDS, indirect=True)
def test_commit_refuses_a_manifest_a_reader_would_refuse_and_writes_nothing(store, tmp_path):
    manifest = new_manifest(3, {"state.pt": FileDigest(1, "xxh3_64:00")}, reason="end", framework="test")
    with pytest.raises(ManifestError, match="format_version 99"):
        CommitWriter(store).commit_manifest({**manifest, "format_version": 99})
    with pytest.raises(ManifestError, match="not a plain relative path"):
        CommitWriter(store).commit_manifest(
            {**manifest, "files": {"../x": {"size": 1, "checksum": "xxh3_64:00"}}}
        )
    assert store.step_folders() == {} and store.committed() == []
    with pytest.raises(ValueError, match="reason='later' is not one of"):
        new_manifest(3, {}, reason="later", framework="test")


@pytest.mark.parametrize("store_url", LOCAL_BACKENDS, indirect=True)
def test_clearing_a_step_removes_an_uncommitted_folder_and_keeps_the_others(store, tmp_path):
    commit_step(store, tmp_path, 1)
    writer = CommitWriter(store)
    writer.upload_file(make_payload_file(tmp_path), 2, "state.pt")  # abandoned upload: no manifest
    assert set(store.step_folders()) == {1, 2}
    writer.begin(2)
    writer.begin(3)  # nothing there: nothing to do
    assert set(store.step_folders()) == {1} and store.verify(1)
    with pytest.raises(ValueError, match="keep_last=-1 must be >= 0"):
        store.prune(-1)


def make_payload_file(tmp_path: Path) -> Path:
    path = tmp_path / "one-file" / "state.pt"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(b"payload")
    return path


@pytest.mark.parametrize("store_url", LOCAL_BACKENDS, indirect=True)
def test_settle_commit_prunes_after_a_commit_but_never_for_an_emergency(store, tmp_path, caplog):
    infos = [commit_step(store, tmp_path, step)[0] for step in (1, 2, 3)]
    writer = CommitWriter(store)
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        writer.settle(infos[-1], keep_last=1, deadline=time.time() - 5)  # an emergency, late
    assert [i.step for i in store.committed()] == [1, 2, 3]  # an emergency spends nothing on deletes
    assert any("step 3 committed" in r.message and "after its deadline" in r.message for r in caplog.records)

    store.step_folders = lambda: (_ for _ in ()).throw(ConnectionError("store unreachable"))
    try:
        with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
            writer.settle(infos[-1], keep_last=1, deadline=None)  # never fails the commit
    finally:
        del store.step_folders
    assert any("retention in" in r.message and "store unreachable" in r.message for r in caplog.records)
    writer.settle(infos[-1], keep_last=1, deadline=None)
    assert [i.step for i in store.committed()] == [3]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"step": 6}, "says step 6 but lies in the folder of step 5"),
        ({"format_version": 0}, "no valid format_version"),
        ({"files": []}, "no 'files' table"),
        ({"files": {"a.bin": {"size": True, "checksum": "xxh3_64:00"}}}, "bad entry for 'a.bin'"),
        ({"files": {"a.bin": {"size": -1, "checksum": "xxh3_64:00"}}}, "bad entry for 'a.bin'"),
        ({"files": {"a.bin": {"size": 1, "checksum": "md5:00"}}}, "checksum of 'a.bin' is of kind 'md5'"),
        (
            {"files": {"a.bin": {"size": 1, "checksum": "xxh3_64-parts-1024:00"}}},
            "part size 1024 is outside",
        ),
        (
            {"files": {"a.bin": {"size": 1, "checksum": "xxh3_64-parts-0x100000:00"}}},
            "is not a whole number of bytes",
        ),
        ({"files": {MANIFEST_NAME: {"size": 1, "checksum": "xxh3_64:00"}}}, "not a plain relative path"),
        ({"created": "yesterday"}, "no valid 'created' time"),
    ],
)
def test_every_field_of_an_untrusted_manifest_is_checked(change, message):
    doc = new_manifest_doc(5)
    with pytest.raises(ManifestError, match=message):
        parse_manifest(encode_manifest({**doc, **change}), 5, "memory:///run/step-000000005")
    naive = parse_manifest(encode_manifest({**doc, "created": "2024-01-02T03:04:05"}), 5, "memory:///x")
    parted = {"a.bin": {"size": 1, "checksum": "xxh3_64-parts-33554432:00"}}
    assert (
        parse_manifest(encode_manifest({**doc, "files": parted}), 5, "memory:///x").files["a.bin"].size == 1
    )
    assert naive.created.tzinfo == timezone.utc  # a time without a zone is read as UTC


def new_manifest_doc(step: int) -> dict:

    return new_manifest(step, {"a.bin": FileDigest(1, "xxh3_64:00")}, reason="steps", framework="test")


def test_urls_keep_the_protocol_the_user_wrote():
    fs, root, protocol = open_filesystem(
        "az://container/run/", {"account_name": "devstoreaccount1", "anon": True}
    )
    assert (root, protocol) == ("container/run", "az")  # adlfs calls itself abfs
    assert url_of(fs, posixpath.join(root, step_dirname(4)), protocol) == "az://container/run/step-000000004"
    fs, root, protocol = open_filesystem("gcs://bucket/run", {"token": "anon"})
    assert url_of(fs, root, protocol) == "gcs://bucket/run"
    fs, root, protocol = open_filesystem("/tmp/some/run", None)
    assert protocol is None and url_of(fs, root, protocol) == "file:///tmp/some/run"


def test_a_failed_pull_keeps_the_previous_local_copy_and_leaves_no_staging(tmp_path):
    dest = tmp_path / "pulled"
    dest.mkdir()
    (dest / "old.bin").write_bytes(b"old")
    with pytest.raises(ConnectionError), staged_folder(dest) as staging:
        (staging / "new.bin").write_bytes(b"half")
        raise ConnectionError("reset mid-pull")
    assert [p.name for p in tmp_path.iterdir()] == ["pulled"] and (dest / "old.bin").read_bytes() == b"old"


def test_local_writes_are_atomic_and_leave_no_temporaries(tmp_path):
    fs = fsspec.filesystem("file")
    source = make_payload_file(tmp_path)
    put_file(fs, str(source), str(tmp_path / "run" / "deep" / "state.pt"))
    put_bytes(fs, str(tmp_path / "run" / MANIFEST_NAME), b"{}")
    assert sorted(p.relative_to(tmp_path / "run").as_posix() for p in (tmp_path / "run").rglob("*")) == [
        "deep", "deep/state.pt", MANIFEST_NAME,
    ]  # fmt: skip
    with pytest.raises(FileNotFoundError):
        put_file(fs, str(tmp_path / "missing"), str(tmp_path / "run" / "x.bin"))
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".")]


def test_a_hung_attempt_is_abandoned_and_retried(caplog):
    attempts = []
    release = threading.Event()

    def hangs_once():
        attempts.append(1)
        if len(attempts) == 1:
            release.wait(10)
        return "done"

    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        assert call_in_time(FAST_RETRY, hangs_once, 0.2, "upload x") == "done"
    release.set()
    assert len(attempts) == 2
    assert any("upload x did not finish within 0.2s" in r.getMessage() for r in caplog.records)
