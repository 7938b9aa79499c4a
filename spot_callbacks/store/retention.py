"""Retention's reads and deletes: what ``CheckpointStore.prune`` does (rule 5 of :mod:`~spot_callbacks.store.commit`).

Its cost is bounded by what it may delete, plus one listing and the lineage's own checkpoints:

- Each store remembers the verdict of every step folder it read (:class:`RetentionMemory`). A
  folder that retention will never delete (another lineage's checkpoint, a manifest that does not
  parse, a folder without one) is read once per store, not at every commit: a fresh run on a
  dirpath that holds 5,000 checkpoints of an older run reads their manifests at its first prune
  only. The pruned lineage's own checkpoints are read again every time (they are what retention
  counts and deletes, so a verdict about them is never taken from memory).
- The checkpoints it deletes go together: every manifest in one bulk delete (S3 takes 1,000 keys
  a request), confirmed gone by one listing of the run folder, then every payload file the same
  way. A manifest the store kept is retried alone (``CheckpointStore.delete``, which says what
  stayed); the order of rule 4 holds for each checkpoint (no payload is deleted while its
  manifest is there).
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
from collections.abc import Iterable
from typing import Any

import spot_callbacks.store.commit as protocol
import spot_callbacks.store.layout as layout
from spot_callbacks.errors import DeleteIncompleteError, ForeignCheckpointError
from spot_callbacks.log import checkpoint_line
from spot_callbacks.store.layout import MANIFEST_NAME
from spot_callbacks.store.manifest import CheckpointInfo

log = logging.getLogger("spot_callbacks")

# Every ``store`` here is the CheckpointStore that owns this retention (typed Any: the store imports
# this module, and this one may not import it back, not even for type checking).


class RetentionMemory:
    """The verdicts of the step folders one store's retention has read, by step (``None``: the
    folder held no manifest when read); forgotten once a folder is gone from the listing or the
    run commits into it again."""

    def __init__(self) -> None:
        self.verdicts: dict[int, protocol.Verdict | None] = {}

    def forget(self, step: int) -> None:
        self.verdicts.pop(step, None)

    def infos(self) -> list[CheckpointInfo]:
        """The committed checkpoints remembered, oldest first."""
        return [v.info for _, v in sorted(self.verdicts.items()) if v is not None and v.info is not None]


def prune(
    store: Any,
    keep_last: int,
    lineage: str | None,
    protected: Iterable[int],
    followed: str,
    vouched: Iterable[int] | None = None,
) -> list[int]:
    """``CheckpointStore.prune``: ``lineage == followed`` prunes the lineage ``latest()`` follows."""
    if keep_last < 0:
        raise ValueError(f"keep_last={keep_last!r} must be >= 0")
    if keep_last == 0:
        return []
    memory = store.retention_memory
    chosen = _look(store, memory, lineage, followed)
    seen = memory.infos()  # a checkpoint committed after the listing is in none of it
    if sum(protocol.lineage_of(info) == chosen for info in seen) <= keep_last:
        return []
    damaged = lambda info: store.damage(info) is not None  # noqa: E731
    victims = protocol.retention_victims(seen, keep_last, damaged, chosen, protected, vouched)
    deleted = _delete_all(store, victims, keep_last) if victims else []
    for info in victims:
        memory.forget(info.step)
    return deleted


def _look(store: Any, memory: RetentionMemory, lineage: str | None, followed: str) -> str | None:
    """Bring ``memory`` up to date with one listing (and, to choose the lineage ``latest()`` follows,
    the store's times of the manifests: ``CheckpointStore._stored_times``); return the lineage to prune.

    Read now: the folders not remembered, then (when ``lineage`` is not known until those are
    read) the remembered checkpoints of the lineage chosen, which are never judged from memory.
    """
    folders = store.step_folders()
    for step in set(memory.verdicts) - set(folders):
        memory.forget(step)
    if lineage != followed:
        for step, verdict in list(memory.verdicts.items()):
            if (
                verdict is not None
                and verdict.info is not None
                and protocol.lineage_of(verdict.info) == lineage
            ):
                memory.forget(step)
    _read(store, memory, {step: path for step, path in folders.items() if step not in memory.verdicts})
    if lineage != followed:
        return lineage
    # The lineage latest() follows: of the manifest the store wrote last (its clock, not a writer's).
    chosen = protocol.current_lineage(memory.infos(), store._stored_times(folders))
    again = {
        step: folders[step]
        for step, verdict in memory.verdicts.items()
        if verdict is not None and verdict.info is not None and protocol.lineage_of(verdict.info) == chosen
    }
    _read(store, memory, again)  # this lineage's verdicts come from this call's reads only
    return chosen


def _read(store: Any, memory: RetentionMemory, folders: dict[int, str]) -> None:
    if not folders:
        return
    found = {verdict.step: verdict for verdict in store._verdicts_of(folders)}
    store._infos(list(found.values()))  # a manifest that does not parse is said once, as committed() does
    for step in folders:
        memory.verdicts[step] = found.get(step)


def _delete_all(store: Any, victims: list[CheckpointInfo], keep_last: int) -> list[int]:
    """Delete ``victims`` (rule 4 for each: its manifest first, then its payload); the steps deleted."""
    urls = {info.step: info.url for info in victims}
    folders: dict[int, str] = {}
    for info in victims:
        try:
            store._refuse_foreign(info.step)  # a link or stray put there since the listing
        except ForeignCheckpointError as err:
            _could_not(info.url, keep_last, err)
            continue
        folders[info.step] = store.step_path(info.step)
    manifests = [posixpath.join(folder, MANIFEST_NAME) for folder in folders.values()]
    _remove_files(store, manifests, f"delete {len(manifests)} manifest(s) under {store.url}")
    left = _files_under(store)
    deleted, retired = [], []
    for step, folder in folders.items():
        if posixpath.join(folder, MANIFEST_NAME) not in left:
            retired.append(step)
            continue
        try:  # the store kept it: alone, so the error names what stayed
            store.delete(step)
        except DeleteIncompleteError as err:
            _could_not(urls[step], keep_last, err)
            continue
        _deleted(urls[step], keep_last)
        deleted.append(step)
    payload = [path for path in left if _step_of(store, path) in retired]
    _remove_files(store, payload, f"delete the payload of {len(retired)} checkpoint(s) under {store.url}")
    emptied = [folders[step] for step in sorted(_listed_steps(store) & set(retired))]
    _remove_files(
        store, emptied, f"delete {len(emptied)} emptied folder(s) under {store.url}", recursive=True
    )
    left = _files_under(store)
    for step in retired:
        remaining = sorted(path for path in left if _step_of(store, path) == step)
        if remaining:
            _could_not(urls[step], keep_last, _payload_stayed(store, urls[step], remaining))
            continue
        _deleted(urls[step], keep_last)
        deleted.append(step)
    return sorted(deleted)


def _remove_files(store: Any, paths: list[str], what: str, recursive: bool = False) -> None:
    """Delete ``paths`` in one call: object stores delete a list in bulk (s3fs: 1,000 keys a request);
    ``recursive`` for the folders a local disk keeps once their files are gone."""
    if not paths:
        return
    fs = store.fs

    def one_by_one() -> None:
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                fs.rm(path, recursive=True) if recursive else fs.rm_file(path)

    def remove() -> None:
        try:
            fs.rm(paths, recursive=recursive)
        except FileNotFoundError:  # a local filesystem stops at one already gone: the others one by one
            one_by_one()

    _in_bulk_else_one_by_one(store, remove, one_by_one, what)


def remove_folder(store: Any, folder: str, what: str) -> None:
    """Delete ``folder`` and everything under it (a step folder a writer begins again, a deleted
    checkpoint's payload); on a server without bulk deletes, one object at a time."""
    fs = store.fs

    def one_by_one() -> None:
        if hasattr(fs, "invalidate_cache"):
            fs.invalidate_cache(folder)
        with contextlib.suppress(FileNotFoundError):
            for path in fs.find(folder, withdirs=False):
                with contextlib.suppress(FileNotFoundError):
                    fs.rm_file(path)

    _in_bulk_else_one_by_one(store, lambda: layout.remove_tree(fs, folder), one_by_one, what)


def _in_bulk_else_one_by_one(store: Any, bulk: Any, one_by_one: Any, what: str) -> None:
    """``bulk()``, retried; a server that refuses bulk deletes gets ``one_by_one()`` now and from then on."""
    store.retry.call(lambda: layout.in_bulk_else_one_by_one(store, bulk, one_by_one), what)


def _files_under(store: Any) -> set[str]:
    """Every file under the run folder, read fresh (one recursive listing: 1,000 keys a request on S3)."""
    if hasattr(store.fs, "invalidate_cache"):
        store.fs.invalidate_cache(store.root)
    try:
        found = store.retry.call(lambda: store.fs.find(store.root, withdirs=False), f"list {store.url}")
    except FileNotFoundError:
        return set()
    return {path.rstrip("/") for path in found}


def _listed_steps(store: Any) -> set[int]:
    """The steps whose folder the run folder still lists (read fresh)."""
    try:
        entries = store.retry.call(lambda: layout.list_folder(store.fs, store.root), f"list {store.url}")
    except FileNotFoundError:
        return set()
    steps = (layout.parse_step_dirname(posixpath.basename(entry.rstrip("/"))) for entry in entries)
    return {step for step in steps if step is not None}


def _step_of(store: Any, path: str) -> int | None:
    """The step whose folder holds ``path`` (directly under the run folder), else ``None``."""
    relative = posixpath.relpath(path, store.root)
    if relative.startswith("../"):
        return None
    return layout.parse_step_dirname(relative.split("/", 1)[0]) if "/" in relative else None


def _payload_stayed(store: Any, url: str, remaining: list[str]) -> DeleteIncompleteError:
    urls = [store.url_of(path) for path in remaining]
    return DeleteIncompleteError(
        f"the store kept {len(urls)} file(s) of {url} although it answered the delete as done: "
        f"{', '.join(urls[:5])}{' ...' if len(urls) > 5 else ''} (its manifest is gone: it is no longer committed)",
        urls,
    )


def _could_not(url: str, keep_last: int, err: Exception) -> None:
    log.warning("spot_callbacks: retention could not delete %s (keep_last=%d): %s", url, keep_last, err)


def _deleted(url: str, keep_last: int) -> None:
    checkpoint_line("spot_callbacks: retention deleted %s (keep_last=%d)", url, keep_last)
