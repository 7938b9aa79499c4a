"""The store a benchmark writes to: a moto S3 server on loopback (started and stopped here) or a local folder."""

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


def _stop(proc: subprocess.Popen[bytes]) -> None:
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
            _stop(proc)


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
