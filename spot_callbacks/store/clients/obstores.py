"""obstore (Rust's object_store): one streamed GET per file, its client options, its errors as fsspec's.

obstore speaks S3, GCS and Azure. Its errors are told as the builtin classes fsspec's backends
raise (a missing object is a :class:`FileNotFoundError`, a refusal a :class:`PermissionError`), so
retries (:mod:`~spot_callbacks.store.retry`) and diagnosis lines do not change with the client.
"""

from __future__ import annotations

import functools
import importlib.util
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from spot_callbacks.store.checksums import FileDigest
from spot_callbacks.store.clients.base import TransferBudget
from spot_callbacks.store.clients.ranged import ranged_digest, ranged_to_file
from spot_callbacks.store.clients.streams import Deadline, digest_stream, stream_to_file
from spot_callbacks.store.meter import Moved, ignore_moved

OBSTORE_PACKAGE = "obstore"
# object_store's own retries run inside one attempt of the store's RetryPolicy: keep them few.
OBSTORE_RETRIES = 2
# A whole transfer may take long; a stall may not (read_timeout), and the attempt has its own limit.
WHOLE_REQUEST_TIMEOUT = timedelta(hours=24)
# Ranged GETs in flight at once, all files together. 8, not 16: on 2 cores against nanio, 16 threads
# moved no more bytes and held ~100 MB more resident (each thread allocates its ranges in its own
# malloc arena, and an arena keeps what it freed): 8 x 256 MiB pulled with 264-298 MB peak extra
# RSS instead of 356-390 MB, one 2 GiB file at 1.06x obstore instead of 0.61-0.86x.
RANGE_THREADS = 8


class ObstoreReader:
    """Pulls and deep-verify reads through obstore: a file of two ranges or more as concurrent ranged
    GETs (:mod:`~spot_callbacks.store.clients.ranged`), a smaller one as one streamed GET (one request,
    no HEAD); either way written as it arrives and hashed in the same pass, within ``budget``.

    Example:
        >>> ObstoreReader(TransferBudget()).ranged(64 * 1024 * 1024), ObstoreReader(TransferBudget()).ranged(1000)
        (True, False)
    """

    def __init__(self, budget: TransferBudget) -> None:
        self._budget = budget
        self._permits = threading.Semaphore(budget.range_permits())
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def download(
        self,
        store: Any,
        key: str,
        url: str,
        local_path: str,
        timeout_s: float | None,
        expected_size: int | None,
        moved: Moved = ignore_moved,
    ) -> FileDigest:
        what, deadline = f"download {url}", Deadline(timeout_s)
        if self.ranged(expected_size):
            fetch = functools.partial(get_range, store, key, url=url)
            return ranged_to_file(
                fetch, object_size(store, key, url), local_path, chunk=self._budget.range_bytes(),
                permits=self._permits, pool=self._ranges(), deadline=deadline, what=what, moved=moved,
            )  # fmt: skip
        chunks = get_chunks(store, key, self._budget.stream_chunk_bytes(), url)
        return stream_to_file(chunks, local_path, deadline, what, moved)

    def digest(
        self,
        store: Any,
        key: str,
        url: str,
        timeout_s: float | None,
        expected_size: int | None,
        moved: Moved = ignore_moved,
    ) -> FileDigest:
        what, deadline = f"read {url}", Deadline(timeout_s)
        if self.ranged(expected_size):
            fetch = functools.partial(get_range, store, key, url=url)
            return ranged_digest(
                fetch, object_size(store, key, url), chunk=self._budget.range_bytes(),
                permits=self._permits, pool=self._ranges(), deadline=deadline, what=what, moved=moved,
            )  # fmt: skip
        chunks = get_chunks(store, key, self._budget.stream_chunk_bytes(), url)
        return digest_stream(chunks, deadline, what, moved)

    def ranged(self, expected_size: int | None) -> bool:
        return expected_size is not None and expected_size >= 2 * self._budget.range_bytes()

    def _ranges(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=RANGE_THREADS, thread_name_prefix="spot-range")
            return self._pool


def obstore_installed() -> bool:
    """Whether obstore can be imported (the ``[s3]``, ``[gcs]`` and ``[azure]`` extras install it)."""
    return importlib.util.find_spec(OBSTORE_PACKAGE) is not None


def client_options(
    *, http: bool, connect_timeout_s: float, read_timeout_s: float, verify: bool = True
) -> dict[str, Any]:
    """obstore's HTTP client options: plain http only where the endpoint is, the store's timeouts.

    Example:
        >>> client_options(http=True, connect_timeout_s=10, read_timeout_s=60)["allow_http"]
        True
    """
    options: dict[str, Any] = {
        "connect_timeout": timedelta(seconds=connect_timeout_s),
        "read_timeout": timedelta(seconds=read_timeout_s),
        "timeout": WHOLE_REQUEST_TIMEOUT,
    }
    if http:
        options["allow_http"] = True
    if not verify:
        options["allow_invalid_certificates"] = True
    return options


def retry_config() -> dict[str, Any]:
    return {"max_retries": OBSTORE_RETRIES, "retry_timeout": timedelta(seconds=60)}


def get_chunks(store: Any, key: str, chunk_bytes: int, url: str) -> Iterator[Any]:
    """The object's bytes as chunks of at least ``chunk_bytes`` (one streamed GET), errors translated."""
    import obstore

    try:
        stream = obstore.get(store, key).stream(min_chunk_size=chunk_bytes)
        yield from stream
    except Exception as err:  # noqa: BLE001 - re-raised as the class fsspec would raise
        raise translated(err, url) from err


def object_size(store: Any, key: str, url: str) -> int:
    """The object's size in bytes (a HEAD), errors translated."""
    import obstore

    try:
        return int(obstore.head(store, key)["size"])
    except Exception as err:  # noqa: BLE001 - re-raised as the class fsspec would raise
        raise translated(err, url) from err


def get_range(store: Any, key: str, start: int, end: int, url: str) -> Any:
    """Bytes ``start`` to ``end`` (exclusive) of the object, errors translated."""
    import obstore

    try:
        return obstore.get_range(store, key, start=start, end=end)
    except Exception as err:  # noqa: BLE001 - re-raised as the class fsspec would raise
        raise translated(err, url) from err


def translated(error: BaseException, url: str) -> BaseException:
    """obstore's ``error`` as the builtin class an fsspec backend raises for the same answer.

    Example:
        >>> class NotFoundError(Exception): ...
        >>> type(translated(NotFoundError("gone"), "s3://b/k")).__name__
        'FileNotFoundError'
    """
    name = type(error).__name__
    if name == "NotFoundError":
        return FileNotFoundError(f"{url}: {error}")
    if name == "PermissionDeniedError":
        return PermissionError(f"{url}: AccessDenied: {error}")
    if name == "UnauthenticatedError":
        return PermissionError(f"{url}: Unauthorized (the store refused the credentials): {error}")
    if name in ("InvalidPathError", "UnknownConfigurationKeyError", "NotSupportedError"):
        return ValueError(f"{url}: {error}")
    return error
