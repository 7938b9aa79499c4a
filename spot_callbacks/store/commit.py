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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spot_callbacks.errors import (
    CheckpointError,
    CorruptCheckpointError,
    DeleteIncompleteError,
    ManifestError,
)
from spot_callbacks.store.checksums import FileDigest
from spot_callbacks.store.layout import (
    MANIFEST_NAME,
    exists_fresh,
    local_payload_names,
    remove_file,
    remove_tree,
)
from spot_callbacks.store.manifest import CheckpointInfo, encode_manifest, new_manifest, parse_manifest
from spot_callbacks.store.manifest_limits import ManifestLimits
from spot_callbacks.store.transfer import call_in_time, file_sizes, put_bytes, read_files, verify_checksums

if TYPE_CHECKING:
    from spot_callbacks.store.checkpoint_store import CheckpointStore

log = logging.getLogger("spot_callbacks")


# Failures that make one checkpoint damaged (skip it, fall back, never delete), as opposed to the
# store being unreachable or refusing access, which say nothing about the checkpoint and propagate.
DAMAGE_ERRORS: tuple[type[BaseException], ...] = (ManifestError, CorruptCheckpointError, FileNotFoundError)


@dataclass(frozen=True)
class Verdict:
    """What one step folder holding a manifest is: ``info`` (``None``: the manifest cannot be
    trusted) and ``problem`` (``None``: valid), the one verdict a resume and the CLI both show."""

    step: int
    url: str
    info: CheckpointInfo | None
    problem: str | None


# ----------------------------------------------------------------- 1, 2: what is committed
def manifest_verdicts(store: CheckpointStore) -> list[Verdict]:
    """Every step folder holding a manifest, oldest first, with the manifest parsed or why it is not
    (one listing and the manifests, none parsed past ``SPOT_MANIFEST_MAX_BYTES``; never a payload)."""
    manifests = {step: posixpath.join(path, MANIFEST_NAME) for step, path in store.step_folders().items()}
    if not manifests:
        return []
    limits = ManifestLimits.from_env()
    what = f"read manifests under {store.url}"
    # A ranged read would bound the download too, but backends answer a range past the end of a
    # small or empty object differently (InvalidRange); the size is checked before parsing.
    raw_by_path = read_files(store.fs, store.retry, list(manifests.values()), store.root, what)
    verdicts = []
    for step in sorted(manifests):
        raw = raw_by_path.get(manifests[step])
        if not isinstance(raw, bytes):
            continue  # no manifest: not committed (an upload in progress or abandoned)
        try:
            info = parse_manifest(raw, step, store.step_url(step), limits)
        except ManifestError as err:
            verdicts.append(Verdict(step, store.step_url(step), None, str(err)))
        else:
            verdicts.append(Verdict(step, info.url, info, None))
    return verdicts


def committed(store: CheckpointStore) -> list[CheckpointInfo]:
    """Every checkpoint whose manifest exists and parses, oldest first; one that does not parse is
    skipped with a warning naming it and the reason."""
    infos = []
    for verdict in manifest_verdicts(store):
        if verdict.info is None:
            store.warn_once(
                verdict.step, f"spot_callbacks: ignoring checkpoint {verdict.url}: {verdict.problem}"
            )
        else:
            infos.append(verdict.info)
    return infos


def damage(store: CheckpointStore, info: CheckpointInfo) -> str | None:
    """Why the committed checkpoint ``info`` cannot be used (``None``: its files have the manifest's
    sizes): THE verdict, which :func:`newest_valid` and ``spot-callbacks ls`` both use.

    A checkpoint deleted since it was listed is damaged; an unreachable store raises.
    """
    try:
        store.check_sizes(info)
    except DAMAGE_ERRORS as err:
        return str(err) or type(err).__name__
    return None


def latest(store: CheckpointStore) -> CheckpointInfo | None:
    """The newest committed checkpoint that is valid, or ``None``: what a resume uses."""
    return store.newest_valid(store.committed())


def newest_valid(
    store: CheckpointStore,
    infos: list[CheckpointInfo],
    on_damaged: Callable[[CheckpointInfo, str], None] | None = None,
) -> CheckpointInfo | None:
    """The newest of ``infos`` (oldest first) that :func:`damage` finds nothing wrong with.

    Each one skipped is reported to ``on_damaged(info, reason)`` (default: one warning line naming
    it and the reason); none is deleted.
    """
    for info in reversed(infos):
        problem = damage(store, info)
        if problem is None:
            return info
        if on_damaged is not None:
            on_damaged(info, problem)
        else:
            store.warn_once(info.step, damaged_message(info.url, problem))
    return None


def damaged_message(url: str, problem: str) -> str:
    """The one line said about a damaged checkpoint, wherever it is found."""
    return f"spot_callbacks: skipping damaged checkpoint {url}: {problem}; trying the previous one"


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
        verify_checksums(store.payload_plane(), store.retry, info, store.step_path(step))
    return True


# ----------------------------------------------------------------- 3: writing
def clear_stale_step(store: CheckpointStore, step: int) -> None:
    """Empty the folder of ``step`` before a new payload lands in it, its manifest first.

    The folder exists when a run resumed from an older checkpoint reaches this step again.
    """
    if delete(store, step):
        log.info("spot_callbacks: replacing the existing checkpoint %s", store.step_url(step))


def commit_manifest(store: CheckpointStore, manifest: dict[str, Any]) -> CheckpointInfo:
    """Write the manifest, which makes the checkpoint visible; every payload file must be durable.

    A write that failed (or whose answer was lost) may still have landed: before saying so the
    manifest is read back, and one equal to what was written means the checkpoint is committed.
    """
    step = manifest["step"]
    raw = encode_manifest(manifest)
    info = parse_manifest(raw, step, store.step_url(step))  # never commit what a reader would refuse
    path = posixpath.join(store.step_path(step), MANIFEST_NAME)
    what = f"write {store.step_url(step)}/{MANIFEST_NAME}"
    try:
        call_in_time(
            store.retry,
            lambda: put_bytes(store.fs, path, raw),
            store.upload_timeout.seconds_for(len(raw)),
            what,
        )
    except Exception as err:
        if _landed(store, path, raw):
            log.warning(
                "spot_callbacks: %s reported %s: %s, but the manifest is in the store as written: "
                "checkpoint %s is committed", what, type(err).__name__, err, info.url,
            )  # fmt: skip
            return info
        raise
    return info


def _landed(store: CheckpointStore, path: str, raw: bytes) -> bool:
    try:
        found = read_files(store.fs, store.retry, [path], path, f"read back {store.url_of(path)}").get(path)
    except Exception:  # noqa: BLE001 - the read-back is a second chance; the write's error is the one to tell
        return False
    return found == raw


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
    # Known only now, and recorded with the rest: the manifest is the run's cost record (ledger.py).
    metrics = {**(metrics or {}), "upload_s": round(time.perf_counter() - upload_started, 6)}
    return store.commit(new_manifest(step, files, metrics=metrics, **manifest_fields))


# ----------------------------------------------------------------- 4, 5: deleting
def delete(store: CheckpointStore, step: int) -> bool:
    """Delete one checkpoint: its manifest first (it stops counting), then its payload.

    Returns whether it had a manifest. Each part is confirmed gone before the next: a store that
    answers a delete as done but keeps objects raises :class:`DeleteIncompleteError` naming them,
    and a manifest that stayed keeps its payload (the checkpoint stays committed and whole). A
    step folder that is a symbolic link is another run's: :class:`ForeignCheckpointError`.
    """
    folder = store.step_path(step)
    store.refuse_foreign(step)
    manifest = posixpath.join(folder, MANIFEST_NAME)
    had_manifest = _exists(store, manifest)
    if had_manifest:
        store.retry.call(
            lambda: remove_file(store.fs, manifest), f"delete {store.step_url(step)}/{MANIFEST_NAME}"
        )
        if _exists(store, manifest):
            url = f"{store.step_url(step)}/{MANIFEST_NAME}"
            raise DeleteIncompleteError(
                f"the store kept {url} although it answered the delete as done (a bucket policy or an "
                f"object lock?): checkpoint {store.step_url(step)} is still committed, its files untouched",
                [url],
            )
    if _exists(store, folder):
        store.retry.call(lambda: remove_tree(store.fs, folder), f"delete {store.url_of(folder)}")
        remaining = sorted(file_sizes(store.fs, store.retry, folder, f"list {store.url_of(folder)}"))
        if remaining:
            urls = [f"{store.url_of(folder)}/{name}" for name in remaining]
            raise DeleteIncompleteError(
                f"the store kept {len(urls)} file(s) of {store.url_of(folder)} although it answered the "
                f"delete as done: {', '.join(urls[:5])}{' ...' if len(urls) > 5 else ''} (its manifest is gone: "
                "it is no longer committed)",
                urls,
            )
    return had_manifest


def prune(store: CheckpointStore, keep_last: int) -> list[int]:
    """Keep the newest ``keep_last`` committed checkpoints (0 keeps all); return the steps deleted.

    A checkpoint the store would not (wholly) delete is logged with what stayed and not returned.
    """
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
        try:
            store.delete(info.step)
        except DeleteIncompleteError as err:
            log.warning(
                "spot_callbacks: retention could not delete %s (keep_last=%d): %s", info.url, keep_last, err
            )
            continue
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
