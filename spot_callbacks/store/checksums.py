"""Fast content checksums, computed while bytes are written or read, never in a second pass."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO, Any

import xxhash

CHECKSUM_ALGORITHM = "xxh3_64"
READ_BLOCK_BYTES = 8 * 1024 * 1024


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

    ``torch.save`` accepts it as a file object, so a state is checksummed as it is serialized.

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
        self._hash.update(view)
        self._size += view.nbytes
        self._raw.write(view)
        return view.nbytes

    def flush(self) -> None:
        self._raw.flush()

    def digest(self) -> FileDigest:
        return FileDigest(self._size, f"{CHECKSUM_ALGORITHM}:{self._hash.hexdigest()}")


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
