"""Files without a writer digest are hashed from the bytes the upload sends (store/clients/sent_digests.py).

On moto, through s3transfer's real multipart upload (parts made small so a test file has three):
the manifest holds each file's ``xxh3_64-parts-<P>`` checksum computed from the parts as they were
read for the wire, no second pass reads the file, a part sent twice (the connection dropped) still
gives the file's true checksum, and every reader (obstore's stream and segments, boto3, fsspec,
Azure, the deep verify, the kept local copy) checks that kind, and catches a changed byte.
"""

from __future__ import annotations

import json
import posixpath
import random
from pathlib import Path
from typing import Any

import pytest
import xxhash
from helpers.hostile import hostile_proxy

import spot_callbacks.store.clients.s3 as s3_plane
import spot_callbacks.store.transfer as transfer
from spot_callbacks import CheckpointStore
from spot_callbacks.errors import CorruptCheckpointError
from spot_callbacks.store import MANIFEST_NAME, step_dirname
from spot_callbacks.store.checksums import (
    FileDigest,
    StreamHash,
    digest_local_file,
    parts_kind,
)
from spot_callbacks.store.clients.base import MiB
from spot_callbacks.store.clients.sent_digests import SentParts
from spot_callbacks.store.retry import RetryPolicy
from spot_callbacks.store.writer import CommitWriter

PART = 5 * MiB  # S3's smallest part
FAST_RETRY = RetryPolicy(attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05)


def folder_of(tmp_path: Path, sizes: dict[str, int]) -> dict[str, bytes]:
    (tmp_path / "src").mkdir(exist_ok=True)
    contents = {name: random.Random(name).randbytes(size) for name, size in sizes.items()}
    for name, raw in contents.items():
        (tmp_path / "src" / name).write_bytes(raw)
    return contents


def manifest_files(store: CheckpointStore, step: int) -> dict[str, Any]:
    return json.loads(store.fs.cat_file(posixpath.join(store.step_path(step), MANIFEST_NAME)))["files"]


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3_plane, "UPLOAD_PART_BYTES", PART)


@pytest.fixture
def hash_passes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files the store hashed in a pass of their own (not from the upload's reads)."""
    passes: list[str] = []
    real = transfer.digest_mapped

    def counted(path: Any, *args: Any) -> FileDigest:
        passes.append(Path(path).name)
        return real(path, *args)

    monkeypatch.setattr(transfer, "digest_mapped", counted)
    return passes


def test_an_s3_upload_hashes_the_parts_it_sends_and_every_pull_checks_that_kind(
    s3_server, small_parts, hash_passes, tmp_path, monkeypatch
):
    url = f"s3://{s3_server.bucket}/sent-{tmp_path.name}"
    store = CheckpointStore(url, storage_options=dict(s3_server.storage_options), retry=FAST_RETRY)
    contents = folder_of(tmp_path, {"model.safetensors": 2 * PART + 12345, "config.json": 300})
    CommitWriter(store).write_checkpoint(3, tmp_path / "src", reason="manual", framework="test")
    assert hash_passes == []  # every digest came from the upload's own reads
    files = manifest_files(store, 3)
    big = tmp_path / "src" / "model.safetensors"
    assert files["model.safetensors"]["checksum"] == digest_local_file(big, parts_kind(PART)).checksum
    assert files["model.safetensors"]["checksum"].startswith("xxh3_64-parts-5242880:")
    # A file sent in one request has the plain kind: the same hash of the same bytes.
    assert files["config.json"]["checksum"] == "xxh3_64:" + xxhash.xxh3_64_hexdigest(contents["config.json"])

    assert store.verify(3, deep=True)
    monkeypatch.setenv("SPOT_PULL_SEGMENT_MB", "1")  # the big file in segments, hashed in order after
    pulled = store.pull(3, tmp_path / "segments")
    assert {name: (pulled / name).read_bytes() for name in contents} == contents
    monkeypatch.setenv("SPOT_PULL_SEGMENT_MB", "128")  # one stream
    pulled = CheckpointStore(url, storage_options=dict(s3_server.storage_options)).pull(
        3, tmp_path / "stream"
    )
    assert (pulled / "model.safetensors").read_bytes() == contents["model.safetensors"]
    # The kept copy is recognised as this checkpoint (its files checked in the manifest's kind).
    assert transfer.local_copy_matches(store.read_manifest(3), pulled)

    remote = posixpath.join(store.step_path(3), "model.safetensors")
    flipped = bytearray(contents["model.safetensors"])
    flipped[PART + 7] ^= 0x01  # same size, middle part: only the checksum can tell
    store.fs.pipe_file(remote, bytes(flipped))
    with pytest.raises(CorruptCheckpointError, match="does not match its manifest"):
        store.verify(3, deep=True)
    with pytest.raises(CorruptCheckpointError, match="the manifest says"):
        store.pull(3, tmp_path / "damaged")
    assert not transfer.local_copy_matches(store.read_manifest(3), _flip_local(pulled, PART + 7))


def _flip_local(folder: Path, index: int) -> Path:
    path = folder / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[index] ^= 0x01
    path.write_bytes(bytes(raw))
    return folder


@pytest.mark.parametrize("pull_with", ["boto3", "fsspec"])
def test_the_other_s3_readers_check_the_parts_kind_too(
    pull_with, s3_server, small_parts, tmp_path, monkeypatch
):
    url = f"s3://{s3_server.bucket}/{pull_with}-{tmp_path.name}"
    writer_store = CheckpointStore(url, storage_options=dict(s3_server.storage_options))
    contents = folder_of(tmp_path, {"model.safetensors": 2 * PART + 1})
    CommitWriter(writer_store).write_checkpoint(4, tmp_path / "src", reason="manual", framework="test")
    monkeypatch.setenv("SPOT_DATA_PLANE", pull_with)
    store = CheckpointStore(url, storage_options={**s3_server.storage_options, "skip_instance_cache": True})
    assert manifest_files(store, 4)["model.safetensors"]["checksum"].startswith("xxh3_64-parts-")
    assert store.verify(4, deep=True)
    pulled = store.pull(4, tmp_path / "pulled")
    assert (pulled / "model.safetensors").read_bytes() == contents["model.safetensors"]


def test_a_part_sent_twice_after_a_dropped_connection_still_gives_the_files_checksum(
    s3_server, small_parts, hash_passes, tmp_path
):
    contents = folder_of(tmp_path, {"model.safetensors": 3 * PART})
    name = f"retry-{tmp_path.name}"
    with hostile_proxy(s3_server.port, f"{step_dirname(5)}/model.safetensors", "reset-part") as proxy:
        options = {**s3_server.storage_options, "endpoint_url": proxy.url, "skip_instance_cache": True}
        store = CheckpointStore(f"s3://{s3_server.bucket}/{name}", storage_options=options)
        CommitWriter(store).write_checkpoint(5, tmp_path / "src", reason="manual", framework="test")
    part_two = [path for method, path, _ in proxy.seen if method == "PUT" and "partNumber=2" in path]
    assert proxy.answered["PUT"] == 1 and len(part_two) == 2  # dropped once, sent again
    assert hash_passes == []
    expected = StreamHash(parts_kind(PART)).fed(contents["model.safetensors"]).checksum()
    assert manifest_files(store, 5)["model.safetensors"]["checksum"] == expected


def test_parts_not_read_in_one_pass_each_leave_the_digest_to_a_pass_of_its_own():
    sent = SentParts(12)
    first, second = sent.part(0, 8), sent.part(8, 4)
    first.saw(0, b"abcd")
    first.saw(0, b"abcd")  # rewound to its start (a retry): begins again
    first.saw(4, b"efgh")
    second.saw(0, b"ijkl")
    assert sent.digest() is None  # part size 8 is below any store's part: not a kind a manifest may hold
    sent = SentParts(3 * MiB)
    parts = [sent.part(start, MiB) for start in (0, MiB, 2 * MiB)]
    block = bytes(range(256)) * 4096
    for part in parts:
        part.saw(0, block)
    assert sent.digest() == FileDigest(3 * MiB, StreamHash(parts_kind(MiB)).fed(block * 3).checksum())
    parts[1].saw(MiB // 2, block[:10])  # a read that skips ahead: that part is not known any more
    assert sent.digest() is None
    unfinished = SentParts(MiB)
    unfinished.part(0, MiB).saw(0, block[:100])
    assert unfinished.digest() is None


def test_an_upload_that_could_not_hash_what_it_sent_is_hashed_after_it(tmp_path, hash_passes):
    folder_of(tmp_path, {"a.bin": 1000, "b.bin": 10})

    def upload(local: Path, name: str, wants_digest: bool) -> FileDigest | None:
        return None  # a plane that hashes as it sends, whose reader was not the hashing one

    digests = transfer.upload_with_digests(
        upload, tmp_path / "src", ["a.bin", "b.bin"], hashes_as_it_sends=True
    )
    assert digests == {name: digest_local_file(tmp_path / "src" / name) for name in ("a.bin", "b.bin")}
    assert sorted(hash_passes) == ["a.bin", "b.bin"]


@pytest.mark.parametrize("backend", ["file", "az"])
def test_a_manifest_of_the_parts_kind_is_checked_by_the_file_and_azure_readers(backend, request, tmp_path):
    if backend == "file":
        url, options = (tmp_path / "store").as_uri(), {}
    else:
        server = request.getfixturevalue("azurite_server")
        url, options = f"az://{server.bucket}/parts-{tmp_path.name}", dict(server.storage_options)
    store = CheckpointStore(url, storage_options=options, retry=FAST_RETRY)
    contents = folder_of(tmp_path, {"state.pt": 2 * MiB + 5})
    digests = {"state.pt": digest_local_file(tmp_path / "src" / "state.pt", parts_kind(MiB))}
    CommitWriter(store).write_checkpoint(
        6, tmp_path / "src", reason="manual", framework="test", digests=digests
    )
    assert manifest_files(store, 6)["state.pt"]["checksum"] == digests["state.pt"].checksum
    assert store.verify(6, deep=True)
    assert (store.pull(6, tmp_path / "pulled") / "state.pt").read_bytes() == contents["state.pt"]
    flipped = bytearray(contents["state.pt"])
    flipped[-1] ^= 0x01
    store.fs.pipe_file(posixpath.join(store.step_path(6), "state.pt"), bytes(flipped))
    with pytest.raises(CorruptCheckpointError):
        store.verify(6, deep=True)
