"""`CommitWriter`: THE one writer of the commit sequence, which every persister calls.

Writing checkpoint N is four steps, in the order of rule 3 of :mod:`~spot_callbacks.store.commit`:
:meth:`~CommitWriter.begin` (a stale folder of step N loses its manifest first),
:meth:`~CommitWriter.upload` (the payload, from one rank or from each),
:meth:`~CommitWriter.commit_files` (the manifest, built here and written last) and
:meth:`~CommitWriter.settle` (what follows a commit: retention, or a late emergency said).
:meth:`~CommitWriter.write_checkpoint` runs the first three for one writer of a whole folder;
a multi-rank persister runs them itself, each on the rank that owns it.
"""

from __future__ import annotations

import logging
import os
import posixpath
import time
from pathlib import Path
from typing import Any

import spot_callbacks.store.commit as protocol
import spot_callbacks.store.layout as layout
import spot_callbacks.store.transfer as transfer
from spot_callbacks.errors import CheckpointError
from spot_callbacks.store.checkpoint_store import CheckpointStore, delete_step, payload_plane
from spot_callbacks.store.checksums import FileDigest
from spot_callbacks.store.layout import MANIFEST_NAME
from spot_callbacks.store.manifest import (
    CheckpointInfo,
    check_payload_name,
    encode_manifest,
    new_manifest,
    parse_manifest,
)
from spot_callbacks.store.meter import TransferMeter

log = logging.getLogger("spot_callbacks")


_MANIFESTS_KEPT = 4  # written_manifest(): a commit's local copy asks for its own right after it


class CommitWriter:
    """Writes checkpoints into ``store`` by the commit protocol (the store's own reads stay on it).

    Example:
        >>> import tempfile, pathlib
        >>> src = pathlib.Path(tempfile.mkdtemp()); _ = (src / "state.bin").write_bytes(b"weights")
        >>> store = CheckpointStore("memory://doc-writer/run")
        >>> CommitWriter(store).write_checkpoint(100, src, reason="manual", framework="demo").step
        100
        >>> store.latest().step
        100
    """

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        # The steps this writer committed: what its retention may count (commit.retention_victims).
        self.committed_steps: set[int] = set()
        # The manifests it wrote last, as written: a local copy of a checkpoint gets its manifest from
        # here instead of reading back what was just written (one request less per commit).
        self._written: dict[int, bytes] = {}

    def __repr__(self) -> str:
        return f"CommitWriter({self.store.url!r})"

    def begin(self, step: int) -> None:
        """Prepare the folder of ``step`` for a new checkpoint.

        A folder that already exists (a run that resumed from an older checkpoint reached this
        step again) loses its manifest first, so it is never committed with mixed payloads.
        """
        if delete_step(self.store, step):
            log.info("spot_callbacks: replacing the existing checkpoint %s", self.store.step_url(step))

    def upload_file(
        self,
        local_path: str | os.PathLike[str],
        step: int,
        name: str,
        meter: TransferMeter | None = None,
        *,
        digest: bool = False,
    ) -> FileDigest | None:
        """Upload one payload file into the folder of ``step`` (multipart through the backend).

        An attempt still running after the store's ``upload_timeout`` allows for its size is
        abandoned and retried like a failed one. ``meter`` is told the bytes sent. With ``digest``,
        return the digest of the bytes sent where the store's data plane hashes them as it sends
        (else ``None``).
        """
        store = self.store
        remote = posixpath.join(store.step_path(step), check_payload_name(name))
        what = f"upload {store.step_url(step)}/{name}"
        plane, source = payload_plane(store), os.fspath(local_path)
        return transfer.upload_file(
            plane, store.retry, store.upload_timeout, source, remote, what, meter, name, digest=digest
        )

    def upload(
        self,
        step: int,
        folder: str | os.PathLike[str],
        names: list[str],
        digests: dict[str, FileDigest] | None = None,
        meter: TransferMeter | None = None,
    ) -> dict[str, FileDigest]:
        """Upload ``names`` (relative to ``folder``) into the folder of ``step`` in parallel; return their digests.

        Digests known from writing the files are reused, the others are computed from the bytes the
        upload reads (S3) or beside it (other stores). Nothing is committed: :meth:`commit_files`
        does that once every file of the checkpoint (from every rank, for a sharded one) is durable.
        ``meter`` is told the bytes sent.
        """
        meter = meter or TransferMeter("upload")

        def upload(local: Path, name: str, wants_digest: bool) -> FileDigest | None:
            return self.upload_file(local, step, name, meter, digest=wants_digest)

        hashes = payload_plane(self.store).hashes_as_it_sends
        return transfer.upload_with_digests(
            upload, Path(folder), names, digests, meter, hashes_as_it_sends=hashes
        )

    def commit_files(
        self,
        step: int,
        files: dict[str, FileDigest],
        *,
        reason: str,
        framework: str,
        epoch: int | None = None,
        metrics: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> CheckpointInfo:
        """Commit the durable payload ``files`` of ``step``: build its manifest and write it (:meth:`commit_manifest`)."""
        manifest = new_manifest(
            step, files, metrics=metrics, reason=reason, framework=framework, epoch=epoch, extra=extra
        )
        return self.commit_manifest(manifest)

    def commit_manifest(self, manifest: dict[str, Any]) -> CheckpointInfo:
        """Write the manifest, which makes the checkpoint visible; every payload file must be durable.

        A write that failed (or whose answer was lost) may still have landed: before saying so the
        manifest is read back, and one equal to what was written means the checkpoint is committed.
        """
        store = self.store
        step = manifest["step"]
        raw = encode_manifest(manifest)
        info = parse_manifest(raw, step, store.step_url(step))  # never commit what a reader would refuse
        path = posixpath.join(store.step_path(step), MANIFEST_NAME)
        what = f"write {store.step_url(step)}/{MANIFEST_NAME}"
        try:
            transfer.call_in_time(
                store.retry,
                lambda: transfer.put_bytes(store.fs, path, raw),
                store.upload_timeout.seconds_for(len(raw)),
                what,
            )
        except Exception as err:
            if protocol.landed(self._read_back(path), raw):
                log.warning(
                    "spot_callbacks: %s reported %s: %s, but the manifest is in the store as written: "
                    "checkpoint %s is committed", what, type(err).__name__, err, info.url,
                )  # fmt: skip
                self._remember(step, raw)
                return info
            raise
        self._remember(step, raw)
        return info

    def written_manifest(self, step: int) -> bytes | None:
        """The manifest of ``step`` as this writer committed it (its bytes), or ``None`` if it did not
        (lately: only the last few are kept)."""
        return self._written.get(step)

    def _remember(self, step: int, raw: bytes) -> None:
        self.committed_steps.add(step)
        self._written[step] = raw
        for older in sorted(self._written)[:-_MANIFESTS_KEPT]:
            self._written.pop(older, None)

    def _read_back(self, path: str) -> bytes | None:
        store = self.store
        try:
            read = transfer.read_files(store.fs, store.retry, [path], path, f"read back {store.url_of(path)}")
        except Exception:  # noqa: BLE001 - the read-back is a second chance; the write's error is the one to tell
            return None
        found = read.get(path)
        return found if isinstance(found, bytes) else None

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
        meter: TransferMeter | None = None,
    ) -> CheckpointInfo:
        """Upload every file of a local folder as checkpoint ``step`` and commit it (synchronously).

        :meth:`begin`, :meth:`upload` and :meth:`commit_files`, in that order. Files are uploaded
        in parallel; ``digests`` known from writing them are reused, the others are computed while
        the upload runs (``meter``: the bytes sent). The background :class:`Persister` calls this;
        use it directly for a blocking save (then :meth:`settle` for retention).
        """
        names = layout.local_payload_names(Path(folder))
        if not names:
            raise CheckpointError(f"{folder} holds no files to checkpoint")
        upload_started = time.perf_counter()
        self.begin(step)
        files = self.upload(step, folder, names, digests, meter)
        # Known only now, and recorded with the rest: the manifest is the run's cost record (ledger.py).
        metrics = {**(metrics or {}), "upload_s": round(time.perf_counter() - upload_started, 6)}
        return self.commit_files(
            step, files, reason=reason, framework=framework, epoch=epoch, metrics=metrics, extra=extra
        )

    def settle(self, info: CheckpointInfo, keep_last: int, deadline: float | None) -> None:
        """What follows a commit: a late emergency is said, and retention runs unless it was an emergency.

        Retention failing never fails the commit; it is retried after the next one.
        """
        store = self.store
        store.retention_memory.forget(info.step)  # read again: what retention remembers of it is older
        if not protocol.retention_follows(deadline):
            if deadline is not None and time.time() > deadline:
                log.warning(
                    "spot_callbacks: the emergency checkpoint of step %d committed %.1fs after its deadline",
                    info.step, time.time() - deadline,
                )  # fmt: skip
            return
        try:
            # The committing run's lineage; what it resumed from stays while it runs (its fallback).
            resumed = protocol.resumed_from(info)
            protected = {info.step} if resumed is None else {info.step, resumed}
            # Counted toward keep_last: what this run committed and what it resumed from, nothing else.
            store.prune(
                keep_last, protocol.lineage_of(info), protected, vouched=self.committed_steps | protected
            )
        except Exception as err:  # noqa: BLE001 - retention failing must not fail the commit
            log.warning(
                "spot_callbacks: retention in %s failed, will retry after the next commit: %s", store.url, err
            )
