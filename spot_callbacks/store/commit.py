"""The commit protocol, in one place: what makes a checkpoint committed, and what retention may delete.

The rules:

1. A checkpoint is the folder ``<dirpath>/step-<09d>/``. It is **committed** iff its
   ``manifest.json`` exists and parses. A single-object PUT is atomic on S3, GCS and Azure, and
   rename is not, so the manifest is the commit; nothing relies on rename.
2. It is **valid** when, besides, every file it lists exists with the listed size
   (:func:`check_sizes`); :func:`latest`, what a resume uses, is the newest valid one, and
   :func:`verify` also compares every checksum. A checkpoint that fails is skipped with a
   warning, never deleted.
3. **Writing** step N: clear a stale folder of step N (its manifest first, so a mix of old and new
   payload is never committed), upload the payload, and write the manifest **last**, once every
   payload file is durable.
4. **Deleting** a checkpoint retires its manifest first (it stops counting at once), then its payload.
5. **Retention** (:func:`prune`) keeps the newest ``keep_last`` committed checkpoints, runs only
   after a newer checkpoint committed (:func:`settle_commit`), never during an emergency save,
   never deletes the newest valid checkpoint, and touches only checkpoints it saw committed.

Each function takes the :class:`~spot_callbacks.store.CheckpointStore` and works through its
methods, so the steps of a protocol compose the same public verbs a caller (or a test) sees.
"""

from __future__ import annotations

import logging
import posixpath
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spot_callbacks.errors import CheckpointError, CorruptCheckpointError, ManifestError
from spot_callbacks.store.checksums import FileDigest
from spot_callbacks.store.layout import (
    MANIFEST_NAME,
    exists_fresh,
    local_payload_names,
    remove_file,
    remove_tree,
)
from spot_callbacks.store.manifest import CheckpointInfo, encode_manifest, new_manifest, parse_manifest
from spot_callbacks.store.transfer import call_in_time, file_sizes, put_bytes, read_files, verify_checksums

if TYPE_CHECKING:
    from spot_callbacks.store.checkpoint_store import CheckpointStore

log = logging.getLogger("spot_callbacks")


# ----------------------------------------------------------------- 1, 2: what is committed
def committed(store: CheckpointStore) -> list[CheckpointInfo]:
    """Every checkpoint whose manifest exists and parses, oldest first (one listing and the
    manifests, never a payload)."""
    manifests = {step: posixpath.join(path, MANIFEST_NAME) for step, path in store.step_folders().items()}
    if not manifests:
        return []
    what = f"read manifests under {store.url}"
    raw_by_path = read_files(store.fs, store.retry, list(manifests.values()), store.root, what)
    infos = []
    for step in sorted(manifests):
        raw = raw_by_path.get(manifests[step])
        if not isinstance(raw, bytes):
            continue  # no manifest: not committed (an upload in progress or abandoned)
        try:
            infos.append(parse_manifest(raw, step, store.step_url(step)))
        except ManifestError as err:
            store.warn_once(step, f"spot_callbacks: ignoring checkpoint {store.step_url(step)}: {err}")
    return infos


def latest(store: CheckpointStore) -> CheckpointInfo | None:
    """The newest committed checkpoint that is valid, or ``None``: what a resume uses."""
    return store.newest_valid(store.committed())


def newest_valid(store: CheckpointStore, infos: list[CheckpointInfo]) -> CheckpointInfo | None:
    """The newest of ``infos`` (oldest first) whose files have the manifest's sizes; the others are
    skipped with a warning, never deleted."""
    for info in reversed(infos):
        try:
            store.check_sizes(info)
        except CorruptCheckpointError as err:
            message = (
                f"spot_callbacks: skipping damaged checkpoint {info.url}: {err}; trying the previous one"
            )
            store.warn_once(info.step, message)
            continue
        return info
    return None


def check_sizes(store: CheckpointStore, info: CheckpointInfo) -> None:
    """Raise :class:`CorruptCheckpointError` unless every payload file exists with its manifest size."""
    sizes = file_sizes(store.fs, store.retry, store.step_path(info.step), f"list {info.url}")
    for name, digest in info.files.items():
        if name not in sizes:
            raise CorruptCheckpointError(f"{info.url}/{name} is missing")
        if sizes[name] != digest.size:
            raise CorruptCheckpointError(
                f"{info.url}/{name} is {sizes[name]} bytes but the manifest says {digest.size} (truncated or replaced)"
            )


def verify(store: CheckpointStore, step: int, deep: bool = True) -> bool:
    """True when ``step`` is committed and valid (and, ``deep``, every checksum matches); else raise."""
    info = store.read_manifest(step)
    store.check_sizes(info)
    if deep:
        verify_checksums(store.fs, store.retry, info, store.step_path(step))
    return True


# ----------------------------------------------------------------- 3: writing
def clear_stale_step(store: CheckpointStore, step: int) -> None:
    """Empty the folder of ``step`` before a new payload lands in it, its manifest first.

    The folder exists when a run resumed from an older checkpoint reaches this step again.
    """
    if delete(store, step):
        log.info("spot_callbacks: replacing the existing checkpoint %s", store.step_url(step))


def commit_manifest(store: CheckpointStore, manifest: dict[str, Any]) -> CheckpointInfo:
    """Write the manifest, which makes the checkpoint visible; every payload file must be durable."""
    step = manifest["step"]
    raw = encode_manifest(manifest)
    info = parse_manifest(raw, step, store.step_url(step))  # never commit what a reader would refuse
    path = posixpath.join(store.step_path(step), MANIFEST_NAME)
    what = f"write {store.step_url(step)}/{MANIFEST_NAME}"
    call_in_time(
        store.retry, lambda: put_bytes(store.fs, path, raw), store.upload_timeout.seconds_for(len(raw)), what
    )
    return info


def write_checkpoint(
    store: CheckpointStore,
    step: int,
    folder: Path,
    *,
    digests: dict[str, FileDigest] | None = None,
    metrics: dict[str, Any] | None = None,
    **manifest_fields: Any,
) -> CheckpointInfo:
    """Clear the step, upload every payload file of ``folder``, then commit its manifest."""
    names = local_payload_names(folder)
    if not names:
        raise CheckpointError(f"{folder} holds no files to checkpoint")
    upload_started = time.perf_counter()
    store.clear_stale_step(step)
    files = store.upload_files(step, folder, names, digests)
    # Known only now, and recorded with the rest: the manifest is the run's cost record (costs.py).
    metrics = {**(metrics or {}), "upload_s": round(time.perf_counter() - upload_started, 6)}
    return store.commit(new_manifest(step, files, metrics=metrics, **manifest_fields))


# ----------------------------------------------------------------- 4, 5: deleting
def delete(store: CheckpointStore, step: int) -> bool:
    """Delete one checkpoint: its manifest first (it stops counting), then its payload.

    Returns whether it had a manifest.
    """
    folder = store.step_path(step)
    manifest = posixpath.join(folder, MANIFEST_NAME)
    had_manifest = _exists(store, manifest)
    if had_manifest:
        store.retry.call(
            lambda: remove_file(store.fs, manifest), f"delete {store.step_url(step)}/{MANIFEST_NAME}"
        )
    if _exists(store, folder):
        store.retry.call(lambda: remove_tree(store.fs, folder), f"delete {store.url_of(folder)}")
    return had_manifest


def prune(store: CheckpointStore, keep_last: int) -> list[int]:
    """Keep the newest ``keep_last`` committed checkpoints (0 keeps all); return the steps deleted."""
    if keep_last < 0:
        raise ValueError(f"keep_last={keep_last!r} must be >= 0")
    if keep_last == 0:
        return []
    seen = store.committed()  # a checkpoint committed after this listing is never touched
    if len(seen) <= keep_last:
        return []
    newest = store.newest_valid(seen)
    deleted = []
    for info in seen[:-keep_last]:
        if newest is not None and info.step == newest.step:
            continue
        store.delete(info.step)
        log.info("spot_callbacks: retention deleted %s (keep_last=%d)", info.url, keep_last)
        deleted.append(info.step)
    return deleted


def settle_commit(
    store: CheckpointStore, info: CheckpointInfo, keep_last: int, deadline: float | None
) -> None:
    """What follows a commit: a late emergency is said, and retention runs unless it was an emergency.

    An emergency checkpoint (one with a ``deadline``) spends none of its seconds on deletes:
    retention waits for the next commit (the next run's first). Retention failing never fails
    the commit; it is retried after the next one.
    """
    if deadline is not None:
        if time.time() > deadline:
            log.warning(
                "spot_callbacks: the emergency checkpoint of step %d committed %.1fs after its deadline",
                info.step, time.time() - deadline,
            )  # fmt: skip
        return
    try:
        store.prune(keep_last)
    except Exception as err:  # noqa: BLE001 - retention failing must not fail the commit
        log.warning(
            "spot_callbacks: retention in %s failed, will retry after the next commit: %s", store.url, err
        )


def _exists(store: CheckpointStore, path: str) -> bool:
    return store.retry.call(lambda: exists_fresh(store.fs, path), f"check {store.url_of(path)}")
