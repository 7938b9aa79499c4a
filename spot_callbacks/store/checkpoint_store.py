"""`CheckpointStore`: the checkpoints of one run, over any fsspec filesystem.

A facade: the layout (:mod:`~spot_callbacks.store.layout`), the manifest
(:mod:`~spot_callbacks.store.manifest`), the commit protocol (:mod:`~spot_callbacks.store.commit`)
and the transfers (:mod:`~spot_callbacks.store.transfer`) behind one object per run folder.
"""

from __future__ import annotations

import logging
import os
import posixpath
from collections.abc import Callable
from pathlib import Path
from typing import Any

import spot_callbacks.store.commit as protocol
import spot_callbacks.store.dataplane as dataplane
import spot_callbacks.store.layout as layout
import spot_callbacks.store.transfer as transfer
from spot_callbacks.errors import CheckpointNotFoundError, ForeignCheckpointError
from spot_callbacks.store.checksums import FileDigest
from spot_callbacks.store.clients.base import DataPlane
from spot_callbacks.store.layout import MANIFEST_NAME, step_dirname
from spot_callbacks.store.manifest import CheckpointInfo, check_payload_name, parse_manifest
from spot_callbacks.store.manifest_limits import ManifestLimits
from spot_callbacks.store.pull_dest import check_pull_dest
from spot_callbacks.store.retry import RetryPolicy, UploadTimeout

log = logging.getLogger("spot_callbacks")


class CheckpointStore:
    """The checkpoints of one run in a folder of any fsspec filesystem.

    Args:
        dirpath: fsspec URL (``s3://``, ``gs://``, ``az://``, ``file://``, ``memory://``) or local path.
        storage_options: passed to fsspec to build the filesystem (endpoint, credentials, ...).
        retry: backoff for transient storage errors.
        upload_timeout: how long one upload attempt may run before it is abandoned and retried
            (default: ``$SPOT_UPLOAD_TIMEOUT_S`` and ``$SPOT_UPLOAD_MIN_MBPS``, see :class:`UploadTimeout`).

    Example:
        >>> import tempfile, pathlib
        >>> src = pathlib.Path(tempfile.mkdtemp()); _ = (src / "state.bin").write_bytes(b"weights")
        >>> store = CheckpointStore("memory://doc-store/run")
        >>> store.write_checkpoint(100, src, reason="manual", framework="demo").step
        100
        >>> store.latest().step, store.verify(100)
        (100, True)
        >>> (store.pull(100, tempfile.mkdtemp() + "/pulled") / "state.bin").read_bytes()
        b'weights'
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        upload_timeout: UploadTimeout | None = None,
    ) -> None:
        self.dirpath = os.fspath(dirpath)
        # fs, retry and upload_timeout are read at every call, so they can be swapped on a live store.
        self.fs, self.root, self._url_protocol = layout.open_filesystem(self.dirpath, storage_options)
        # What moves payload bytes (store/dataplane.py), built from self.fs and serving it only: a
        # filesystem swapped in later (a wrapper that counts or injects faults) gets fsspec itself.
        self.data_plane: DataPlane = dataplane.select_data_plane(self.fs)
        self.retry = retry or RetryPolicy()
        self.upload_timeout = upload_timeout or UploadTimeout.from_env()
        self._warned: set[tuple[int, str]] = set()

    # ----------------------------------------------------------------- layout
    @property
    def url(self) -> str:
        """The run folder as a URL with its protocol (never a bare path for a remote store)."""
        return self.url_of(self.root)

    def url_of(self, path: str) -> str:
        """The URL of a filesystem path, in the protocol of ``dirpath``."""
        return layout.url_of(self.fs, path, self._url_protocol)

    @property
    def is_local(self) -> bool:
        return layout.is_local_fs(self.fs)

    def step_path(self, step: int) -> str:
        return posixpath.join(self.root, step_dirname(step))

    def step_url(self, step: int) -> str:
        return self.url_of(self.step_path(step))

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r})"

    def payload_plane(self) -> DataPlane:
        """The data plane that moves payload bytes now: :attr:`data_plane` when it serves :attr:`fs`,
        else fsspec on :attr:`fs` (said once in the log, with the reason)."""
        plane = dataplane.plane_for(self.data_plane, self.fs)
        dataplane.announce(self.url, plane)
        return plane

    # ---------------------------------------------------------------- reading
    def step_folders(self) -> dict[int, str]:
        """Every ``step-N`` folder of this run, committed or not (one listing).

        A step folder that is a symbolic link (another run's checkpoint linked in) is not this
        run's: it is left out with a warning, so nothing here reads it as ours or deletes through it.
        """
        try:
            entries = self.retry.call(lambda: layout.list_folder(self.fs, self.root), f"list {self.url}")
        except FileNotFoundError:
            return {}
        folders = {}
        for entry in entries:
            step = layout.parse_step_dirname(posixpath.basename(entry.rstrip("/")))
            if step is None:
                continue
            if layout.is_link(self.fs, self.step_path(step)):
                self.warn_once(step, f"spot_callbacks: ignoring {self.step_url(step)}: {self._foreign(step)}")
                continue
            folders[step] = self.step_path(step)
        return folders

    def missing_reason(self) -> str | None:
        """Why the run folder (or its bucket) does not exist, or ``None``: a typo is not an empty run."""
        return self.retry.call(lambda: layout.missing_root_reason(self.fs, self.root), f"check {self.url}")

    def refuse_foreign(self, step: int) -> None:
        """Raise :class:`ForeignCheckpointError` when the folder of ``step`` is a symbolic link."""
        if layout.is_link(self.fs, self.step_path(step)):
            raise ForeignCheckpointError(f"{self.step_url(step)}: {self._foreign(step)}")

    def _foreign(self, step: int) -> str:
        target = os.readlink(self.step_path(step))
        return (
            f"it is a symbolic link to {target}, another run's checkpoint, not this run's: "
            "never read as this run's, never deleted through"
        )

    def committed(self) -> list[CheckpointInfo]:
        """Every checkpoint whose manifest exists and parses, oldest first.

        Reads one listing and the manifests (fetched concurrently by async filesystems), never a payload.
        """
        return protocol.committed(self)

    def read_manifest(self, step: int) -> CheckpointInfo:
        """The parsed manifest of one step; :class:`CheckpointNotFoundError` if it has none."""
        path = posixpath.join(self.step_path(step), MANIFEST_NAME)
        limits = ManifestLimits.from_env()
        try:
            self.refuse_foreign(step)
            raw = self.retry.call(lambda: self.fs.cat_file(path), f"read {self.url_of(path)}")
        except (FileNotFoundError, ForeignCheckpointError) as err:
            why = (
                f"no {MANIFEST_NAME} in {self.step_url(step)}" if isinstance(err, FileNotFoundError) else err
            )
            raise CheckpointNotFoundError(
                f"no committed checkpoint at step {step} in {self.url} ({why})"
            ) from None
        return parse_manifest(raw, step, self.step_url(step), limits)

    def manifest_verdicts(self) -> list[protocol.Verdict]:
        """Every step folder holding a manifest, oldest first, with its manifest or why it cannot be
        trusted (see :func:`~spot_callbacks.store.commit.manifest_verdicts`)."""
        return protocol.manifest_verdicts(self)

    def damage(self, info: CheckpointInfo) -> str | None:
        """Why a committed checkpoint cannot be used, or ``None``: the verdict resume and CLI share."""
        return protocol.damage(self, info)

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint whose files exist with the manifest's sizes, or ``None``.

        A checkpoint that fails the check is skipped with a warning naming it and the reason; it
        is never deleted here.
        """
        return protocol.latest(self)

    def newest_valid(
        self,
        infos: list[CheckpointInfo],
        on_damaged: Callable[[CheckpointInfo, str], None] | None = None,
    ) -> CheckpointInfo | None:
        """The newest of ``infos`` (oldest first) whose files have the manifest's sizes; each one
        skipped goes to ``on_damaged(info, reason)`` (default: a warning), none is deleted."""
        return protocol.newest_valid(self, infos, on_damaged)

    def check_sizes(self, info: CheckpointInfo) -> None:
        """Raise :class:`CorruptCheckpointError` unless every payload file exists with its manifest size."""
        protocol.check_sizes(self, info)

    def verify(self, step: int, deep: bool = True) -> bool:
        """True when the checkpoint is committed and intact; otherwise an exception saying what is wrong.

        ``deep`` (the default) reads every payload byte and compares checksums; ``deep=False``
        checks existence and sizes only.
        """
        return protocol.verify(self, step, deep)

    def warn_once(self, step: int, message: str) -> None:
        """Log ``message`` about ``step`` once per store (a listing repeats, its warnings need not)."""
        if (step, message) not in self._warned:
            self._warned.add((step, message))
            log.warning(message)

    # ---------------------------------------------------------------- pulling
    def pull(self, step: int | None, dest: str | os.PathLike[str], *, force: bool = False) -> Path:
        """Download a committed checkpoint into the local folder ``dest`` and verify it; return ``dest``.

        ``step=None`` pulls :meth:`latest`. Files are fetched in parallel into a hidden sibling
        folder that is renamed to ``dest`` only once complete and verified, so an interrupted pull
        never leaves a folder that looks complete. When ``dest`` already holds this checkpoint
        (same manifest, files verified) nothing is downloaded. A ``dest`` that holds anything but
        this run's checkpoint files is refused (:class:`UnsafeDestinationError`) unless ``force``;
        a symbolic link, a file and the current directory (or above) always are.
        """
        if step is None:
            info = self.latest()
            if info is None:
                raise CheckpointNotFoundError(f"no committed checkpoint in {self.url}")
        else:
            info = self.read_manifest(step)
        target = Path(os.path.abspath(Path(dest).expanduser()))
        if transfer.local_copy_matches(info, target):
            log.info("spot_callbacks: %s already holds %s; not downloading", target, info.url)
            return target
        check_pull_dest(self, info, target, force=force)
        return transfer.pull_into(
            self.fs, self.payload_plane(), self.retry, info, self.step_path(info.step), target
        )

    def local_copy_matches(self, info: CheckpointInfo, folder: Path) -> bool:
        """True when ``folder`` holds exactly this checkpoint: same manifest, every file verified."""
        return transfer.local_copy_matches(info, folder)

    # ---------------------------------------------------------------- writing
    def clear_stale_step(self, step: int) -> None:
        """Prepare the folder of ``step`` for a new checkpoint.

        A folder that already exists (a run that resumed from an older checkpoint reached this
        step again) loses its manifest first, so it is never committed with mixed payloads.
        """
        protocol.clear_stale_step(self, step)

    def upload_file(self, local_path: str | os.PathLike[str], step: int, name: str) -> None:
        """Upload one payload file into the folder of ``step`` (multipart through the backend).

        An attempt still running after :attr:`upload_timeout` allows for its size is abandoned
        and retried like a failed one.
        """
        remote = posixpath.join(self.step_path(step), check_payload_name(name))
        what = f"upload {self.step_url(step)}/{name}"
        plane = self.payload_plane()
        transfer.upload_file(plane, self.retry, self.upload_timeout, os.fspath(local_path), remote, what)

    def upload_files(
        self,
        step: int,
        folder: str | os.PathLike[str],
        names: list[str],
        digests: dict[str, FileDigest] | None = None,
    ) -> dict[str, FileDigest]:
        """Upload ``names`` (relative to ``folder``) into the folder of ``step`` in parallel; return their digests.

        Digests known from writing the files are reused, the others are computed while the upload
        runs. Nothing is committed: :meth:`commit` does that once every file of the checkpoint
        (from every rank, for a sharded one) is durable.
        """

        def upload(local: Path, name: str) -> None:
            self.upload_file(local, step, name)

        return transfer.upload_with_digests(upload, Path(folder), names, digests)

    def commit(self, manifest: dict[str, Any]) -> CheckpointInfo:
        """Write the manifest, which makes the checkpoint visible; every payload file must be durable."""
        return protocol.commit_manifest(self, manifest)

    def write_checkpoint(
        self,
        step: int,
        folder: str | os.PathLike[str],
        *,
        reason: str,
        framework: str,
        epoch: int | None = None,
        digests: dict[str, FileDigest] | None = None,
        metrics: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> CheckpointInfo:
        """Upload every file of a local folder as checkpoint ``step`` and commit it (synchronously).

        Files are uploaded in parallel; ``digests`` known from writing them are reused,
        the others are computed while the upload runs. The background :class:`Persister`
        calls this; use it directly for a blocking save.
        """
        return protocol.write_checkpoint(
            self, step, Path(folder), digests=digests, metrics=metrics,
            reason=reason, framework=framework, epoch=epoch, extra=extra,
        )  # fmt: skip

    # ---------------------------------------------------------------- deleting
    def delete(self, step: int) -> None:
        """Delete one checkpoint: its manifest first (it stops counting), then its payload."""
        protocol.delete(self, step)

    def prune(self, keep_last: int) -> list[int]:
        """Keep the newest ``keep_last`` committed checkpoints (0 keeps all); return the steps deleted.

        The newest *valid* checkpoint is never deleted, even when newer damaged ones exist.
        Only checkpoints this call saw committed are touched, so a commit racing the prune is safe.
        """
        return protocol.prune(self, keep_last)
