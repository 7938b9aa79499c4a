"""Fail fast: a store that cannot hold checkpoints is refused at start, on real servers and sockets.

Each misconfiguration ends as one :class:`StoreUnavailableError` naming the dirpath, within its bound
(asserted generously: a correctness bound, not a benchmark), with one log line at default level.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from spot_callbacks.errors import StoreUnavailableError, UnknownStoreError
from spot_callbacks.store import CheckpointStore
from spot_callbacks.store.backends import with_backend_defaults
from spot_callbacks.store.preflight import PROBE_PREFIX, preflight
from spot_callbacks.store.resolve import resolve_filesystem
from spot_callbacks.store.writer import CommitWriter

WRONG_AZURE_KEY = "d3Jvbmcta2V5LXdyb25nLWtleS13cm9uZy1rZXktd3Jvbmcta2V5LXdyb25nLWtleQ=="


def store_of(dirpath: str, options: dict | None = None) -> CheckpointStore:
    """A store whose filesystem has the backend defaults (what layout.open_filesystem will use)."""
    store = CheckpointStore(dirpath, storage_options=options)
    store.fs, _ = resolve_filesystem(dirpath, {**(options or {}), "skip_instance_cache": True})
    return store


def refused(dirpath: str, options: dict | None, bound_s: float, caplog: pytest.LogCaptureFixture) -> str:
    """Run the preflight, assert it raises within ``bound_s`` with one log line; return the message."""
    store = store_of(dirpath, options)
    caplog.clear()
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="spot_callbacks"), pytest.raises(StoreUnavailableError) as info:
        preflight(store)
    elapsed_s = time.monotonic() - started
    message = str(info.value)
    assert elapsed_s < bound_s, f"took {elapsed_s:.1f}s (bound {bound_s}s): {message}"
    assert f"dirpath={dirpath!r}" in message and "Fix:" in message and "\n" not in message
    lines = [r for r in caplog.records if r.name == "spot_callbacks" and r.levelno >= logging.INFO]
    assert [r.getMessage() for r in lines] == [f"spot_callbacks: {message}"]
    assert all(r.exc_info is None for r in lines)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    return message


@pytest.fixture
def silent_socket() -> Iterator[str]:
    """An endpoint that accepts TCP connections and never answers (the kernel's backlog accepts them)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in held:
            conn.close()
        server.close()


def closed_endpoint() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


# ----------------------------------------------------------------- resolving the filesystem
def test_an_unknown_protocol_names_dirpath_the_installed_backends_and_the_extra() -> None:
    with pytest.raises(UnknownStoreError) as info:
        resolve_filesystem("s4://b/run", None)
    message = str(info.value)
    assert "dirpath='s4://b/run'" in message and "'s4'" in message
    assert "s3" in message and "spot-callbacks[s3]" in message and "did you mean s3://" in message
    assert isinstance(info.value, ValueError)  # what fsspec raised before, still caught the same


def test_a_missing_backend_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import fsspec

    def no_package(protocol: str) -> type:
        raise ImportError("Install adlfs to access Azure Datalake Gen2 and Azure Blob Storage")

    monkeypatch.setattr(fsspec, "get_filesystem_class", no_package)
    with pytest.raises(UnknownStoreError, match=r"needs the package adlfs.*spot-callbacks\[azure\]"):
        resolve_filesystem("az://container/run", None)


def test_backend_defaults_never_override_what_the_user_set() -> None:
    user = {"config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 9}}, "key": "k"}
    options = with_backend_defaults("s3", user)
    assert options["config_kwargs"]["connect_timeout"] == 1
    assert options["config_kwargs"]["retries"] == {"max_attempts": 9}
    assert user["config_kwargs"] == {"connect_timeout": 1, "retries": {"max_attempts": 9}}  # not mutated
    assert with_backend_defaults("gs", {"retry_timeout": 30})["retry_timeout"] == 30
    assert with_backend_defaults(None, None) == {}


# ----------------------------------------------------------------- a usable store passes, owning only its probe
@pytest.mark.parametrize("backend", ["file", "memory", "s3", "az", "gs"])
def test_a_usable_store_passes_and_leaves_nothing_behind(backend: str, tmp_path: Path, request) -> None:
    if backend == "file":
        dirpath, options = str(tmp_path / "run"), {}
    elif backend == "memory":
        dirpath, options = f"memory://{uuid.uuid4().hex}/run", {}
    else:
        server = request.getfixturevalue(
            {"s3": "s3_server", "az": "azurite_server", "gs": "gcs_server"}[backend]
        )
        dirpath, options = f"{backend}://{server.bucket}/{uuid.uuid4().hex}", dict(server.storage_options)
    store = store_of(dirpath, options)
    CommitWriter(store).write_checkpoint(1, _payload(tmp_path), reason="manual", framework="test")
    before = sorted(store.fs.find(store.root))
    started = time.monotonic()
    preflight(store, budget_s=30)
    assert time.monotonic() - started < 10
    store.fs.invalidate_cache()
    assert sorted(store.fs.find(store.root)) == before
    assert not any(PROBE_PREFIX in path for path in before)


def test_the_opt_out_checks_nothing_and_says_so_loudly(monkeypatch, caplog) -> None:
    monkeypatch.setenv("SPOT_PREFLIGHT", "0")
    store = CheckpointStore("s3://no-such-bucket-anywhere/run", {"endpoint_url": closed_endpoint()})
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        preflight(store)
    assert any("NOT checking" in r.getMessage() and store.url in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------- each misconfiguration: the error, in time
def test_a_missing_s3_bucket_is_refused_at_once(s3_server, caplog) -> None:
    message = refused("s3://no-such-bucket-3f9/run", dict(s3_server.storage_options), 15, caplog)
    assert "bucket 'no-such-bucket-3f9' does not exist" in message and "create the bucket" in message


def test_a_missing_azure_container_and_a_missing_gcs_bucket_are_refused_at_once(
    azurite_server, gcs_server, caplog
) -> None:
    message = refused("az://no-such-container/run", dict(azurite_server.storage_options), 15, caplog)
    assert "container 'no-such-container' does not exist" in message
    message = refused("gs://no-such-bucket-7c1/run", dict(gcs_server.storage_options), 15, caplog)
    assert "bucket 'no-such-bucket-7c1' does not exist" in message


def test_a_wrong_azure_key_is_one_line_within_seconds(azurite_server, caplog) -> None:
    conn = azurite_server.connection_string.replace(_azurite_key(azurite_server), WRONG_AZURE_KEY)
    message = refused(f"az://{azurite_server.bucket}/run", {"connection_string": conn}, 15, caplog)
    assert "refused the credentials" in message and "account key, SAS token" in message
    assert "<?xml" not in message


def test_a_read_only_folder_is_refused_at_once(tmp_path: Path, caplog) -> None:
    folder = tmp_path / "readonly"
    folder.mkdir()
    with _read_only(folder) as read_only_folder:
        message = refused(str(read_only_folder / f"run-{uuid.uuid4().hex}"), None, 10, caplog)
    assert "permission denied" in message


def test_a_dirpath_under_a_file_is_refused_at_once(tmp_path: Path, caplog) -> None:
    (tmp_path / "a-file").write_text("x")
    message = refused(str(tmp_path / "a-file" / "run"), None, 10, caplog)
    assert "is a file, not a folder" in message


def test_an_s3_endpoint_refusing_connections_errors_within_30s(caplog) -> None:
    options = {"key": "k", "secret": "s", "endpoint_url": "http://127.0.0.1:1"}
    message = refused("s3://bucket/run", options, 40, caplog)
    assert "nothing accepts connections" in message and "endpoint_url" in message


def test_a_gcs_endpoint_not_listening_errors_within_60s(caplog) -> None:
    options = {"endpoint_url": closed_endpoint(), "token": "anon", "project": "test"}
    message = refused("gs://bucket/run", options, 75, caplog)
    assert "nothing accepts connections" in message


@pytest.mark.parametrize("backend", ["s3", "gs"])
def test_an_endpoint_that_accepts_and_never_answers_errors_within_the_budget(
    backend: str, silent_socket: str, monkeypatch, caplog
) -> None:
    monkeypatch.setenv("SPOT_PREFLIGHT_TIMEOUT_S", "20")  # the default 60 s works the same, slower
    options = {"endpoint_url": silent_socket}
    options.update({"key": "k", "secret": "s"} if backend == "s3" else {"token": "anon", "project": "test"})
    message = refused(f"{backend}://bucket/run", options, 35, caplog)
    assert "did not answer in time" in message or "still failing" in message
    assert "SPOT_CONNECT_TIMEOUT_S" in message  # nothing ever answered: the connect timeout is the knob


# ----------------------------------------------------------------- helpers
def _payload(tmp_path: Path) -> Path:
    folder = tmp_path / f"payload-{uuid.uuid4().hex[:6]}"
    folder.mkdir()
    (folder / "state.bin").write_bytes(b"weights")
    return folder


def _azurite_key(server) -> str:
    return server.connection_string.split("AccountKey=")[1].split(";")[0]


@contextlib.contextmanager
def _read_only(folder: Path) -> Iterator[Path]:
    """A folder nobody may create files in: ``folder`` made so by chmod for a normal user; root
    ignores modes, so for root ``folder`` made immutable instead, or, where root may not do that
    either (no CAP_LINUX_IMMUTABLE, e.g. in a container), sysfs, where even root cannot mkdir."""
    import os

    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield folder
        finally:
            folder.chmod(0o755)
        return
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)]).returncode != 0:
        yield Path("/sys/kernel")
        return
    try:
        yield folder
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
