"""Fast content checksums, computed while bytes are written, sent or read, never in a second pass.

A manifest records each file's checksum as ``"<kind>:<hex>"``. Two kinds are read:

- ``xxh3_64``: the xxh3 (64-bit) of the file's bytes, in order: what a writer computes as it writes.
- ``xxh3_64-parts-<P>``: the xxh3 of the big-endian 8-byte xxh3 digests of the file's parts of ``P``
  bytes (the last one shorter). What an upload computes when a client sends a file's parts out of
  order from several threads (s3transfer's multipart upload): each part is hashed from the bytes
  read for the wire, so no second pass over the file is needed. Every reader feeds the bytes in
  order to :class:`StreamHash` of the manifest's kind.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any

import xxhash

CHECKSUM_ALGORITHM = "xxh3_64"
PARTS_KIND_PREFIX = f"{CHECKSUM_ALGORITHM}-parts-"
# The part sizes a manifest may name: S3's own bounds on a multipart upload's part (5 MiB .. 5 GiB),
# widened below for other clients; a part size outside them is refused as a damaged manifest.
MIN_PART_BYTES = 1024 * 1024
MAX_PART_BYTES = 5 * 1024**3
READ_BLOCK_BYTES = 8 * 1024 * 1024

# The most one write() hands the page cache at once. Linux sizes a file's page-cache folio after the
# write (ext4, XFS: large folios), so a 1 MiB write takes a 1 MiB block of fresh memory, and on a VM
# whose free memory goes back to the host (virtio free page reporting) each such block faults in
# from the host again: 1 GiB written in 1 MiB writes cost 0.74-0.97 CPU-s of kernel time, in 512,
# 256 or 128 KiB writes 0.23-0.26 (fresh file, 6 s after the last one was removed; 2 loaded cores,
# 2026-12-06). It made a shaped-link pull cost 2.0 CPU-s/GB instead of 1.0-1.2.
WRITE_PIECE_BYTES = 256 * 1024


@dataclass(frozen=True)
class FileDigest:
    """Size and checksum of one payload file, as the manifest records it.

    Example:
        >>> digest_chunks([b"hello"]).to_json()["size"]
        5
    """

    size: int
    checksum: str  # "<algorithm>:<hex>", so another algorithm can be added without a format change

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "checksum": self.checksum}


class ChecksumWriter:
    """A write-only file wrapper that hashes and counts the bytes passing through it.

    ``torch.save`` accepts it as a file object, so a state is checksummed as it is serialized. Each
    write reaches ``raw`` in pieces of :data:`WRITE_PIECE_BYTES` at most.

    Example:
        >>> import io
        >>> writer = ChecksumWriter(io.BytesIO())
        >>> writer.write(b"hello")
        5
        >>> writer.digest().size
        5
    """

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self._hash = xxhash.xxh3_64()
        self._size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        write_in_pieces(self._write_piece, view)  # torch.save hands each tensor's bytes in one call
        self._size += view.nbytes
        return view.nbytes

    def _write_piece(self, piece: memoryview) -> None:
        self._hash.update(piece)  # while the piece is in the CPU's cache
        self._raw.write(piece)

    def flush(self) -> None:
        self._raw.flush()

    def digest(self) -> FileDigest:
        return FileDigest(self._size, f"{CHECKSUM_ALGORITHM}:{self._hash.hexdigest()}")


def write_in_pieces(write: Callable[[memoryview], object], view: memoryview) -> None:
    """``write(piece)`` for each :data:`WRITE_PIECE_BYTES` piece of ``view`` in order (``write`` a
    file object's: it writes all it is given).

    Example:
        >>> pieces = []
        >>> write_in_pieces(lambda piece: pieces.append(piece.nbytes), memoryview(bytes(600 * 1024)))
        >>> pieces
        [262144, 262144, 90112]
    """
    for start in range(0, view.nbytes, WRITE_PIECE_BYTES):
        write(view[start : start + WRITE_PIECE_BYTES])


def parts_kind(part_bytes: int) -> str:
    """The checksum kind of a file hashed part by part, ``part_bytes`` each.

    Example:
        >>> parts_kind(32 * 1024 * 1024)
        'xxh3_64-parts-33554432'
    """
    return f"{PARTS_KIND_PREFIX}{part_bytes}"


def kind_problem(kind: str) -> str | None:
    """Why this version cannot check a checksum of ``kind`` (read from an untrusted manifest), or ``None``.

    Example:
        >>> kind_problem("xxh3_64"), kind_problem("xxh3_64-parts-33554432")
        (None, None)
        >>> kind_problem("xxh3_64-parts-7")
        'its part size 7 is outside 1048576..5368709120 bytes'
    """
    if kind == CHECKSUM_ALGORITHM:
        return None
    if not kind.startswith(PARTS_KIND_PREFIX):
        return f"this spot_callbacks reads {CHECKSUM_ALGORITHM!r} and {PARTS_KIND_PREFIX + '<bytes>'!r}"
    digits = kind[len(PARTS_KIND_PREFIX) :]
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 12 or digits.startswith("0"):
        return f"its part size {digits!r:.20} is not a whole number of bytes"
    if not MIN_PART_BYTES <= int(digits) <= MAX_PART_BYTES:
        return f"its part size {digits} is outside {MIN_PART_BYTES}..{MAX_PART_BYTES} bytes"
    return None


def combine_parts(part_bytes: int, part_digests: Iterable[int]) -> str:
    """The checksum of a file from its parts' xxh3 digests, in order (``xxh3_64-parts-<part_bytes>``).

    Example:
        >>> one, two = bytes(MIN_PART_BYTES), b"tail"
        >>> parts = [xxhash.xxh3_64_intdigest(one), xxhash.xxh3_64_intdigest(two)]
        >>> combine_parts(MIN_PART_BYTES, parts) == StreamHash(parts_kind(MIN_PART_BYTES)).fed(one + two).checksum()
        True
    """
    tree = xxhash.xxh3_64()
    for digest in part_digests:
        tree.update(digest.to_bytes(8, "big"))
    return f"{parts_kind(part_bytes)}:{tree.hexdigest()}"


class StreamHash:
    """The checksum of ``kind`` of the bytes fed to :meth:`update` in order.

    Example:
        >>> StreamHash().fed(b"hello").checksum() == "xxh3_64:" + xxhash.xxh3_64_hexdigest(b"hello")
        True
        >>> whole = StreamHash(parts_kind(1024 * 1024)).fed(bytes(3 * 1024 * 1024)).checksum()
        >>> pieces = StreamHash(parts_kind(1024 * 1024))
        >>> for start in range(0, 3 * 1024 * 1024, 700_001):
        ...     _ = pieces.fed(bytes(min(700_001, 3 * 1024 * 1024 - start)))
        >>> pieces.checksum() == whole
        True
    """

    def __init__(self, kind: str = CHECKSUM_ALGORITHM) -> None:
        problem = kind_problem(kind)
        if problem is not None:
            raise ValueError(f"checksum kind {kind!r:.60}: {problem}")
        self.kind = kind
        self._whole = xxhash.xxh3_64()
        self._part_bytes = int(kind[len(PARTS_KIND_PREFIX) :]) if kind != CHECKSUM_ALGORITHM else 0
        self._part_digests: list[int] = []
        self._left = self._part_bytes
        # The plain kind hashes straight through (the hot path of every pull).
        self.update: Callable[[Any], None] = (
            self._whole.update if not self._part_bytes else self._update_parts
        )

    def _update_parts(self, data: Any) -> None:
        with memoryview(data) as raw, raw.cast("B") as view:
            start = 0
            while start < view.nbytes:
                take = min(self._left, view.nbytes - start)
                self._whole.update(view[start : start + take])
                start += take
                self._left -= take
                if self._left == 0:
                    self._part_digests.append(self._whole.intdigest())
                    self._whole.reset()
                    self._left = self._part_bytes

    def fed(self, data: Any) -> StreamHash:
        self.update(data)
        return self

    def checksum(self) -> str:
        """``"<kind>:<hex>"`` of the bytes fed so far."""
        if not self._part_bytes:
            return f"{self.kind}:{self._whole.hexdigest()}"
        open_part = [self._whole.intdigest()] if self._left != self._part_bytes else []
        return combine_parts(self._part_bytes, [*self._part_digests, *open_part])


def digest_chunks(chunks: Iterable[bytes], kind: str = CHECKSUM_ALGORITHM) -> FileDigest:
    hasher, size = StreamHash(kind), 0
    for chunk in chunks:
        hasher.update(chunk)
        size += len(chunk)
    return FileDigest(size, hasher.checksum())


def read_blocks(handle: IO[bytes], block_bytes: int = READ_BLOCK_BYTES) -> Iterable[bytes]:
    while True:
        block = handle.read(block_bytes)
        if not block:
            return
        yield block


def digest_local_file(path: str | os.PathLike[str], kind: str = CHECKSUM_ALGORITHM) -> FileDigest:
    with open(path, "rb", buffering=0) as handle:
        return digest_chunks(read_blocks(handle), kind)


def checksum_algorithm(checksum: str) -> str:
    return checksum.split(":", 1)[0]
