"""Fast content checksums, computed while bytes are written or read, never in a second pass."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any

import xxhash

CHECKSUM_ALGORITHM = "xxh3_64"
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


def digest_chunks(chunks: Iterable[bytes]) -> FileDigest:
    hasher, size = xxhash.xxh3_64(), 0
    for chunk in chunks:
        hasher.update(chunk)
        size += len(chunk)
    return FileDigest(size, f"{CHECKSUM_ALGORITHM}:{hasher.hexdigest()}")


def read_blocks(handle: IO[bytes], block_bytes: int = READ_BLOCK_BYTES) -> Iterable[bytes]:
    while True:
        block = handle.read(block_bytes)
        if not block:
            return
        yield block


def digest_local_file(path: str | os.PathLike[str]) -> FileDigest:
    with open(path, "rb", buffering=0) as handle:
        return digest_chunks(read_blocks(handle))


def checksum_algorithm(checksum: str) -> str:
    return checksum.split(":", 1)[0]
