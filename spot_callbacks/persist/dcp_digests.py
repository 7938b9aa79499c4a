"""DCP's local writer, checksumming (xxh3) every file as ``dcp.save`` writes it, so the upload reads each file once.

``torch.distributed.checkpoint.FileSystemWriter`` writes each of its files front to back through
one stream from its filesystem's ``create_stream``: ``write`` calls (each item's bytes, or
``torch.save`` into a wrapper that can only write), ``tell`` for each item's offset, ``flush``
and ``fileno`` for the fsync (torch 2.13, ``filesystem._write_files_from_queue`` and
``FileSystemWriter.finish``, which pickles ``.metadata`` into a temporary it renames). Hashing
those writes gives each file's digest without reading it back; the store then uploads the files
without the pass that would otherwise hash them beside the upload.

A digest is only kept when it is certainly the file's: a stream that is sought, or a file whose
size on disk is not the bytes hashed (something wrote past the stream), has none, and its file
is hashed at upload as before.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import xxhash

from spot_callbacks.store.checksums import CHECKSUM_ALGORITHM, FileDigest, write_in_pieces


class HashingStream:
    """A file opened for writing that hashes and counts the bytes written through it, each write
    reaching the file in pieces of :data:`~spot_callbacks.store.checksums.WRITE_PIECE_BYTES` at most.

    Example:
        >>> import io
        >>> stream = HashingStream(io.BytesIO())
        >>> stream.write(b"hel"), stream.write(memoryview(b"lo")), stream.tell()
        (3, 2, 5)
        >>> stream.digest() == FileDigest(5, "xxh3_64:" + xxhash.xxh3_64_hexdigest(b"hello"))
        True
    """

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._hasher = xxhash.xxh3_64()
        self._size = 0
        self._sound = True  # False once anything but writes in order happened

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        write_in_pieces(self._write_piece, view)  # DCP hands each tensor's bytes in one call
        self._size += view.nbytes
        return view.nbytes

    def _write_piece(self, piece: memoryview) -> None:
        written = self._raw.write(piece)
        if written is not None and written != piece.nbytes:
            self._sound = False  # a short write: what is on disk is not what was hashed
        self._hasher.update(piece)

    def tell(self) -> int:
        return self._size

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._sound = False  # DCP never seeks a stream it writes; if it ever does, hash at upload
        position: int = self._raw.seek(offset, whence)
        return position

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return int(self._raw.fileno())

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        self._raw.close()

    @property
    def closed(self) -> bool:
        return bool(self._raw.closed)

    def digest(self) -> FileDigest | None:
        """The digest of the bytes written, in order; ``None`` if the stream was ever sought or written short."""
        if not self._sound:
            return None
        return FileDigest(self._size, f"{CHECKSUM_ALGORITHM}:{self._hasher.hexdigest()}")


def digesting_writer(folder: Path, **options: Any) -> Any:
    """``dcp.FileSystemWriter(folder, **options)`` whose files are hashed as they are written:
    :func:`written_digests` of it, after ``dcp.save``, gives each file's digest by its name."""
    from torch.distributed.checkpoint import FileSystemWriter

    writer = FileSystemWriter(folder, **options)
    writer.fs = _hashing_filesystem()(Path(folder))
    return writer


def written_digests(writer: Any) -> dict[str, FileDigest]:
    """The digests of the files ``writer`` (:func:`digesting_writer`) wrote that are on disk as hashed,
    by their path relative to its folder (``/``-separated)."""
    digests = getattr(writer.fs, "written_digests", None)
    return digests() if digests is not None else {}


@functools.cache
def _hashing_filesystem() -> Any:
    """DCP's local filesystem, hashing each file created for writing; renames and removals follow
    (a class built at first use: torch.distributed.checkpoint is imported only by a sharded save)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        def __init__(self, root: Path) -> None:
            super().__init__()
            self._root = root
            self._digests: dict[Path, FileDigest] = {}
            self._lock = threading.Lock()  # DCP writes files from several threads (thread_count)

        @contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
            target = Path(path)
            if mode != "wb":
                with super().create_stream(path, mode) as plain:
                    yield plain
                return
            with self._lock:
                self._digests.pop(target, None)
            with super().create_stream(path, mode) as raw:
                hashing = HashingStream(raw)
                yield hashing
            digest = hashing.digest()
            if digest is not None:
                with self._lock:
                    self._digests[target] = digest

        def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
            super().rename(path, new_path)
            with self._lock:
                digest = self._digests.pop(Path(path), None)
                self._digests.pop(Path(new_path), None)
                if digest is not None:
                    self._digests[Path(new_path)] = digest

        def rm_file(self, path: str | os.PathLike[str]) -> None:
            super().rm_file(path)
            with self._lock:
                self._digests.pop(Path(path), None)

        def written_digests(self) -> dict[str, FileDigest]:
            with self._lock:
                known = dict(self._digests)
            found = {}
            for path, digest in known.items():
                try:
                    on_disk = path.stat().st_size
                except OSError:
                    continue
                if on_disk == digest.size:  # else something wrote past the stream: hashed at upload
                    found[path.relative_to(self._root).as_posix()] = digest
            return found

    return HashingFileSystem
