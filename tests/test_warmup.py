"""Issue 28: a run's store builds its clients on a daemon thread from the engine's construction
(``store/warmup.py``); the first use waits for that build and never makes a second one, a store that
cannot be reached fails as it did without the warm-up, and a warm-up that hangs keeps no process alive."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiobotocore.session
import pytest

from spot_callbacks import SpotConfig
from spot_callbacks.engine import SpotEngine
from spot_callbacks.errors import StoreUnavailableError
from spot_callbacks.store import CheckpointStore
from spot_callbacks.store.preflight import probe_listings

REPO_ROOT = Path(__file__).resolve().parents[1]
CHILD_EXIT_BOUND_S = 60  # the hung credential lookup below waits 600 s: a correctness bound, not a benchmark


def _engine(dirpath: str, options: dict[str, Any], scratch: Path) -> SpotEngine:
    # skip_instance_cache: a filesystem of its own, not one an earlier test connected already
    config = SpotConfig(dirpath=dirpath, storage_options={**options, "skip_instance_cache": True},
                        scratch_dir=str(scratch), preemption=[], interval=None)  # fmt: skip
    return SpotEngine(config, framework="test")


@pytest.fixture
def client_builds(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[list[str], threading.Event]]:
    """Every aiobotocore client built from now on (the calling thread's name), each held until the
    returned event is set (the test sets it; 30 s at most, so a mistake fails instead of hanging)."""
    builds: list[str] = []
    release = threading.Event()
    create_client = aiobotocore.session.AioSession.create_client

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        builds.append(threading.current_thread().name)
        release.wait(30)
        return create_client(self, *args, **kwargs)

    monkeypatch.setattr(aiobotocore.session.AioSession, "create_client", counted)
    yield builds, release
    release.set()


def test_the_client_is_built_off_the_constructing_thread_and_once(s3_server, client_builds, tmp_path) -> None:
    builds, release = client_builds
    engine = _engine(f"s3://{s3_server.bucket}/{uuid.uuid4().hex}", dict(s3_server.storage_options), tmp_path)
    warm_up = engine.store.warm_up
    assert warm_up is not None
    # The constructor returned while the build it started is held: the build is not on this thread.
    assert not warm_up.client_built
    release.set()
    assert engine.pull_latest() is None  # the first use: it waited for the warm-up's client
    assert warm_up.client_built and len(builds) == 1
    engine.start()
    engine.save_state(1, 0, {"w": 1}, reason="steps")
    engine.finish()
    assert engine.store.latest().step == 1
    assert len(builds) == 1, builds  # the preflight, the lock, the upload and the commit: no second client
    assert engine.store.warm_data_plane() is warm_up.thread  # the data plane was warmed by it too


def test_a_local_store_starts_no_warm_up(tmp_path: Path) -> None:
    engine = SpotEngine(SpotConfig(dirpath=str(tmp_path / "run"), preemption=[], interval=None), "test")
    assert engine.store.warm_up is None
    memory = CheckpointStore(f"memory://{uuid.uuid4().hex}/run")
    assert memory.warm_data_plane() is None  # fsspec moves memory://'s bytes: no client, no thread
    assert memory.warm_up is None


def _refusal(store_or_engine: Any) -> tuple[str, str]:
    """The preflight's diagnosis of a store it refuses: (what failed and why, the fix), without the
    backend's own error and the seconds spent, which vary from one try to the next."""
    with pytest.raises(StoreUnavailableError) as info:
        if isinstance(store_or_engine, SpotEngine):
            store_or_engine.pull_latest()
        else:
            probe_listings(store_or_engine)
    message = str(info.value)
    return message.split(" (")[0], message.split("Fix: ")[1]


def test_an_endpoint_refusing_connections_fails_as_without_a_warm_up(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{probe.getsockname()[1]}"
    options = {"key": "k", "secret": "s", "endpoint_url": endpoint}
    engine = _engine("s3://bucket/run", options, tmp_path)
    assert engine.store.warm_up is not None
    with_warm_up = _refusal(engine)  # before the first step, as HF's latest() does it
    assert engine.store.warm_up.client_built
    without = _refusal(CheckpointStore("s3://bucket/run", {**options, "skip_instance_cache": True}))
    assert with_warm_up == without and "nothing accepts connections" in with_warm_up[0]


def test_a_client_that_cannot_be_built_fails_at_the_first_use_as_without_a_warm_up(
    s3_server, tmp_path: Path, caplog
) -> None:
    options = {**s3_server.storage_options, "client_kwargs": {"region_name": "no such region"}}
    with caplog.at_level("DEBUG", logger="spot_callbacks"):  # from before the warm-up starts
        engine = _engine(f"s3://{s3_server.bucket}/run", options, tmp_path)
        assert engine.store.warm_up is not None
        with_warm_up = _refusal(engine)
    without = _refusal(
        CheckpointStore(f"s3://{s3_server.bucket}/run", {**options, "skip_instance_cache": True})
    )
    assert with_warm_up == without and "InvalidRegionError" in with_warm_up[0]
    warm_lines = [r.getMessage() for r in caplog.records if "ahead failed" in r.getMessage()]
    assert warm_lines and all(s3_server.storage_options["secret"] not in line for line in warm_lines)


@pytest.fixture
def silent_metadata() -> Iterator[tuple[str, threading.Event]]:
    """An endpoint that accepts connections and never answers, and an event set at its first connection."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    connected = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(server.accept()[0])
                connected.set()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", connected
    finally:
        server.close()
        for conn in held:
            conn.close()


CHILD = textwrap.dedent(
    """
    import json, sys
    from spot_callbacks import SpotConfig
    from spot_callbacks.engine import SpotEngine
    config = SpotConfig(dirpath="s3://bucket/run", storage_options=json.loads(sys.argv[1]), preemption=[],
                        interval=None, scratch_dir=sys.argv[2])
    engine = SpotEngine(config, "test")
    print("constructed", engine.store.warm_up.client_built, flush=True)
    sys.stdin.readline()  # the test says when: with the warm-up stuck in its credential lookup
    print("exiting", engine.store.warm_up.client_built, flush=True)
    """
)


def test_a_process_exits_while_its_warm_up_is_stuck(silent_metadata, s3_server, tmp_path: Path) -> None:
    metadata_url, connected = silent_metadata
    # No credentials anywhere but the instance metadata service, which accepts and never answers: the
    # client's build waits on it (600 s, one attempt) on the warm-up's thread.
    env = {key: value for key, value in os.environ.items() if not key.startswith(("AWS_", "SPOT_"))}
    env.update({
        "HOME": str(tmp_path), "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_EC2_METADATA_SERVICE_ENDPOINT": metadata_url,
        "AWS_METADATA_SERVICE_TIMEOUT": "600", "AWS_METADATA_SERVICE_NUM_ATTEMPTS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]),
    })  # fmt: skip
    options = json.dumps({"endpoint_url": s3_server.endpoint_url})
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, options, str(tmp_path / "scratch")], env=env, cwd=tmp_path,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().split() == ["constructed", "False"]
        assert connected.wait(60), "the warm-up never asked the metadata service for credentials"
        child.stdin.write("go\n")
        child.stdin.flush()
        returncode = child.wait(CHILD_EXIT_BOUND_S)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    stdout, stderr = child.communicate()
    assert returncode == 0, stderr[-3000:]
    assert stdout.split() == ["exiting", "False"]  # it left with the build still waiting
