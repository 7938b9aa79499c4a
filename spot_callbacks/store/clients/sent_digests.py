"""The digest of the bytes s3transfer reads to send a file: each part hashed on its way to the wire.

s3transfer's multipart upload sends a file's parts from several threads at once, each part read
from the file in order (128 KiB at a time) as its request body streams out. Hashing each read
while it is in the CPU's cache, a file the framework wrote itself (no writer digest) is read once,
not twice: uploading 8 x 128 MiB to a local S3 server cost 0.10 CPU-s per GiB more than with the
digests handed over, against 0.26 more with a memory-mapped pass beside the upload (one process, 7
interleaved repeats, 2 cores, 2026-12-07). The hash alone is 0.03 of that 0.10; the rest is the
GIL, which python-xxhash releases for every update, handed among 16 upload threads. The file's checksum is then of kind
``xxh3_64-parts-<part size>`` (:mod:`~spot_callbacks.store.checksums`); a file sent in one part
gets the plain ``xxh3_64``, which is the same hash of the same bytes.

A part whose reads were not one pass from its start (a retry rewinds to the start and begins
again; anything else) leaves the file's digest unknown, and so does a reader s3transfer built
some other way: the caller then hashes the file itself.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import xxhash
from s3transfer.utils import OSUtils, ReadFileChunk

from spot_callbacks.store.checksums import (
    CHECKSUM_ALGORITHM,
    MAX_PART_BYTES,
    MIN_PART_BYTES,
    FileDigest,
    combine_parts,
)


class _PartHash:
    """The xxh3 of one part's bytes, while they are read in one pass from the part's start."""

    def __init__(self, start: int, length: int) -> None:
        self.start, self.length = start, length
        self.hasher = xxhash.xxh3_64()
        self.hashed = 0
        self.broken = False

    def saw(self, position: int, data: bytes) -> None:
        if position != self.hashed or self.broken:
            if position != 0:
                self.broken = True
                return
            self.hasher.reset()  # a retry sends the part again from its start
            self.hashed, self.broken = 0, False
        self.hasher.update(data)
        self.hashed += len(data)

    @property
    def whole(self) -> bool:
        return not self.broken and self.hashed == self.length


class SentParts:
    """The parts of one upload of one file of ``size`` bytes, hashed as s3transfer reads them.

    Example:
        >>> sent = SentParts(5)
        >>> sent.part(0, 5).saw(0, b"hello")
        >>> sent.digest() == FileDigest(5, "xxh3_64:" + xxhash.xxh3_64_hexdigest(b"hello"))
        True
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._parts: dict[int, _PartHash] = {}
        self._lock = threading.Lock()

    def part(self, start: int, length: int) -> _PartHash:
        """A new hash for the part at ``start`` (replacing an earlier reader's of the same part)."""
        part = _PartHash(start, length)
        with self._lock:
            self._parts[start] = part
        return part

    def digest(self) -> FileDigest | None:
        """The file's digest if every part was read whole, in one pass each; else ``None``."""
        with self._lock:
            parts = [self._parts[start] for start in sorted(self._parts)]
        if not parts or not all(part.whole for part in parts):
            return None
        if len(parts) == 1:
            only = parts[0]
            if only.start != 0 or only.length != self.size:
                return None
            return FileDigest(self.size, f"{CHECKSUM_ALGORITHM}:{only.hasher.hexdigest()}")
        part_bytes = parts[1].start
        expected = [(start, min(part_bytes, self.size - start)) for start in range(0, self.size, part_bytes)]
        if not MIN_PART_BYTES <= part_bytes <= MAX_PART_BYTES or expected != [
            (part.start, part.length) for part in parts
        ]:
            return None
        return FileDigest(self.size, combine_parts(part_bytes, [part.hasher.intdigest() for part in parts]))


class _HashingReadFileChunk(ReadFileChunk):
    part: _PartHash

    def read(self, amount: int | None = None) -> bytes:
        position = self.tell()
        data: bytes = super().read(amount)
        self.part.saw(position, data)
        return data


class HashingOSUtils(OSUtils):
    """s3transfer's file access, hashing the parts of the files being :meth:`watching`.

    Example:
        >>> utils = HashingOSUtils()
        >>> with utils.watching("/tmp/a.bin", 0) as sent:
        ...     sent.size
        0
    """

    def __init__(self) -> None:
        super().__init__()
        self._watched: dict[str, SentParts] = {}
        self._lock = threading.Lock()

    @contextmanager
    def watching(self, local_path: str, size: int) -> Iterator[SentParts]:
        """Hash the parts of ``local_path`` that s3transfer reads while inside (one upload at a time per path)."""
        sent = SentParts(size)
        with self._lock:
            self._watched[local_path] = sent
        try:
            yield sent
        finally:
            with self._lock:
                if self._watched.get(local_path) is sent:
                    del self._watched[local_path]

    def open_file_chunk_reader_from_fileobj(
        self,
        fileobj: Any,
        chunk_size: int,
        full_file_size: int,
        callbacks: Any,
        close_callbacks: Any = None,
    ) -> Any:
        # s3transfer hands an InterruptReader around a DeferredOpenFile named after the path it was given.
        name = getattr(getattr(fileobj, "_fileobj", None), "name", None)
        with self._lock:
            sent = self._watched.get(name) if isinstance(name, str) else None
        if sent is None:
            return super().open_file_chunk_reader_from_fileobj(
                fileobj, chunk_size, full_file_size, callbacks, close_callbacks
            )
        start = fileobj.tell()  # the part's first byte, before the file is opened
        chunk = _HashingReadFileChunk(
            fileobj, chunk_size, full_file_size, callbacks=callbacks, enable_callbacks=False,
            close_callbacks=close_callbacks,
        )  # fmt: skip
        chunk.part = sent.part(start, len(chunk))
        return chunk
