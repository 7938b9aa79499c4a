"""What a data plane does (move one payload file up or down, read one's checksum), and the buffer budget.

A data plane moves payload bytes only: the manifest, the run lock, listings and deletes always go
through fsspec (:mod:`~spot_callbacks.store.commit`), so the commit protocol is the same whichever
client moves the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from spot_callbacks.errors import SpotError
from spot_callbacks.store.checksums import CHECKSUM_ALGORITHM, FileDigest
from spot_callbacks.store.meter import Moved, ignore_moved

MiB = 1024 * 1024
# 96, not 128: as fast on 2 cores against nanio, and 8 x 256 MiB pulled with 204-224 MB of peak extra
# RSS instead of 277-299 MB (6 MiB ranges; fewer bytes for the allocator to keep).
DEFAULT_BUFFER_BYTES = 96 * MiB
# Upload requests in flight at once across every file of a checkpoint (one shared pool): enough to
# fill a 25 Gbit/s link with 32 MiB parts, few enough for 2 cores.
UPLOAD_THREADS = 16
UPLOAD_PART_BYTES = 32 * MiB
# Files pulled at once (each one streamed GET): transfer.TRANSFER_THREADS.
PULL_STREAMS = 8
MIN_STREAM_CHUNK_BYTES = 1 * MiB
# A stream's bytes are written, hashed and counted (progress) a MiB at a time as they land: on a
# 2 MB/s link the count moves twice a second, not once per 6 MiB. Cheaper too: 1 GiB through
# obstore's stream, written and hashed, took 2.2-2.5 CPU-s in 1 MiB chunks against 3.6-5.2 in 6 MiB
# ones (fresh buffers faulted in; 2 loaded cores, 2026-12-04).
MAX_STREAM_CHUNK_BYTES = 1 * MiB
RANGE_BYTES = 8 * MiB


class Unsupported(SpotError):
    """A fast client cannot honour this filesystem or its options; the message says what (the store
    then moves the bytes through fsspec, and says why once)."""


@dataclass(frozen=True)
class TransferBudget:
    """How much payload the data plane may hold in memory at once, whatever the number of files.

    ``buffer_bytes`` (``$SPOT_TRANSFER_BUFFER_MB``, default 96 MiB) is shared by every stream in
    flight: a streamed pull holds at most two chunks per stream, ranged pulls one permit per range
    in flight or waiting for the hash (:meth:`range_permits`, shared by all files); boto3's
    uploads read each part from the scratch file as they send it and hold no part buffers at all.

    Example:
        >>> TransferBudget(256 * MiB).stream_chunk_bytes() // MiB, TransferBudget(8 * MiB).stream_chunk_bytes() // MiB
        (1, 1)
    """

    buffer_bytes: int = DEFAULT_BUFFER_BYTES

    def stream_chunk_bytes(self, streams: int = PULL_STREAMS) -> int:
        """The chunk of one streamed GET (or one ranged GET) when ``streams`` run at once (two chunks
        each in memory)."""
        chunk = self.buffer_bytes // (2 * max(1, streams))
        return max(MIN_STREAM_CHUNK_BYTES, min(MAX_STREAM_CHUNK_BYTES, chunk))

    def range_bytes(self) -> int:
        """The size of one ranged GET: a 16th of the budget, 8 MiB at most, 1 MiB at least (6 MiB by default). Measured on loopback,
        8 MiB ranges, 8 per file, beat 16 MiB x 16 (which faults in fresh memory at each range) by 2x.

        Example:
            >>> TransferBudget(128 * MiB).range_bytes() // MiB, TransferBudget().range_bytes() // MiB, TransferBudget(8 * MiB).range_bytes() // MiB
            (8, 6, 1)
        """
        return max(MIN_STREAM_CHUNK_BYTES, min(RANGE_BYTES, self.buffer_bytes // 16))

    def range_permits(self) -> int:
        """How many ranges all ranged pulls together may hold, in flight or waiting for the hash (at least 2).

        Example:
            >>> TransferBudget(128 * MiB).range_permits()
            16
        """
        return max(2, self.buffer_bytes // self.range_bytes())


class DataPlane(Protocol):
    """Moves one payload file between the local disk and the store, each call one attempt.

    Paths are the fsspec paths of the store's filesystem (``bucket/key``). A call is retried and
    timed by :class:`~spot_callbacks.store.retry.RetryPolicy` around it; ``timeout_s`` tells a
    streamed attempt when to stop by itself, so an abandoned one leaves nothing behind.
    """

    name: str  # what moves the bytes, as the log says it ("boto3 s3transfer up, obstore down")
    # True when upload(..., digest=True) hashes the bytes it reads to send them (no second pass).
    hashes_as_it_sends: bool

    def serves(self, fs: Any) -> bool:
        """True when this plane moves the bytes of ``fs`` (the filesystem it was built from)."""
        ...

    def warm(self, remote_path: str) -> None:
        """Build the clients for the bucket of ``remote_path`` now (imports, credentials, its region),
        so the first transfer does not wait for them; a failure is left for that transfer to tell."""
        ...

    def upload(
        self, local_path: str, remote_path: str, moved: Moved = ignore_moved, *, digest: bool = False
    ) -> FileDigest | None:
        """Put the local file at ``remote_path`` whole (an object PUT replaces the object at once).

        ``moved`` is told the bytes sent as they go, as often as the client says (perhaps never:
        the store counts a file whole once its call returns). With ``digest``, return the digest of
        the bytes sent where this plane hashes them as it reads them (``hashes_as_it_sends``);
        ``None`` otherwise, or when it could not (the caller hashes the file)."""
        ...

    def download(
        self,
        remote_path: str,
        local_path: str,
        timeout_s: float | None,
        expected_size: int | None = None,
        moved: Moved = ignore_moved,
        checksum_kind: str = CHECKSUM_ALGORITHM,
    ) -> FileDigest:
        """Write ``remote_path`` to ``local_path`` whole or not at all; return the digest of what arrived.

        ``expected_size`` (the manifest's) only chooses how to fetch (one stream or ranges); the
        digest is of the object as it is, of ``checksum_kind`` (the manifest's). ``moved``: the
        bytes arrived, as they arrive."""
        ...

    def digest(
        self,
        remote_path: str,
        timeout_s: float | None,
        expected_size: int | None = None,
        moved: Moved = ignore_moved,
        checksum_kind: str = CHECKSUM_ALGORITHM,
    ) -> FileDigest:
        """Read every byte of ``remote_path`` and return its digest of ``checksum_kind`` (nothing is written)."""
        ...
