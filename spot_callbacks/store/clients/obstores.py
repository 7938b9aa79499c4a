"""obstore (Rust's object_store): streamed GETs bounded by the manifest, its client options, its errors.

A pull takes every size from the manifest, never from the server: no HEAD is sent, and a GET whose
answer disagrees with the manifest (another ``Content-Length``, a wrong ``Content-Range``, a body
longer or shorter than promised, a body that trickles below the slowest allowed speed) is damage
at once (:class:`~spot_callbacks.errors.CorruptCheckpointError`, never retried), so a resume falls
back to the previous checkpoint. Nothing a server says can make the reader allocate or write past
the manifest's size.

Every request is bounded: a read timeout (a stall; the store's ``read_timeout``, else
:data:`DEFAULT_READ_TIMEOUT_S` like s3fs) and a whole-request deadline from its size
(:func:`request_deadline_s`). Segment threads are daemons: no thread of the data plane keeps the
process from exiting.

obstore's errors are told as the builtin classes fsspec's backends raise (a missing object is a
:class:`FileNotFoundError`, a refusal a :class:`PermissionError`) in one line each, so retries
(:mod:`~spot_callbacks.store.retry`) and diagnosis lines do not change with the client.
"""

from __future__ import annotations

import importlib.util
import math
import mmap
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import spot_callbacks.settings as settings
from spot_callbacks.errors import CheckpointError, ConfigError, CorruptCheckpointError
from spot_callbacks.store.checksums import CHECKSUM_ALGORITHM, FileDigest, StreamHash
from spot_callbacks.store.clients.base import PULL_STREAMS, MiB, TransferBudget
from spot_callbacks.store.clients.streams import (
    Deadline,
    pwrite_all,
    write_through_temporary,
)
from spot_callbacks.store.meter import Moved, ignore_moved

OBSTORE_PACKAGE = "obstore"
# object_store's own retries run inside one attempt of the store's RetryPolicy: keep them few.
OBSTORE_RETRIES = 2
# A stall (no byte for this long) ends a request; s3fs' own default.
DEFAULT_READ_TIMEOUT_S = 15.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0
# A file is split into at most this many streamed segments, each at least $SPOT_PULL_SEGMENT_MB: as many
# as the pull has streams. On a link of ~100 MB/s per connection one large file then fills 8 (was 4:
# 1 GiB through a 25 MB/s-per-connection, 400 MB/s link took 97 MB/s at 4, 184 at 8, boto3 318; the
# same on loopback, 451 vs 460 MB/s, 1.73 vs 1.69 CPU-s/GB; 2 loaded cores, 2026-12-06).
MAX_SEGMENTS = PULL_STREAMS
SHORTEST_DEADLINE_S = 16.0
UNKNOWN_SIZE_DEADLINE_S = 24 * 3600.0
_POLL_S = 0.5
StoreFor = Callable[[float], Any]  # a request's whole deadline in seconds -> an obstore store


class WrongRegionError(ConfigError):
    """The store answered with a redirect: the bucket lives in another region (``region``, where the
    answer said which). A configuration error: permanent, never retried.

    Example:
        >>> str(WrongRegionError("s3://b/k", "eu-west-3"))
        "the bucket 'b' is in region 'eu-west-3', not the one the client asked (s3://b/k). Fix: set storage_options client_kwargs={'region_name': 'eu-west-3'} (or AWS_DEFAULT_REGION=eu-west-3)"
    """

    def __init__(self, url: str, region: str | None) -> None:
        bucket = url.split("://", 1)[-1].split("/", 1)[0]
        if region:
            cause = f"the bucket {bucket!r} is in region {region!r}, not the one the client asked ({url})"
            fix = f"client_kwargs={{'region_name': {region!r}}} (or AWS_DEFAULT_REGION={region})"
        else:
            cause = f"the bucket {bucket!r} is in another region than the client asked ({url})"
            fix = "client_kwargs={'region_name': <the bucket's region>} (or AWS_DEFAULT_REGION)"
        super().__init__(f"{cause}. Fix: set storage_options {fix}")
        self.url, self.region = url, region


class TransferCancelled(CheckpointError):
    """A segment stopped because another part of the same file failed (never shown: that failure is)."""


def request_deadline_s(nbytes: int, read_timeout_s: float, environ: Any = None) -> float:
    """How long one GET of ``nbytes`` may take whole: the read timeout plus the bytes at the slowest
    speed that counts as progress (``$SPOT_UPLOAD_MIN_MBPS``), rounded up to a power of two seconds
    (so a plane keeps a few clients, not one per size).

    Example:
        >>> request_deadline_s(1000, 15.0, {}), request_deadline_s(256 * MiB, 15.0, {})
        (16.0, 128.0)
    """
    need = read_timeout_s + nbytes / (settings.UPLOAD_MIN_MBPS.value(environ) * 1e6)
    return max(SHORTEST_DEADLINE_S, float(2 ** math.ceil(math.log2(max(need, 1.0)))))


def segment_bytes(environ: Any = None) -> int:
    """``$SPOT_PULL_SEGMENT_MB`` in bytes: the smallest segment a pulled file is split into."""
    return int(settings.PULL_SEGMENT_MB.value(environ)) * MiB


class ObstoreReader:
    """Pulls and deep-verify reads through obstore, every size from the manifest.

    A file is one streamed GET, written and hashed (xxh3) as it arrives; a file of two segments or
    more (``$SPOT_PULL_SEGMENT_MB``, default 128 MiB) is fetched as up to :data:`MAX_SEGMENTS`
    streamed GETs at once, but only while streams are free: at most
    :data:`~spot_callbacks.store.clients.base.PULL_STREAMS` run at once, all files together, each
    holding at most two chunks, so memory stays within the transfer budget whatever the files.
    The first segment is hashed as it arrives and each other one from the page cache once it is
    whole, while later ones still arrive (memory maps of :data:`HASH_WINDOW_BYTES`: no copy). On a link without per-connection caps one stream per file is as fast;
    on a cloud link (about 100 MB/s per connection) segments fill it.

    Example:
        >>> ObstoreReader(TransferBudget()).segments_for(1024 * MiB, free=8), ObstoreReader(TransferBudget()).segments_for(1000, free=8)
        (8, 1)
    """

    def __init__(self, budget: TransferBudget, read_timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> None:
        self._budget = budget
        self.read_timeout_s = read_timeout_s
        self._streams = threading.BoundedSemaphore(PULL_STREAMS)

    def segments_for(self, size: int, free: int) -> int:
        """How many segments a file of ``size`` bytes is fetched in when ``free`` more streams may start."""
        return max(1, min(MAX_SEGMENTS, size // segment_bytes(), 1 + free))

    def download(
        self,
        stores: StoreFor,
        key: str,
        url: str,
        local_path: str,
        timeout_s: float | None,
        expected_size: int | None,
        moved: Moved = ignore_moved,
        checksum_kind: str = CHECKSUM_ALGORITHM,
    ) -> FileDigest:
        """Write the object to ``local_path`` (through a new temporary beside it, renamed once whole);
        return its digest of ``checksum_kind``."""
        what, deadline = f"download {url}", Deadline(timeout_s)
        return write_through_temporary(
            local_path,
            lambda partial, handle: self._fetch(
                stores, key, url, expected_size, partial, handle, deadline, what, moved, checksum_kind
            ),
        )

    def digest(
        self,
        stores: StoreFor,
        key: str,
        url: str,
        timeout_s: float | None,
        expected_size: int | None,
        moved: Moved = ignore_moved,
        checksum_kind: str = CHECKSUM_ALGORITHM,
    ) -> FileDigest:
        """The digest of every byte of the object (a deep verify: one streamed GET, nothing written)."""
        what, deadline = f"read {url}", Deadline(timeout_s)
        hasher = StreamHash(checksum_kind)
        self._take_stream(deadline, what)
        try:
            size = self._stream(
                stores, key, url, (0, expected_size), expected_size, None, hasher,
                threading.Event(), [], deadline, what, moved,
            )  # fmt: skip
        finally:
            self._streams.release()
        return FileDigest(size, hasher.checksum())

    # ------------------------------------------------------------------ one file
    def _fetch(
        self,
        stores: StoreFor,
        key: str,
        url: str,
        size: int | None,
        partial: str,
        handle: Any,
        deadline: Deadline,
        what: str,
        moved: Moved,
        checksum_kind: str,
    ) -> FileDigest:
        hasher = StreamHash(checksum_kind)
        descriptor = handle.fileno()

        def write_at(offset: int, view: memoryview) -> None:
            pwrite_all(descriptor, view, offset)

        self._take_stream(deadline, what)
        extra = 0
        try:
            wanted = 1 if size is None else self.segments_for(size, free=MAX_SEGMENTS - 1)
            while extra < wanted - 1 and self._streams.acquire(blocking=False):
                extra += 1
            if size is None or extra == 0:
                got = self._stream(
                    stores, key, url, (0, size), size, write_at, hasher,
                    threading.Event(), [], deadline, what, moved,
                )  # fmt: skip
                return FileDigest(got, hasher.checksum())
            spans = _spans(size, 1 + extra)
            while extra > len(spans) - 1:  # fewer spans than streams taken (MiB boundaries)
                self._streams.release()
                extra -= 1
            os.ftruncate(descriptor, size)
            stop, errors = threading.Event(), list[BaseException]()
            threads = []
            for span in spans[1:]:
                thread = threading.Thread(
                    target=self._segment, name="spot-segment", daemon=True,
                    args=(stores, key, url, span, size, partial, stop, errors, deadline, what, moved),
                )  # fmt: skip
                extra -= 1  # the thread releases its stream when it ends
                thread.start()
                threads.append(thread)
            try:
                self._stream(
                    stores, key, url, spans[0], size, write_at, hasher,
                    stop, errors, deadline, what, moved,
                )  # fmt: skip
                reader = os.open(
                    partial, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
                )
                try:
                    # Each segment is hashed from the page cache as soon as it is whole, while the
                    # later ones still arrive (not all of them after the last one ends).
                    for thread, (start, end) in zip(threads, spans[1:], strict=True):
                        while thread.is_alive() and not errors:
                            thread.join(_POLL_S)
                            deadline.check(what)
                        if errors:
                            raise errors[0]
                        _hash_region(reader, start, end, hasher)
                finally:
                    os.close(reader)
            except BaseException:
                stop.set()
                raise
            return FileDigest(size, hasher.checksum())
        finally:
            for _ in range(1 + extra):
                self._streams.release()

    def _segment(
        self,
        stores: StoreFor,
        key: str,
        url: str,
        span: tuple[int, int],
        size: int,
        partial: str,
        stop: threading.Event,
        errors: list[BaseException],
        deadline: Deadline,
        what: str,
        moved: Moved,
    ) -> None:
        """One segment in its own daemon thread, written through its own descriptor (a late one,
        after the file failed, writes only to the removed temporary)."""
        try:
            descriptor = os.open(
                partial, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
            )
            try:
                self._stream(
                    stores, key, url, span, size, lambda offset, view: pwrite_all(descriptor, view, offset),
                    None, stop, errors, deadline, what, moved,
                )  # fmt: skip
            finally:
                os.close(descriptor)
        except BaseException as err:  # noqa: BLE001 - handed to the file's own thread
            if not isinstance(err, TransferCancelled):
                errors.append(err)
            stop.set()
        finally:
            self._streams.release()

    def _stream(
        self,
        stores: StoreFor,
        key: str,
        url: str,
        span: tuple[int, int | None],
        size: int | None,
        write: Callable[[int, memoryview], Any] | None,
        hasher: Any,
        stop: threading.Event,
        errors: list[BaseException],
        deadline: Deadline,
        what: str,
        moved: Moved,
    ) -> int:
        """Stream bytes ``span`` of the object (``size``: the manifest's; ``None``: unknown), checking
        every answer against it; return the bytes that arrived."""
        start, end = span
        # The size unknown (no manifest to bound it): the read timeout alone bounds a stall.
        budget_s = (
            UNKNOWN_SIZE_DEADLINE_S if end is None else request_deadline_s(end - start, self.read_timeout_s)
        )
        ranged = end is not None and (start, end) != (0, size)
        offset = start
        chunks = get_chunks(
            stores(budget_s), key, self._budget.stream_chunk_bytes(), url,
            span=(start, end) if ranged and end is not None else None, size=size, budget_s=budget_s,
        )  # fmt: skip
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            if end is not None and offset + view.nbytes > end:
                raise CorruptCheckpointError(
                    f"{url}: the store sent more than the {end - start} bytes asked for "
                    f"(bytes {start}-{end} of the manifest's {size}); the object is not the one committed"
                )
            if write is not None:
                write(offset, view)
            if hasher is not None:
                hasher.update(view)
            offset += view.nbytes
            moved(view.nbytes)
            if stop.is_set():
                raise errors[0] if errors else TransferCancelled(f"{what}: stopped")
            deadline.check(what)
        if end is not None and offset != end:
            raise CorruptCheckpointError(
                f"{url}: the store's answer ended after {offset - start} of the {end - start} bytes "
                f"asked for (the manifest says {size}); the object is not the one committed"
            )
        return offset - start

    def _take_stream(self, deadline: Deadline, what: str) -> None:
        while not self._streams.acquire(timeout=_POLL_S):
            deadline.check(what)


def _spans(size: int, count: int) -> list[tuple[int, int]]:
    """``count`` spans covering ``size`` bytes, each boundary on a MiB (memory maps start on pages).

    Example:
        >>> _spans(10 * MiB, 3)
        [(0, 4194304), (4194304, 8388608), (8388608, 10485760)]
    """
    step = -(-size // count // MiB) * MiB
    return [(start, min(start + step, size)) for start in range(0, size, step)]


# A mapped window's pages count in the process' RSS while it is mapped: 4 MiB, not 16, took a 1 GiB
# pull in 8 segments from 58-64 MB of peak extra RSS to 46-47 MB (raw obstore's one stream: 55) for
# the same CPU (0.70-0.92 vs 0.82-0.83 CPU-s/GB; loopback nanio, 2 loaded cores, 2026-12-06).
HASH_WINDOW_BYTES = 4 * MiB


def _hash_region(descriptor: int, start: int, end: int, hasher: Any) -> None:
    """Feed bytes ``start`` to ``end`` of the open file to ``hasher`` through memory maps (the page cache)."""
    for offset in range(start, end, HASH_WINDOW_BYTES):
        length = min(HASH_WINDOW_BYTES, end - offset)
        with mmap.mmap(descriptor, length, access=mmap.ACCESS_READ, offset=offset) as view:
            hasher.update(view)


def obstore_installed() -> bool:
    """Whether obstore can be imported (the ``[s3]``, ``[gcs]`` and ``[azure]`` extras install it)."""
    return importlib.util.find_spec(OBSTORE_PACKAGE) is not None


def client_options(
    *,
    http: bool,
    connect_timeout_s: float,
    read_timeout_s: float,
    verify: bool = True,
    total_timeout_s: float | None = None,
) -> dict[str, Any]:
    """obstore's HTTP client options: plain http only where the endpoint is, the store's timeouts
    (``total_timeout_s``: a whole request's deadline, :func:`request_deadline_s`).

    Example:
        >>> client_options(http=True, connect_timeout_s=10, read_timeout_s=60)["allow_http"]
        True
    """
    options: dict[str, Any] = {
        "connect_timeout": timedelta(seconds=connect_timeout_s),
        "read_timeout": timedelta(seconds=read_timeout_s),
        "timeout": timedelta(seconds=total_timeout_s or request_deadline_s(0, read_timeout_s)),
    }
    if http:
        options["allow_http"] = True
    if not verify:
        options["allow_invalid_certificates"] = True
    return options


def retry_config(total_timeout_s: float = 60.0, max_retries: int = OBSTORE_RETRIES) -> dict[str, Any]:
    """object_store's own retries (a 503 burst, a reset): few (the user's ``retries`` where set), and
    none once a request has used its whole deadline (a trickle that ran out of time is not asked
    again at the same rate)."""
    return {"max_retries": max_retries, "retry_timeout": timedelta(seconds=total_timeout_s)}


class StoreCache:
    """One obstore store per whole-request deadline (a few powers of two), built on first use.

    Example:
        >>> cache = StoreCache(lambda seconds: {"timeout": seconds})
        >>> cache(16.0) is cache(16.0), cache(32.0)
        (True, {'timeout': 32.0})
    """

    def __init__(self, build: Callable[[float], Any]) -> None:
        self._build = build
        self._stores: dict[float, Any] = {}
        self._lock = threading.Lock()

    def __call__(self, total_timeout_s: float) -> Any:
        with self._lock:
            store = self._stores.get(total_timeout_s)
        if store is None:
            store = self._build(total_timeout_s)
            with self._lock:
                store = self._stores.setdefault(total_timeout_s, store)
        return store


def get_chunks(
    store: Any,
    key: str,
    chunk_bytes: int,
    url: str,
    span: tuple[int, int] | None = None,
    size: int | None = None,
    budget_s: float | None = None,
) -> Iterator[Any]:
    """The object's bytes (``span``: only those, ``(start, end)``) as chunks of at least
    ``chunk_bytes``, from one streamed GET; errors translated. An answer whose size or range
    disagrees with ``size`` (the manifest's) is :class:`CorruptCheckpointError` before any byte."""
    import obstore

    began = time.monotonic()
    try:
        result = obstore.get(store, key, options={"range": span} if span else None)
        told = int(result.meta["size"])
        if size is not None and told != size:
            raise CorruptCheckpointError(
                f"{url}: the store says the object is {told} bytes, the manifest {size}; "
                "the object is not the one committed"
            )
        if span is not None and tuple(result.range) != tuple(span):
            raise CorruptCheckpointError(
                f"{url}: asked for bytes {span[0]}-{span[1]}, the store answered {result.range[0]}-"
                f"{result.range[1]} (a wrong Content-Range); the object is not the one committed"
            )
        yield from result.stream(min_chunk_size=chunk_bytes)
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - re-raised as the class fsspec would raise
        elapsed = time.monotonic() - began
        if budget_s is not None and elapsed >= budget_s * 0.9 and _timed_out(err):
            speed = settings.UPLOAD_MIN_MBPS
            raise CorruptCheckpointError(
                f"{url}: the store sent too little in {elapsed:.0f}s, below {speed.name}="
                f"{speed.value()} MB/s (a trickling or stalled server); not waited for longer. "
                f"Fix: lower {speed.name} for a link this slow"
            ) from err
        raise translated(err, url) from err


# Case-sensitive: the debug dumps carry "retry_timeout: 60s" in every error.
_TIMED_OUT = re.compile(r"[Tt]imed out|TimedOut|deadline has elapsed|\bTimeout\b")
_REGION = re.compile(r"(?:x-amz-bucket-region|Region|region)[\"':= ]+([a-z]{2}(?:-[a-z]+)+-\d)")
# object_store's own checks of a ranged answer (NotPartial: a 200 to a ranged GET; a wrong Content-Range).
_RANGE = re.compile(
    r"Content-Range|UnexpectedRange|unexpected range|non-partial response|NotPartial|Requested \d+\.\.\d+, got",
    re.IGNORECASE,
)
_REFUSED = re.compile(r"Connection refused|tcp connect error|ConnectError", re.IGNORECASE)
# AWS's answer to a request sent to another region than the bucket's (object_store does not follow it).
_REDIRECT = re.compile(
    r"PermanentRedirect|301 Moved Permanently|AuthorizationHeaderMalformed|Received redirect|redirect without LOCATION"
)
_STATUS = re.compile(r"\b(?:status|Status)(?: code)?:? (\d{3})\b|\b(\d{3}) [A-Z][a-z]+ [A-Z]?")


def _timed_out(error: BaseException) -> bool:
    return isinstance(error, TimeoutError) or bool(_TIMED_OUT.search(str(error)))


def translated(error: BaseException, url: str) -> BaseException:
    """obstore's ``error`` as the builtin class an fsspec backend raises for the same answer, in one
    line (object_store's errors are multi-line Rust debug dumps).

    Example:
        >>> class NotFoundError(Exception): ...
        >>> type(translated(NotFoundError("gone"), "s3://b/k")).__name__
        'FileNotFoundError'
        >>> class GenericError(Exception): ...
        >>> str(translated(GenericError("Generic S3 error: error sending request\\n\\nDebug source:\\nTimeout"), "s3://b/k"))
        's3://b/k: the store did not answer in time (Generic S3 error: error sending request)'
    """
    name = type(error).__name__
    text = str(error)
    first = next((line.strip() for line in text.splitlines() if line.strip()), name)[:200]
    if name == "NotFoundError" or isinstance(error, FileNotFoundError):
        return FileNotFoundError(f"{url}: not found ({first})")
    if name == "PermissionDeniedError":
        return PermissionError(f"{url}: AccessDenied: permission denied ({first})")
    if name == "UnauthenticatedError":
        return PermissionError(f"{url}: Unauthorized (the store refused the credentials): {first}")
    if name in ("InvalidPathError", "UnknownConfigurationKeyError", "NotSupportedError"):
        return ValueError(f"{url}: {first}")
    if _REDIRECT.search(text):
        region = _REGION.search(text)
        return WrongRegionError(url, region.group(1) if region else None)
    if _RANGE.search(text):
        return CorruptCheckpointError(
            f"{url}: the store answered other bytes than the range asked ({first}); "
            "the object is not the one committed"
        )
    if _REFUSED.search(text):
        return ConnectionRefusedError(f"{url}: Connection refused by the store's endpoint ({first})")
    if _timed_out(error):
        return TimeoutError(f"{url}: the store did not answer in time ({first})")
    status = _STATUS.search(text)
    code = int(status.group(1) or status.group(2)) if status else None
    if code == 403:
        return PermissionError(f"{url}: AccessDenied: permission denied ({first})")
    if code == 404:
        return FileNotFoundError(f"{url}: not found ({first})")
    if isinstance(error, OSError):
        return error
    return ConnectionError(f"{url}: {first}")
