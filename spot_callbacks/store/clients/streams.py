"""A stream of chunks to a local file, hashed (xxh3) as it arrives: one pass, no whole-object buffer.

The file is written beside its final name and renamed only once complete, so a retried download
never shares a file with the attempt it replaced, and an attempt past its time stops by itself
and removes what it wrote (a thread cannot be killed; this one notices).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from spot_callbacks.errors import AttemptTimeoutError
from spot_callbacks.store.checksums import (
    CHECKSUM_ALGORITHM,
    WRITE_PIECE_BYTES,
    FileDigest,
    StreamHash,
    write_in_pieces,
)
from spot_callbacks.store.meter import Moved, ignore_moved
from spot_callbacks.store.transfer import open_new_temporary

T = TypeVar("T")


class Deadline:
    """The moment a streamed attempt gives up by itself (``None``: never).

    Example:
        >>> Deadline(None).check("read x")
        >>> Deadline(-1.0).check("read x")
        Traceback (most recent call last):
        ...
        spot_callbacks.errors.AttemptTimeoutError: read x ran past its -1.0s attempt timeout; stopped
    """

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self._at = None if timeout_s is None else time.monotonic() + timeout_s

    def check(self, what: str) -> None:
        if self._at is not None and time.monotonic() > self._at:
            raise AttemptTimeoutError(f"{what} ran past its {self.timeout_s:.1f}s attempt timeout; stopped")


def stream_to_file(
    chunks: Iterable[Any], local_path: str, deadline: Deadline, what: str, moved: Moved = ignore_moved
) -> FileDigest:
    """Write ``chunks`` (bytes-like) to ``local_path`` through a new temporary beside it, hashing each
    chunk as it is written; rename when the stream ends. Nothing is left behind on failure.

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "a.bin")
        >>> stream_to_file([b"he", b"llo"], path, Deadline(None), "get a.bin").size, open(path, "rb").read()
        (5, b'hello')
    """
    return write_through_temporary(
        local_path,
        lambda partial, handle: _hash_chunks(
            chunks, deadline, what, lambda view: write_in_pieces(handle.write, view), moved
        ),
    )


def pwrite_all(descriptor: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset`` of the open file, at most :data:`WRITE_PIECE_BYTES` a call.

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "c.bin"); fd = os.open(path, os.O_RDWR | os.O_CREAT)
        >>> pwrite_all(fd, memoryview(b"hello"), 2); os.close(fd); open(path, "rb").read()
        b'\\x00\\x00hello'
    """
    while view.nbytes:
        written = os.pwrite(descriptor, view[:WRITE_PIECE_BYTES], offset)
        view, offset = view[written:], offset + written


def write_through_temporary(local_path: str, write: Callable[[str, Any], T]) -> T:
    """``write(partial_path, handle)`` into a new temporary beside ``local_path``, renamed over it once
    ``write`` returns; removed if it raises. ``write``'s value is returned.

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "b.bin")
        >>> write_through_temporary(path, lambda partial, handle: handle.write(b"ok")), open(path, "rb").read()
        (2, b'ok')
    """
    folder, base = os.path.split(local_path)
    os.makedirs(folder or ".", exist_ok=True)
    partial, handle = open_new_temporary(folder or ".", base, ".part")
    try:
        with handle:
            value = write(partial, handle)
        os.replace(partial, local_path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise
    return value


def digest_stream(
    chunks: Iterable[Any],
    deadline: Deadline,
    what: str,
    moved: Moved = ignore_moved,
    checksum_kind: str = CHECKSUM_ALGORITHM,
) -> FileDigest:
    """The digest of every byte in ``chunks`` (a verify's read: nothing is kept).

    Example:
        >>> digest_stream([b"hello"], Deadline(None), "read").size
        5
    """
    return _hash_chunks(chunks, deadline, what, None, moved, checksum_kind)


def _hash_chunks(
    chunks: Iterable[Any],
    deadline: Deadline,
    what: str,
    write: Any,
    moved: Moved,
    checksum_kind: str = CHECKSUM_ALGORITHM,
) -> FileDigest:
    hasher, size = StreamHash(checksum_kind), 0
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        hasher.update(view)
        if write is not None:
            write(view)
        size += view.nbytes
        moved(view.nbytes)
        deadline.check(what)
    return FileDigest(size, hasher.checksum())
