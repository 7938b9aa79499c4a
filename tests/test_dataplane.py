"""The data plane (store/dataplane.py, store/clients/): which client moves payload bytes, built from the
store's own fsspec options, and the store's reliability cases with that client moving the bytes.

Against moto on 127.0.0.1; faults are injected by wrapping the fast client's calls
(:class:`helpers.faultplane.FaultyPlane`, or the stream it reads), never by mocking the server.
"""

from __future__ import annotations

import logging
import os
import posixpath
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.faultfs import FaultyFileSystem
from helpers.faultplane import FaultyPlane
from helpers.reliability_counts import DAMAGED, FAULTS, record

import spot_callbacks.store.clients.obstores as obstore_calls
from spot_callbacks import CheckpointStore, SpotConfig, load_state
from spot_callbacks.engine import STATE_FILE, SpotEngine
from spot_callbacks.errors import AttemptTimeoutError, ConfigError, CorruptCheckpointError
from spot_callbacks.store import MANIFEST_NAME, step_dirname
from spot_callbacks.store.checkpoint_store import payload_plane
from spot_callbacks.store.clients.base import MiB, TransferBudget
from spot_callbacks.store.clients.s3 import S3Plane
from spot_callbacks.store.clients.streams import WRITE_PIECE_BYTES, Deadline, stream_to_file
from spot_callbacks.store.dataplane import FsspecPlane, select_data_plane, transfer_budget
from spot_callbacks.store.retry import RetryPolicy
from spot_callbacks.store.writer import CommitWriter

PATIENT_RETRY = RetryPolicy(attempts=10, initial_backoff_s=0.001, max_backoff_s=0.01)
FAST_RETRY = RetryPolicy(attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05)


def s3_url(server: Any, tmp_path: Path, name: str) -> str:
    return f"s3://{server.bucket}/{name}-{tmp_path.name}"


def payload_folder(tmp_path: Path, sizes: dict[str, int], seed: int = 0) -> dict[str, bytes]:
    generator = torch.Generator().manual_seed(seed)
    contents = {}
    for name, size in sizes.items():
        path = tmp_path / "src" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        contents[name] = (
            torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).numpy().tobytes()
        )
        path.write_bytes(contents[name])
    return contents


# ------------------------------------------------------------------ which client, from which options
def test_warming_builds_the_clients_a_pull_then_uses_and_nothing_for_a_replaced_filesystem(
    s3_server, tmp_path
):
    store = CheckpointStore(
        s3_url(s3_server, tmp_path, "warm"), storage_options=dict(s3_server.storage_options)
    )
    plane = store.data_plane
    assert isinstance(plane, S3Plane) and plane._manager is None and not plane._obstores  # nothing built yet
    warming = store.warm_data_plane()
    assert warming is not None
    warming.join(timeout=60)
    built = (plane._manager, dict(plane._obstores))
    assert built[0] is not None and list(built[1]) == [s3_server.bucket]
    payload_folder(tmp_path, {"state.pt": 3 * MiB})
    CommitWriter(store).write_checkpoint(1, tmp_path / "src", reason="manual", framework="test")
    store.pull(1, tmp_path / "pulled")
    assert (plane._manager, plane._obstores) == built  # the pull found them, built nothing again

    wrapped = CheckpointStore(str(tmp_path / "local"))
    wrapped.fs = FaultyFileSystem(wrapped.fs)
    assert wrapped.warm_data_plane() is None  # a replaced filesystem keeps every byte: nothing to warm


def test_an_s3_store_moves_payload_through_boto3_up_and_obstore_down_and_says_so_once(
    s3_server, tmp_path, caplog
):
    store = CheckpointStore(
        s3_url(s3_server, tmp_path, "fast"), storage_options=dict(s3_server.storage_options)
    )
    plane = store.data_plane
    assert isinstance(plane, S3Plane) and plane.pull_with == "obstore"
    # 40 MiB: a multipart upload of two 32 MiB parts; a nested name; an empty file.
    contents = payload_folder(tmp_path, {"state.pt": 40 * MiB, "extra/rng.bin": 1000, "empty.bin": 0})
    fsspec_calls: list[tuple[str, tuple]] = []
    for method in ("put_file", "get_file", "open"):  # fsspec sees the manifest, never a payload byte
        real = getattr(store.fs, method)
        spy = lambda *a, _real=real, _method=method, **k: fsspec_calls.append((_method, a)) or _real(*a, **k)  # noqa: E731
        setattr(store.fs, method, spy)
    try:
        with caplog.at_level(logging.INFO, logger="spot_callbacks"):
            CommitWriter(store).write_checkpoint(4, tmp_path / "src", reason="manual", framework="test")
            assert store.verify(4)
            pulled = store.pull(4, tmp_path / "pulled")
            CommitWriter(store).write_checkpoint(5, tmp_path / "src", reason="manual", framework="test")
    finally:
        del store.fs.put_file, store.fs.get_file, store.fs.open
    assert {name: (pulled / name).read_bytes() for name in contents} == contents
    assert not [call for call in fsspec_calls if any(name in str(call) for name in contents)]
    said = [r.getMessage() for r in caplog.records if "payload bytes of" in r.getMessage()]
    assert said == [
        f"spot_callbacks: payload bytes of {store.url} move through boto3 s3transfer (upload), obstore (pull); "
        "manifests, listings and deletes through fsspec"
    ]


def test_the_fast_clients_take_endpoint_and_credentials_from_the_environment_as_s3fs_does(s3_env, tmp_path):
    # No storage_options at all: AWS_ENDPOINT_URL and the keys come from the environment. A fast
    # client that read a configuration of its own would go to AWS, which is unreachable from here.
    store = CheckpointStore(s3_url(s3_env, tmp_path, "env"), retry=FAST_RETRY)
    assert isinstance(store.data_plane, S3Plane)
    contents = payload_folder(tmp_path, {"state.pt": 3 * MiB})
    CommitWriter(store).write_checkpoint(1, tmp_path / "src", reason="manual", framework="test")
    assert store.verify(1)
    assert (store.pull(1, tmp_path / "pulled") / "state.pt").read_bytes() == contents["state.pt"]


@pytest.mark.parametrize("choice", ["boto3", "obstore", "fsspec"])
def test_spot_data_plane_chooses_who_moves_the_bytes(choice, s3_server, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPOT_DATA_PLANE", choice)
    store = CheckpointStore(
        s3_url(s3_server, tmp_path, choice), storage_options=dict(s3_server.storage_options)
    )
    plane = store.data_plane
    if choice == "fsspec":
        assert isinstance(plane, FsspecPlane) and plane.reason == "SPOT_DATA_PLANE=fsspec"
    else:
        assert isinstance(plane, S3Plane) and plane.pull_with == choice
    contents = payload_folder(tmp_path, {"state.pt": 2 * MiB + 17, "b.bin": 5})
    with caplog.at_level(logging.INFO, logger="spot_callbacks"):
        CommitWriter(store).write_checkpoint(2, tmp_path / "src", reason="manual", framework="test")
    assert store.verify(2)
    pulled = store.pull(2, tmp_path / "pulled")
    assert {name: (pulled / name).read_bytes() for name in contents} == contents
    assert plane.name in caplog.text


def test_a_bad_spot_data_plane_or_buffer_is_an_error_naming_the_knob_and_the_choices(monkeypatch, tmp_path):
    monkeypatch.setenv("SPOT_DATA_PLANE", "fastest")
    with pytest.raises(
        ConfigError, match=r"SPOT_DATA_PLANE='fastest': expected 'auto' or 'fsspec' or 'boto3' or 'obstore'"
    ):
        CheckpointStore(str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"SPOT_TRANSFER_BUFFER_MB=1 is too small a buffer; .* >= 4"):
        transfer_budget({"SPOT_TRANSFER_BUFFER_MB": "1"})
    with pytest.raises(ConfigError, match=r"SPOT_TRANSFER_BUFFER_MB='lots' is not a positive whole number"):
        transfer_budget({"SPOT_TRANSFER_BUFFER_MB": "lots"})
    assert transfer_budget({"SPOT_TRANSFER_BUFFER_MB": "1024"}).stream_chunk_bytes() == MiB


def test_an_option_the_fast_client_cannot_honour_leaves_the_bytes_on_fsspec_and_says_why(
    s3_server, tmp_path, caplog
):
    import aiobotocore.session

    options = {**s3_server.storage_options, "session": aiobotocore.session.AioSession()}
    store = CheckpointStore(s3_url(s3_server, tmp_path, "own-session"), storage_options=options)
    assert isinstance(store.data_plane, FsspecPlane)
    assert "session=" in store.data_plane.reason and "cannot drive boto3" in store.data_plane.reason
    contents = payload_folder(tmp_path, {"state.pt": 1000})
    with caplog.at_level(logging.INFO, logger="spot_callbacks"):
        CommitWriter(store).write_checkpoint(1, tmp_path / "src", reason="manual", framework="test")
    assert (store.pull(1, tmp_path / "pulled") / "state.pt").read_bytes() == contents["state.pt"]
    assert (
        f"payload bytes of {store.url} move through fsspec (S3FileSystem) (storage_options session="
        in caplog.text
    )


def test_options_only_boto3_can_send_on_a_get_move_the_pulls_to_boto3(s3_server):
    import s3fs

    sse_c = {"SSECustomerAlgorithm": "AES256", "SSECustomerKey": "k" * 32}
    fs = s3fs.S3FileSystem(skip_instance_cache=True, s3_additional_kwargs=sse_c, **s3_server.storage_options)
    plane = S3Plane(fs, TransferBudget())
    assert (
        plane.pull_with == "boto3"
        and "SSECustomerAlgorithm, SSECustomerKey on every GET" in plane.pull_fallback_reason
    )
    unknown = s3fs.S3FileSystem(
        skip_instance_cache=True, s3_additional_kwargs={"Bogus": 1}, **s3_server.storage_options
    )
    assert "Bogus" in select_data_plane(unknown).reason


def test_a_filesystem_replaced_by_a_wrapper_keeps_the_wrapper_in_the_path(s3_server, tmp_path):
    store = CheckpointStore(
        s3_url(s3_server, tmp_path, "wrapped"), storage_options=dict(s3_server.storage_options)
    )
    store.fs = wrapper = FaultyFileSystem(store.fs)
    plane = payload_plane(store)
    assert isinstance(plane, FsspecPlane) and "replaced by a FaultyFileSystem" in plane.reason
    payload_folder(tmp_path, {"state.pt": 100})
    CommitWriter(store).write_checkpoint(1, tmp_path / "src", reason="manual", framework="test")
    assert ("put_file", posixpath.join(store.step_path(1), "state.pt")) in wrapper.calls


# ------------------------------------------------------------------ reliability, the fast client moving the bytes
def test_with_30_percent_transient_failures_of_the_fast_client_every_checkpoint_lands(s3_server, tmp_path):
    url, options = s3_url(s3_server, tmp_path, "flaky"), dict(s3_server.storage_options)
    config = SpotConfig(dirpath=url, interval=None, preemption=[], keep_last=0, storage_options=options,
                        scratch_dir=str(tmp_path / "scratch"))  # fmt: skip
    engine = SpotEngine(config, "test")
    assert isinstance(engine.store.data_plane, S3Plane)
    faulty = FaultyPlane(engine.store.data_plane, failure_rate=0.3, seed=3)
    engine.store.data_plane, engine.store.retry = faulty, PATIENT_RETRY
    engine.start()
    weights = torch.zeros(64)
    for step in range(1, 9):
        weights += 1
        engine.save_state(step=step, epoch=0, state={"w": weights}, reason="steps")
        assert engine.wait_for_commit(timeout=120)
        assert engine.new_failures() == []
    engine.finish()
    uploads = faulty.injected
    # Pulls and deep verifies through the same faulty fast client.
    reader = CheckpointStore(url, storage_options=options, retry=PATIENT_RETRY)
    reader.data_plane = FaultyPlane(reader.data_plane, failure_rate=0.3, seed=4)
    assert [info.step for info in reader.committed()] == list(range(1, 9))
    assert all(reader.verify(step) for step in range(1, 9))
    pulled = reader.pull(8, tmp_path / "pulled")
    assert torch.equal(load_state(pulled / STATE_FILE)["w"], weights)
    assert uploads >= 3 and reader.data_plane.injected >= 3
    assert {op for op, _ in faulty.calls} == {"upload"}
    record(FAULTS, uploads + reader.data_plane.injected)


def test_a_hung_fast_upload_times_out_is_retried_and_its_late_write_changes_nothing(
    s3_server, tmp_path, monkeypatch, caplog
):
    url, options = s3_url(s3_server, tmp_path, "hung"), dict(s3_server.storage_options)
    monkeypatch.setenv("SPOT_UPLOAD_TIMEOUT_S", "2")
    config = SpotConfig(dirpath=url, interval=None, preemption=[], storage_options=options,
                        scratch_dir=str(tmp_path / "scratch"))  # fmt: skip
    engine = SpotEngine(config, "test")
    faulty = FaultyPlane(engine.store.data_plane)
    faulty.gate, faulty.gate_only, faulty.hang_first = threading.Event(), STATE_FILE, 1
    engine.store.data_plane = faulty
    engine.store.retry = RetryPolicy(attempts=5, initial_backoff_s=0.01, max_backoff_s=0.05)
    weights = torch.arange(5000, dtype=torch.float32)
    engine.start()
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        engine.save_state(step=1, epoch=0, state={"w": weights}, reason="steps")
        assert engine.wait_for_commit(timeout=120)
    store = CheckpointStore(url, storage_options=options)
    try:
        assert engine.new_failures() == []
        assert faulty.held.is_set() and faulty.injected == 1
        retried = [r.getMessage() for r in caplog.records if "did not finish within 2.0s" in r.getMessage()]
        assert retried and "attempt 1 of 5" in retried[0] and step_dirname(1) in retried[0]
        assert store.latest().step == 1 and store.verify(1)
        manifest = store.fs.cat_file(posixpath.join(store.step_path(1), MANIFEST_NAME))
    finally:
        faulty.gate.set()  # the abandoned attempt wakes up and uploads through s3transfer, after the commit
    assert faulty.held_writes_done.wait(timeout=60)
    for attempt in [t for t in threading.enumerate() if t.name == "spot-attempt"]:
        attempt.join(timeout=60)
    engine.finish()
    assert store.fs.cat_file(posixpath.join(store.step_path(1), MANIFEST_NAME)) == manifest
    assert store.verify(1)
    assert torch.equal(load_state(store.pull(1, tmp_path / "pulled") / STATE_FILE)["w"], weights)
    record(FAULTS, faulty.injected)


class LostManifestAnswer(FaultyFileSystem):
    """Writes the manifest, then raises as if the answer never came back."""

    def pipe_file(self, path: str, value: bytes, *args: Any, **kwargs: Any) -> Any:
        self.inner.pipe_file(path, value, *args, **kwargs)
        if path.endswith(MANIFEST_NAME):
            self.injected += 1
            raise ConnectionError(f"injected: the answer to writing {path} was lost")


def test_a_lost_manifest_answer_is_read_back_while_the_fast_client_moves_the_payload(
    s3_server, tmp_path, caplog
):
    store = CheckpointStore(s3_url(s3_server, tmp_path, "lost"), storage_options=dict(s3_server.storage_options),
                            retry=FAST_RETRY)  # fmt: skip
    fast = FaultyPlane(store.data_plane)  # counts; injects nothing
    store.fs = lost = LostManifestAnswer(store.fs)
    store.data_plane = fast
    payload_folder(tmp_path, {"state.pt": 4000})
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        CommitWriter(store).write_checkpoint(3, tmp_path / "src", reason="interval", framework="test")
    assert store.latest().step == 3 and lost.injected >= 1
    assert "is committed" in caplog.text
    assert fast.calls == [("upload", posixpath.join(store.step_path(3), "state.pt"))]
    record(FAULTS, lost.injected)


def breaking_once(monkeypatch: pytest.MonkeyPatch, at_offset: int) -> list[str]:
    """Make the one streamed GET whose bytes start at ``at_offset`` break after its first chunk, once."""
    real_get_chunks, broken = obstore_calls.get_chunks, []

    def breaks_once(*args: Any, **kwargs: Any) -> Any:
        span = kwargs.get("span") or (0, None)
        for chunk in real_get_chunks(*args, **kwargs):
            yield chunk
            if span[0] == at_offset and not broken:
                broken.append(f"bytes from {span[0]}")
                raise ConnectionResetError("injected: connection reset by peer after the first chunk")

    monkeypatch.setattr(obstore_calls, "get_chunks", breaks_once)
    return broken


@pytest.mark.parametrize("how", ["stream", "segments"])
def test_a_transfer_broken_mid_file_is_retried_and_leaves_no_partial_file(
    how, s3_server, tmp_path, monkeypatch
):
    monkeypatch.setenv("SPOT_TRANSFER_BUFFER_MB", "4")  # 1 MiB chunks
    monkeypatch.setenv("SPOT_PULL_SEGMENT_MB", "1")  # 5 MiB: four segments of 2, 2, 1 MiB and 5 bytes
    store = CheckpointStore(s3_url(s3_server, tmp_path, f"broken-{how}"), storage_options=dict(s3_server.storage_options),
                            retry=FAST_RETRY)  # fmt: skip
    size = MiB + MiB // 2 if how == "stream" else 5 * MiB + 5
    contents = payload_folder(tmp_path, {"state.pt": size})
    CommitWriter(store).write_checkpoint(1, tmp_path / "src", reason="manual", framework="test")
    broken = breaking_once(monkeypatch, 0 if how == "stream" else 2 * MiB)
    pulled = store.pull(1, tmp_path / "out" / "pulled")
    assert broken and (pulled / "state.pt").read_bytes() == contents["state.pt"]
    assert sorted(os.listdir(tmp_path / "out")) == ["pulled"]
    assert sorted(os.listdir(pulled)) == [MANIFEST_NAME, "state.pt"]
    if how == "stream":
        broken.clear()
        assert store.verify(1) and broken  # the deep verify's read is broken once too, and retried
    record(FAULTS, 2 if how == "stream" else 1)


@pytest.mark.parametrize("segment_mb", ["128", "1"], ids=["streamed", "segments"])
def test_pulled_bytes_reach_the_disk_in_writes_of_a_quarter_mib_at_most(
    segment_mb, s3_server, tmp_path, monkeypatch
):
    """The kernel sizes a page-cache folio after the write: 1 MiB writes take 1 MiB blocks of fresh
    memory, which a VM that hands free memory back to its host faults in again (3x the CPU)."""
    monkeypatch.setenv("SPOT_TRANSFER_BUFFER_MB", "4")  # the stream's chunks are 1 MiB
    monkeypatch.setenv("SPOT_PULL_SEGMENT_MB", segment_mb)  # 1: two segments of 2 MiB and 1 MiB + 5
    store = CheckpointStore(s3_url(s3_server, tmp_path, f"pieces-{segment_mb}"),
                            storage_options=dict(s3_server.storage_options), retry=FAST_RETRY)  # fmt: skip
    size = 3 * MiB + 5
    contents = payload_folder(tmp_path, {"state.pt": size})
    CommitWriter(store).write_checkpoint(1, tmp_path / "src", reason="manual", framework="test")
    real_pwrite, writes = os.pwrite, list[int]()

    def counted(descriptor: int, data: Any, offset: int) -> int:
        writes.append(memoryview(data).nbytes)
        return real_pwrite(descriptor, data, offset)

    monkeypatch.setattr(os, "pwrite", counted)
    pulled = store.pull(1, tmp_path / "out" / "pulled")
    assert (pulled / "state.pt").read_bytes() == contents["state.pt"]
    assert sum(writes) == size  # every payload byte went through the pieces
    assert max(writes) <= WRITE_PIECE_BYTES < MiB


def test_streams_in_flight_never_pass_the_budget_and_segments_take_only_free_streams(
    s3_server, tmp_path, monkeypatch
):
    from spot_callbacks.store.clients.base import PULL_STREAMS

    monkeypatch.setenv("SPOT_TRANSFER_BUFFER_MB", "4")
    monkeypatch.setenv("SPOT_PULL_SEGMENT_MB", "1")  # every 4 MiB file would like four segments
    store = CheckpointStore(s3_url(s3_server, tmp_path, "streams"), storage_options=dict(s3_server.storage_options),
                            retry=FAST_RETRY)  # fmt: skip
    contents = payload_folder(tmp_path, {f"f{index}.bin": 4 * MiB + index for index in range(12)})
    CommitWriter(store).write_checkpoint(1, tmp_path / "src", reason="manual", framework="test")
    real_get_chunks, lock, now, most, spans = obstore_calls.get_chunks, threading.Lock(), [0], [0], []

    def counted(*args: Any, **kwargs: Any) -> Any:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
            spans.append(kwargs.get("span"))
        try:
            yield from real_get_chunks(*args, **kwargs)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(obstore_calls, "get_chunks", counted)
    pulled = store.pull(1, tmp_path / "pulled")
    assert {name: (pulled / name).read_bytes() for name in contents} == contents
    assert 1 <= most[0] <= PULL_STREAMS
    assert any(span is not None for span in spans)  # some file was split while streams were free


class CountingStreams:
    """A stand-in for the reader's stream semaphore that counts the streams held."""

    def __init__(self, streams: int) -> None:
        self._inner = threading.BoundedSemaphore(streams)
        self._lock = threading.Lock()
        self.held = 0

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        got = self._inner.acquire(blocking, timeout)
        if got:
            with self._lock:
                self.held += 1
        return got

    def release(self) -> None:
        with self._lock:
            self.held -= 1
        self._inner.release()


def test_a_file_cut_into_fewer_spans_than_streams_free_holds_only_the_streams_it_uses(
    s3_server, tmp_path, monkeypatch
):
    from spot_callbacks.store.clients.base import PULL_STREAMS

    monkeypatch.setenv("SPOT_PULL_SEGMENT_MB", "1")
    # 9 MiB + 1 byte would like 8 segments; on MiB boundaries that is 5 spans of 2 MiB (the last 1 MiB + 1).
    store = CheckpointStore(s3_url(s3_server, tmp_path, "surplus"), storage_options=dict(s3_server.storage_options),
                            retry=FAST_RETRY)  # fmt: skip
    contents = payload_folder(tmp_path, {"state.pt": 9 * MiB + 1})
    CommitWriter(store).write_checkpoint(1, tmp_path / "src", reason="manual", framework="test")
    plane = payload_plane(store)
    assert isinstance(plane, S3Plane)
    streams = plane._reader._streams = CountingStreams(PULL_STREAMS)  # type: ignore[assignment]
    real_get_chunks, spans, held = obstore_calls.get_chunks, [], []

    def seen(*args: Any, **kwargs: Any) -> Any:
        spans.append(kwargs.get("span"))
        held.append(streams.held)  # the streams the pull holds while its segments are asked
        yield from real_get_chunks(*args, **kwargs)

    monkeypatch.setattr(obstore_calls, "get_chunks", seen)
    pulled = store.pull(1, tmp_path / "pulled")
    assert (pulled / "state.pt").read_bytes() == contents["state.pt"]
    assert len(spans) == 5 and max(held) == 5 and streams.held == 0


def test_a_streamed_attempt_past_its_time_stops_by_itself_and_removes_what_it_wrote(tmp_path):
    def chunks() -> Any:
        yield b"a" * 10
        yield b"b" * 10

    with pytest.raises(AttemptTimeoutError, match="download x ran past its -1.0s attempt timeout"):
        stream_to_file(chunks(), str(tmp_path / "x.bin"), Deadline(-1.0), "download x")
    assert os.listdir(tmp_path) == []
    digest = stream_to_file(chunks(), str(tmp_path / "x.bin"), Deadline(60), "download x")
    assert digest.size == 20 and (tmp_path / "x.bin").read_bytes() == b"a" * 10 + b"b" * 10
    assert os.listdir(tmp_path) == ["x.bin"]


@pytest.mark.parametrize("segment_mb", ["128", "1"], ids=["streamed", "segments"])
def test_damaged_and_missing_payloads_are_caught_by_the_fast_pull_and_the_deep_verify(
    segment_mb, s3_server, tmp_path, monkeypatch
):
    monkeypatch.setenv("SPOT_PULL_SEGMENT_MB", segment_mb)  # 1: the 2 MiB file in two segments
    store = CheckpointStore(s3_url(s3_server, tmp_path, f"damage-{segment_mb}"), storage_options=dict(s3_server.storage_options),
                            retry=FAST_RETRY)  # fmt: skip
    contents = payload_folder(tmp_path, {"state.pt": 2 * MiB, "extra.bin": 100})
    CommitWriter(store).write_checkpoint(1, tmp_path / "src", reason="manual", framework="test")
    remote = posixpath.join(store.step_path(1), "state.pt")
    flipped = bytearray(contents["state.pt"])
    flipped[MiB] ^= 0xFF  # same size: only the checksum can tell
    store.fs.pipe_file(remote, bytes(flipped))
    with pytest.raises(CorruptCheckpointError, match="does not match its manifest"):
        store.verify(1)
    with pytest.raises(CorruptCheckpointError, match="downloaded as .* the manifest says"):
        store.pull(1, tmp_path / "pulled")
    assert not (tmp_path / "pulled").exists()
    store.fs.rm(posixpath.join(store.step_path(1), "extra.bin"))
    with pytest.raises(FileNotFoundError):
        store.data_plane.download(
            posixpath.join(store.step_path(1), "extra.bin"), str(tmp_path / "e.bin"), 30.0, 100
        )
    assert not (tmp_path / "e.bin").exists()
    record(DAMAGED, 2)


# ------------------------------------------------------------------ az://: obstore both ways, on Azurite
def az_url(server: Any, tmp_path: Path, name: str) -> str:
    return f"az://{server.bucket}/{name}-{tmp_path.name}"


def test_an_az_store_moves_payload_through_obstore_both_ways(azurite_server, tmp_path, caplog):
    from spot_callbacks.store.clients.azure import AzurePlane

    store = CheckpointStore(
        az_url(azurite_server, tmp_path, "fast"), storage_options=dict(azurite_server.storage_options)
    )
    assert isinstance(store.data_plane, AzurePlane)
    # 20 MiB: a multipart put and one streamed GET; a nested name; an empty file.
    contents = payload_folder(tmp_path, {"state.pt": 20 * MiB + 3, "extra/rng.bin": 1000, "empty.bin": 0})
    fsspec_calls: list[tuple[str, tuple]] = []
    for method in ("put_file", "get_file", "open"):
        real = getattr(store.fs, method)
        spy = lambda *a, _real=real, _method=method, **k: fsspec_calls.append((_method, a)) or _real(*a, **k)  # noqa: E731
        setattr(store.fs, method, spy)
    try:
        with caplog.at_level(logging.INFO, logger="spot_callbacks"):
            CommitWriter(store).write_checkpoint(4, tmp_path / "src", reason="manual", framework="test")
            assert store.verify(4)
            pulled = store.pull(4, tmp_path / "pulled")
    finally:
        del store.fs.put_file, store.fs.get_file, store.fs.open
    assert {name: (pulled / name).read_bytes() for name in contents} == contents
    assert not [call for call in fsspec_calls if any(name in str(call) for name in contents)]
    assert f"payload bytes of {store.url} move through obstore (upload and pull)" in caplog.text


def test_the_azure_client_takes_the_connection_string_from_the_environment_as_adlfs_does(az_env, tmp_path):
    from spot_callbacks.store.clients.azure import AzurePlane

    store = CheckpointStore(az_url(az_env, tmp_path, "env"), retry=FAST_RETRY)
    assert isinstance(store.data_plane, AzurePlane)
    contents = payload_folder(tmp_path, {"state.pt": 2 * MiB})
    CommitWriter(store).write_checkpoint(1, tmp_path / "src", reason="manual", framework="test")
    assert store.verify(1)
    assert (store.pull(1, tmp_path / "pulled") / "state.pt").read_bytes() == contents["state.pt"]


def test_with_30_percent_transient_failures_of_the_azure_client_every_checkpoint_lands(
    azurite_server, tmp_path, monkeypatch
):
    monkeypatch.setenv("SPOT_TRANSFER_BUFFER_MB", "4")  # 1 MiB chunks
    monkeypatch.setenv("SPOT_PULL_SEGMENT_MB", "1")  # the 3 MiB file comes in three segments
    url, options = az_url(azurite_server, tmp_path, "flaky"), dict(azurite_server.storage_options)
    store = CheckpointStore(url, storage_options=options, retry=PATIENT_RETRY)
    faulty = FaultyPlane(store.data_plane, failure_rate=0.3, seed=5)
    store.data_plane = faulty
    contents = {}
    for step in range(1, 6):
        contents[step] = payload_folder(tmp_path / f"s{step}", {"state.pt": 3 * MiB, "b.bin": 10}, seed=step)
        CommitWriter(store).write_checkpoint(
            step, tmp_path / f"s{step}" / "src", reason="steps", framework="test"
        )
    broken = breaking_once(monkeypatch, MiB)
    assert [info.step for info in store.committed()] == [1, 2, 3, 4, 5]
    assert all(store.verify(step) for step in range(1, 6))
    pulled = store.pull(5, tmp_path / "pulled")
    assert {name: (pulled / name).read_bytes() for name in contents[5]} == contents[5]
    assert faulty.injected >= 3 and broken == [f"bytes from {MiB}"]
    record(FAULTS, faulty.injected + 1)


def test_gcs_payload_stays_on_gcsfs_and_the_log_says_why(gcs_server, tmp_path, caplog):
    store = CheckpointStore(
        f"gs://{gcs_server.bucket}/plane-{tmp_path.name}", storage_options=dict(gcs_server.storage_options)
    )
    assert isinstance(store.data_plane, FsspecPlane)
    contents = payload_folder(tmp_path, {"state.pt": 3000})
    with caplog.at_level(logging.INFO, logger="spot_callbacks"):
        CommitWriter(store).write_checkpoint(1, tmp_path / "src", reason="manual", framework="test")
    assert (store.pull(1, tmp_path / "pulled") / "state.pt").read_bytes() == contents["state.pt"]
    assert "move through fsspec (GCSFileSystem) (no faster client is verified for gs:// yet)" in caplog.text
