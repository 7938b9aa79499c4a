"""A large object as concurrent ranged GETs: each range written at its offset as it arrives, every byte
hashed (xxh3) in order in the same pass, the ranges in memory bounded by the transfer budget.

One connection seldom carries a link's full rate (S3 serves ~100-200 MB/s per connection; a
Python server one core's worth), so a file of several chunks is fetched as ranges in parallel.
A range that arrives before the ones ahead of it is written at once and kept until the hash
reaches it. Every range in flight or waiting holds one permit of a semaphore the data plane
shares among all the files it moves (its transfer budget in chunks), which bounds memory
whatever the number of files and the order of arrival; a file waits for a permit only when it
has no range of its own left, so each file keeps moving and none can starve the hash of another.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from typing import Any

import xxhash

from spot_callbacks.store.checksums import CHECKSUM_ALGORITHM, FileDigest
from spot_callbacks.store.clients.streams import Deadline
from spot_callbacks.store.meter import Moved, ignore_moved
from spot_callbacks.store.transfer import open_new_temporary

FetchRange = Callable[[int, int], Any]  # (start, end exclusive) -> bytes-like
_POLL_S = 1.0  # how often a wait for ranges looks at the attempt's deadline
MAX_WINDOW = 8  # ranges of one file in flight or waiting for the hash, at most


def ranged_to_file(
    fetch: FetchRange,
    total: int,
    local_path: str,
    *,
    chunk: int,
    permits: threading.Semaphore,
    pool: Executor,
    deadline: Deadline,
    what: str,
    moved: Moved = ignore_moved,
) -> FileDigest:
    """Write the object of ``total`` bytes to ``local_path`` through a new temporary beside it,
    renamed once complete; nothing is left on failure. ``permits`` (one per ``chunk`` of the
    transfer budget, shared by every file in flight) bounds the ranges held in memory.

    Example:
        >>> import tempfile
        >>> from concurrent.futures import ThreadPoolExecutor
        >>> data, path = bytes(range(256)) * 40, os.path.join(tempfile.mkdtemp(), "a.bin")
        >>> with ThreadPoolExecutor(4) as pool:
        ...     digest = ranged_to_file(lambda s, e: data[s:e], len(data), path, chunk=1000,
        ...                             permits=threading.Semaphore(3), pool=pool, deadline=Deadline(None), what="get")
        >>> digest.size, open(path, "rb").read() == data
        (10240, True)
    """
    folder, base = os.path.split(local_path)
    partial, handle = open_new_temporary(folder or ".", base, ".part")
    try:
        with handle:
            descriptor = handle.fileno()
            os.ftruncate(descriptor, total)
            digest = _fetch_in_order(
                fetch, total, chunk, permits, pool, deadline, what,
                lambda offset, view: _pwrite(descriptor, view, offset), moved,
            )  # fmt: skip
        os.replace(partial, local_path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise
    return digest


def ranged_digest(
    fetch: FetchRange,
    total: int,
    *,
    chunk: int,
    permits: threading.Semaphore,
    pool: Executor,
    deadline: Deadline,
    what: str,
    moved: Moved = ignore_moved,
) -> FileDigest:
    """The digest of the object of ``total`` bytes, read as ranges (a verify: nothing is written)."""
    return _fetch_in_order(fetch, total, chunk, permits, pool, deadline, what, None, moved)


def _fetch_in_order(
    fetch: FetchRange,
    total: int,
    chunk: int,
    permits: threading.Semaphore,
    pool: Executor,
    deadline: Deadline,
    what: str,
    write: Callable[[int, memoryview], None] | None,
    moved: Moved,
) -> FileDigest:
    hasher = xxhash.xxh3_64()
    spans = [(start, min(start + chunk, total)) for start in range(0, total, chunk)]
    asked = 0
    arrived: dict[int, memoryview] = {}  # start -> bytes written, not yet hashed
    in_flight: dict[Future[Any], tuple[int, int]] = {}
    hashed = held = 0
    try:
        while True:
            while hashed in arrived:  # the hash moves forward over every range that arrived in order
                view = arrived.pop(hashed)
                hasher.update(view)
                hashed += view.nbytes
                permits.release()
                held -= 1
            while (
                asked < len(spans)
                and len(in_flight) + len(arrived) < MAX_WINDOW
                and _take(permits, idle=not (in_flight or arrived), deadline=deadline, what=what)
            ):
                held += 1
                in_flight[pool.submit(fetch, *spans[asked])] = spans[asked]
                asked += 1
            if not in_flight:
                break
            done, _ = wait(in_flight, timeout=_POLL_S, return_when=FIRST_COMPLETED)
            deadline.check(what)
            for future in done:
                start, end = in_flight.pop(future)
                view = memoryview(future.result()).cast("B")
                if view.nbytes != end - start:  # a short answer: the object changed, or the connection lied
                    raise ConnectionError(
                        f"{what}: bytes {start}-{end} came back as {view.nbytes} bytes; retrying"
                    )
                if write is not None:
                    write(start, view)
                moved(view.nbytes)
                arrived[start] = view
    finally:
        for future in in_flight:
            future.cancel()  # queued ranges never start; running ones finish and are dropped
        for _ in range(held):
            permits.release()
    if hashed != total:
        raise ConnectionError(f"{what}: {hashed} of {total} bytes arrived; retrying")
    return FileDigest(total, f"{CHECKSUM_ALGORITHM}:{hasher.hexdigest()}")


def _take(permits: threading.Semaphore, *, idle: bool, deadline: Deadline, what: str) -> bool:
    """One permit for one more range: waited for when this file has nothing in flight (it cannot
    progress otherwise), else only if free now (the ranges it has keep it moving)."""
    if not idle:
        return permits.acquire(blocking=False)
    while not permits.acquire(timeout=_POLL_S):
        deadline.check(what)
    return True


def _pwrite(descriptor: int, view: memoryview, offset: int) -> None:
    while view.nbytes:
        written = os.pwrite(descriptor, view, offset)
        view, offset = view[written:], offset + written
