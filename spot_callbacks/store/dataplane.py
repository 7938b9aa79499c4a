"""Which client moves a store's payload bytes, and the fsspec plane that every other one falls back to.

Payload files, and only they, go through the fastest well-kept client installed for the protocol;
the manifest, the run lock, listings and deletes always go through fsspec, so the commit protocol
(:mod:`~spot_callbacks.store.commit`) is the same whichever client moves the bytes:

============  ==========================  =============================================
protocol      upload                      pull (and a deep verify's read)
============  ==========================  =============================================
``s3://``     boto3 s3transfer            obstore: one streamed GET per file, a large
                                          file in a few streamed segments while streams
                                          are free, every size from the manifest (boto3's
                                          TransferManager where obstore is missing or
                                          cannot honour an option)
``az://``     obstore                     obstore, as for s3://
otherwise     fsspec (gcsfs, ...)         fsspec
============  ==========================  =============================================

The fast client is built from the store's own fsspec filesystem (same credentials, endpoint,
region, options); anything it cannot honour, a missing extra, or ``$SPOT_DATA_PLANE=fsspec``
leaves the bytes on fsspec, and the log says once which client moves them and why.

Knobs (in :mod:`spot_callbacks.settings`):

- ``SPOT_DATA_PLANE``: ``auto`` (default), ``fsspec`` (everything through fsspec), ``boto3`` (s3: boto3
  pulls too; az: fsspec), ``obstore`` (s3: obstore must pull; a store it cannot serve falls back
  to fsspec).
- ``SPOT_TRANSFER_BUFFER_MB``: payload bytes held in memory at once by the data plane, all files
  together (default 96; see :class:`~spot_callbacks.store.clients.base.TransferBudget`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import spot_callbacks.settings as settings
from spot_callbacks.errors import ConfigError
from spot_callbacks.store.backends import BACKENDS, backend_of_fs
from spot_callbacks.store.checksums import CHECKSUM_ALGORITHM, FileDigest, digest_chunks, read_blocks
from spot_callbacks.store.clients.base import (
    DataPlane,
    MiB,
    TransferBudget,
    Unsupported,
)
from spot_callbacks.store.meter import Moved, ignore_moved
from spot_callbacks.store.transfer import digest_mapped, put_file

log = logging.getLogger("spot_callbacks")

DATA_PLANE_ENV = settings.DATA_PLANE.name
BUFFER_ENV = settings.TRANSFER_BUFFER_MB.name
MIN_BUFFER_MB = 4
_said: set[tuple[str, str]] = set()


def data_plane_choice(environ: Mapping[str, str] | None = None) -> str:
    """``$SPOT_DATA_PLANE``: which client moves payload bytes (``auto`` unless set).

    Example:
        >>> data_plane_choice({}), data_plane_choice({"SPOT_DATA_PLANE": " FSspec "})
        ('auto', 'fsspec')
    """
    return settings.DATA_PLANE.value(environ)


def transfer_budget(environ: Mapping[str, str] | None = None) -> TransferBudget:
    """``$SPOT_TRANSFER_BUFFER_MB``: the data plane's memory for payload bytes in flight (MiB, default 96).

    Example:
        >>> transfer_budget({}).buffer_bytes // MiB, transfer_budget({"SPOT_TRANSFER_BUFFER_MB": "64"}).buffer_bytes // MiB
        (96, 64)
    """
    megabytes = settings.TRANSFER_BUFFER_MB.value(environ)
    if megabytes < MIN_BUFFER_MB:
        raise ConfigError(
            f"{BUFFER_ENV}={megabytes!r} is too small a buffer; use a number of MiB >= {MIN_BUFFER_MB}, "
            f"e.g. {BUFFER_ENV}=96"
        )
    return TransferBudget(megabytes * MiB)


class FsspecPlane:
    """Payload bytes through the store's fsspec filesystem itself (``put_file``, ``get_file``, ``open``).

    ``reason`` says why no faster client moves them (``None``: none exists, e.g. a local disk).

    Example:
        >>> import fsspec, tempfile
        >>> fs, folder = fsspec.filesystem("file"), tempfile.mkdtemp()
        >>> _ = open(f"{folder}/a.bin", "wb").write(b"abc")
        >>> plane = FsspecPlane(fs)
        >>> plane.upload(f"{folder}/a.bin", f"{folder}/b.bin"); plane.digest(f"{folder}/b.bin", None).size
        3
    """

    def __init__(self, fs: Any, reason: str | None = None) -> None:
        self._fs = fs
        self.reason = reason
        self.name = f"fsspec ({type(fs).__name__})"

    def serves(self, fs: Any) -> bool:
        return fs is self._fs

    def warm(self, remote_path: str) -> None:
        """Nothing to build: fsspec's client is the store's own."""

    hashes_as_it_sends = False

    def upload(
        self, local_path: str, remote_path: str, moved: Moved = ignore_moved, *, digest: bool = False
    ) -> FileDigest | None:
        put_file(self._fs, local_path, remote_path, fsspec_callback(moved))
        return None

    def download(
        self,
        remote_path: str,
        local_path: str,
        timeout_s: float | None,
        expected_size: int | None = None,
        moved: Moved = ignore_moved,
        checksum_kind: str = CHECKSUM_ALGORITHM,
    ) -> FileDigest:
        self._fs.get_file(remote_path, local_path, callback=fsspec_callback(moved))
        # Memory maps: a third of read()'s CPU (0.07 vs 0.19 CPU-s/GB).
        return digest_mapped(local_path, checksum_kind)

    def digest(
        self,
        remote_path: str,
        timeout_s: float | None,
        expected_size: int | None = None,
        moved: Moved = ignore_moved,
        checksum_kind: str = CHECKSUM_ALGORITHM,
    ) -> FileDigest:
        with self._fs.open(remote_path, "rb") as handle:
            return digest_chunks(_told(read_blocks(handle), moved), checksum_kind)


def fsspec_callback(moved: Moved) -> Any:
    """An fsspec ``callback`` telling ``moved`` the bytes of each update (backends that copy locally
    tell none: the store counts the file whole when it lands).

    Example:
        >>> told = []
        >>> callback = fsspec_callback(told.append)
        >>> callback.set_size(10); callback.relative_update(4); callback.absolute_update(10); told
        [4, 6]
    """
    from fsspec.callbacks import DEFAULT_CALLBACK, Callback

    if moved is ignore_moved:
        return DEFAULT_CALLBACK

    class _Told(Callback):  # fsspec is untyped
        reported = 0

        def call(self, *args: Any, **kwargs: Any) -> None:
            delta, self.reported = self.value - self.reported, self.value
            if delta:
                moved(delta)

    return _Told()


def _told(blocks: Any, moved: Moved) -> Any:
    for block in blocks:
        moved(len(block))
        yield block


def select_data_plane(fs: Any, environ: Mapping[str, str] | None = None) -> DataPlane:
    """The data plane for the store filesystem ``fs``: the fastest client that can honour it, else fsspec.

    Nothing is connected here (the clients are built at the first transfer).

    Example:
        >>> import fsspec
        >>> select_data_plane(fsspec.filesystem("memory")).name
        'fsspec (MemoryFileSystem)'
        >>> select_data_plane(fsspec.filesystem("memory"), {"SPOT_DATA_PLANE": "fsspec"}).reason
        'SPOT_DATA_PLANE=fsspec'
    """
    choice = data_plane_choice(environ)
    if choice == "fsspec":
        return FsspecPlane(fs, f"{DATA_PLANE_ENV}=fsspec")
    backend = backend_of_fs(fs)
    if backend.data_plane is None:  # the local disk, memory, gs:// (``no_data_plane`` says why)
        return FsspecPlane(fs, backend.no_data_plane)
    try:
        if choice != "auto" and choice not in backend.data_plane_choices:
            speaks = ", ".join(b.url_prefix for b in BACKENDS if choice in b.data_plane_choices)
            raise Unsupported(f"{DATA_PLANE_ENV}={choice}, and {choice} speaks {speaks} only")
        return backend.data_plane(fs, transfer_budget(environ), choice)
    except Unsupported as why:
        return FsspecPlane(fs, str(why))


def builds_clients(plane: DataPlane, fs: Any) -> bool:
    """Whether ``plane`` moves ``fs``'s payload bytes with clients of its own, to be built (warmed)
    ahead of the first transfer: not fsspec's (the filesystem's client is the store's), and not for a
    filesystem the plane does not serve (a wrapper that must see every byte)."""
    return plane.serves(fs) and not isinstance(plane, FsspecPlane)


def plane_for(plane: DataPlane, fs: Any) -> DataPlane:
    """``plane`` when it serves ``fs``; fsspec on ``fs`` when the store's filesystem was replaced by
    another (a wrapper that counts or injects faults must stay in the path of every byte)."""
    if plane.serves(fs):
        return plane
    return FsspecPlane(fs, f"the store's filesystem was replaced by a {type(fs).__name__}")


def announce(url: str, plane: DataPlane) -> None:
    """Say once per run folder which client moves its payload bytes, and why fsspec where it falls back."""
    reason = getattr(plane, "reason", None) or getattr(plane, "pull_fallback_reason", None)
    key = (url, f"{plane.name}|{reason}")
    if key in _said:
        return
    _said.add(key)
    if isinstance(plane, FsspecPlane) and reason is None:
        return  # a local disk or memory: nothing faster exists, nothing to say
    because = (
        f" ({'pulls by boto3: ' if not isinstance(plane, FsspecPlane) else ''}{reason})" if reason else ""
    )
    log.info(
        "spot_callbacks: payload bytes of %s move through %s%s; manifests, listings and deletes through fsspec",
        url, plane.name, because,
    )  # fmt: skip
