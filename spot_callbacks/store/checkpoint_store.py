"""`CheckpointStore`: the checkpoints of one run, over any fsspec filesystem.

The reading and deleting steps of the commit protocol are here, in the order of the protocol's
rules (:mod:`~spot_callbacks.store.commit` states them and holds the pure decisions they take); the
writing steps are :class:`~spot_callbacks.store.writer.CommitWriter`'s, built on a store. The
layout (:mod:`~spot_callbacks.store.layout`), the manifest (:mod:`~spot_callbacks.store.manifest`)
and the transfers (:mod:`~spot_callbacks.store.transfer`) are below it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import posixpath
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import spot_callbacks.store.commit as protocol
import spot_callbacks.store.dataplane as dataplane
import spot_callbacks.store.layout as layout
import spot_callbacks.store.retention as retention
import spot_callbacks.store.transfer as transfer
from spot_callbacks.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DeleteIncompleteError,
    ForeignCheckpointError,
    ManifestError,
)
from spot_callbacks.store.backends import backend_of_fs
from spot_callbacks.store.clients.base import DataPlane
from spot_callbacks.store.layout import MANIFEST_NAME, step_dirname
from spot_callbacks.store.manifest import (
    CheckpointInfo,
    parse_manifest,
)
from spot_callbacks.store.manifest_limits import ManifestLimits
from spot_callbacks.store.meter import TransferMeter
from spot_callbacks.store.pull_dest import check_pull_dest
from spot_callbacks.store.retry import RetryPolicy, UploadTimeout
from spot_callbacks.store.warmup import ClientWarmUp

log = logging.getLogger("spot_callbacks")

# prune()'s default: the lineage latest() follows (lineage ids are uuid hex, never this word).
FOLLOWED_LINEAGE = "latest"
# latest() reads the manifests of the highest steps this many at a time (one concurrent read per
# batch), walking down only until the newest valid checkpoint of the current lineage is found.
LATEST_BATCH = 64


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
        >>> from spot_callbacks.store.writer import CommitWriter
        >>> store = CheckpointStore("memory://doc-store/run")
        >>> CommitWriter(store).write_checkpoint(100, src, reason="manual", framework="demo").step
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
        self._fs, self.root, self._url_protocol = layout.open_filesystem(self.dirpath, storage_options)
        # What moves payload bytes (store/dataplane.py), built from self.fs and serving it only: a
        # filesystem swapped in later (a wrapper that counts or injects faults) gets fsspec itself.
        self.data_plane: DataPlane = dataplane.select_data_plane(self._fs)
        self._warming: threading.Thread | None = None  # the data plane's warm-up thread, once started
        self.warm_up: ClientWarmUp | None = None  # the clients' warm-up (warm_data_plane), once started
        self.retry = retry or RetryPolicy()
        self.upload_timeout = upload_timeout or UploadTimeout.from_env()
        self._warned: set[tuple[int, str]] = set()
        self.retention_memory = retention.RetentionMemory()

    @property
    def fs(self) -> Any:
        """The store's fsspec filesystem; its first use waits for the warm-up building its client
        (:meth:`warm_data_plane`), a bounded wait (``store/warmup.py``)."""
        if self.warm_up is not None:
            self.warm_up.wait_for_client()
        return self._fs

    @fs.setter
    def fs(self, fs: Any) -> None:
        self._fs = fs

    # ----------------------------------------------------------------- layout
    @property
    def url(self) -> str:
        """The run folder as a URL with its protocol (never a bare path for a remote store)."""
        return self.url_of(self.root)

    def url_of(self, path: str) -> str:
        """The URL of a filesystem path, in the protocol of ``dirpath``."""
        return layout.url_of(self._fs, path, self._url_protocol)

    @property
    def _is_local(self) -> bool:
        return layout.is_local_fs(self._fs)

    def step_path(self, step: int) -> str:
        return posixpath.join(self.root, step_dirname(step))

    def step_url(self, step: int) -> str:
        return self.url_of(self.step_path(step))

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r})"

    def warm_data_plane(self) -> threading.Thread | None:
        """Build the store's clients on a daemon thread, once per store: the filesystem's, then the
        payload's (``store/warmup.py``; the first use of :attr:`fs` waits for the filesystem's). Returns
        the thread building the payload's clients (None: fsspec moves them, nothing to build, no thread)."""
        self._start_warm_up()
        return self._warming

    def _start_warm_up(self) -> ClientWarmUp | None:
        """Build the filesystem's client, then the payload clients, on a daemon thread, once per store,
        while the caller goes on (``store/warmup.py``); ``None`` when there is nothing to build (the
        local disk, ``memory://``). The first use of :attr:`fs` waits for the filesystem's client."""
        if self.warm_up is not None:
            return self.warm_up
        fs, connects = self._fs, backend_of_fs(self._fs).connects
        plane = self.data_plane
        warms_plane = dataplane.builds_clients(plane, fs)
        if connects is None and not warms_plane:
            return None
        self.warm_up = ClientWarmUp(
            functools.partial(connects, fs) if connects is not None else None,
            functools.partial(plane.warm, self.root) if warms_plane else None,
            self.url,
        )
        if warms_plane:
            self._warming = self.warm_up.thread  # what warm_data_plane() returns
        self.warm_up.start()
        return self.warm_up

    # ---------------------------------------------------------------- reading
    def step_folders(self, entries: list[str] | None = None) -> dict[int, str]:
        """Every ``step-N`` folder of this run, committed or not (one listing; ``entries``: the run
        folder's listing taken just before, e.g. by the preflight's probe).

        A step folder that is a symbolic link (another run's checkpoint linked in) is not this
        run's: it is left out with a warning, so nothing here reads it as ours or deletes through it.
        So is a local entry named so that is no readable folder (a file, fifo, socket: ``layout.local_stray``).
        """
        if entries is None:
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
                self._warn_once(
                    step, f"spot_callbacks: ignoring {self.step_url(step)}: {self._foreign(step)}"
                )
                continue
            if (stray := layout.local_stray(self.fs, self.step_path(step), folder=True)) is not None:
                self._warn_once(step, f"spot_callbacks: ignoring {self.step_url(step)}: {_stray(stray)}")
                continue
            folders[step] = self.step_path(step)
        return folders

    def _refuse_foreign(self, step: int) -> None:
        """Raise :class:`ForeignCheckpointError` when the folder of ``step`` is a symbolic link, or (local
        disk: ``layout.local_stray``) not a readable folder, or its ``manifest.json`` not a regular file."""
        if layout.is_link(self.fs, self.step_path(step)):
            raise ForeignCheckpointError(f"{self.step_url(step)}: {self._foreign(step)}")
        if (stray := layout.local_stray(self.fs, self.step_path(step), folder=True)) is not None:
            raise ForeignCheckpointError(f"{self.step_url(step)}: {_stray(stray)}")
        manifest = posixpath.join(self.step_path(step), MANIFEST_NAME)
        if (stray := layout.local_stray(self.fs, manifest, folder=False)) is not None:
            raise ForeignCheckpointError(f"{self.url_of(manifest)}: {_stray(stray)}")

    def _foreign(self, step: int) -> str:
        target = os.readlink(self.step_path(step))
        return (
            f"it is a symbolic link to {target}, another run's checkpoint, not this run's: "
            "never read as this run's, never deleted through"
        )

    def committed(self) -> list[CheckpointInfo]:
        """Every checkpoint whose manifest exists and parses, oldest first (rule 1); one that does
        not parse is skipped with a warning naming it and the reason.

        Reads one listing and the manifests (fetched concurrently by async filesystems), never a payload.
        """
        return self._infos(manifest_verdicts(self))

    def _infos(self, verdicts: list[protocol.Verdict]) -> list[CheckpointInfo]:
        infos = []
        for verdict in verdicts:
            if verdict.info is None:
                self._warn_once(
                    verdict.step, f"spot_callbacks: ignoring checkpoint {verdict.url}: {verdict.problem}"
                )
            else:
                infos.append(verdict.info)
        return infos

    def read_manifest(self, step: int) -> CheckpointInfo:
        """The parsed manifest of one step; :class:`CheckpointNotFoundError` if it has none."""
        path = posixpath.join(self.step_path(step), MANIFEST_NAME)
        limits = ManifestLimits.from_env()
        try:
            self._refuse_foreign(step)
            raw = self.retry.call(lambda: transfer.get_bytes(self.fs, path), f"read {self.url_of(path)}")
        except (FileNotFoundError, ForeignCheckpointError) as err:
            why = (
                f"no {MANIFEST_NAME} in {self.step_url(step)}" if isinstance(err, FileNotFoundError) else err
            )
            raise CheckpointNotFoundError(
                f"no committed checkpoint at step {step} in {self.url} ({why})"
            ) from None
        return parse_manifest(raw, step, self.step_url(step), limits)

    def _verdicts_of(
        self, folders: dict[int, str], raws: dict[int, bytes] | None = None
    ) -> list[protocol.Verdict]:
        """:func:`manifest_verdicts` of the step ``folders`` (step -> path), in one concurrent read; a
        ``manifest.json`` that is not a regular file (a fifo would block forever) or that the store
        will not let us read is damage, never read. ``raws``: given, it gets the bytes of each manifest
        that parsed (step -> bytes), for a pull of that checkpoint not to read them again."""
        manifests = {step: posixpath.join(path, MANIFEST_NAME) for step, path in folders.items()}
        if not manifests:
            return []
        limits = ManifestLimits.from_env()
        unreadable = {}
        for step, path in manifests.items():
            if (stray := layout.local_stray(self.fs, path, folder=False)) is not None:
                unreadable[step] = f"{self.url_of(path)}: {_stray(stray)}"
        readable = [path for step, path in manifests.items() if step not in unreadable]
        raw_by_path = _read_manifests(self, readable, unreadable, {path: s for s, path in manifests.items()})
        verdicts = [
            protocol.Verdict(step, self.step_url(step), None, unreadable[step])
            if step in unreadable
            else protocol.manifest_verdict(
                step, self.step_url(step), raw_by_path.get(manifests[step]), limits
            )
            for step in sorted(manifests)
        ]
        if raws is not None:
            for verdict in verdicts:
                raw = raw_by_path.get(manifests[verdict.step]) if verdict is not None else None
                if verdict is not None and verdict.info is not None and isinstance(raw, bytes):
                    raws[verdict.step] = raw
        return [verdict for verdict in verdicts if verdict is not None]

    def _stored_times(self, folders: dict[int, str]) -> dict[int, float]:
        """:func:`stored_times` (for retention, which may not import this module)."""
        return stored_times(self, folders)

    def damage(self, info: CheckpointInfo, sizes: dict[str, int | None] | None = None) -> str | None:
        """Why the committed checkpoint ``info`` cannot be used (``None``: its files have the
        manifest's sizes): THE verdict, which :func:`newest_valid` and ``spot-callbacks ls`` share.

        A checkpoint deleted since it was listed is damaged; an unreachable store raises. ``sizes``:
        its files' sizes by name from a listing taken in the same call (:meth:`WalkReads.sizes_of`),
        not listed again; ``None``: its folder is listed.
        """
        try:
            self._check_sizes(info, sizes)
        except protocol.DAMAGE_ERRORS as err:
            return str(err) or type(err).__name__
        return None

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint whose files exist with the manifest's sizes, or ``None``.

        A checkpoint that fails the check is skipped with a warning naming it and the reason; it
        is never deleted here. With checkpoints of several lineages (a fresh run on an old
        dirpath), the lineage of the newest commit is followed (``commit.resume_order``): of the
        manifest the store wrote last, by the store's clock (:func:`stored_times`), so no writer's
        skewed clock moves it; a manifest's own ``created`` only where the store gives no time.

        Thousands of step folders cost a listing or two and a batch or two of manifest reads
        (:func:`walk_down`: :data:`LATEST_BATCH` at a time, from the highest step down).
        """
        return _walk_down(self)

    def _check_sizes(self, info: CheckpointInfo, sizes: dict[str, int | None] | None = None) -> None:
        """Raise :class:`CorruptCheckpointError` unless every payload file exists with its manifest size
        (``sizes``: as listed already, see :meth:`damage`)."""
        folder = self.step_path(info.step)
        if sizes is None:
            sizes = transfer.file_sizes(self.fs, self.retry, folder, f"list {info.url}")
        protocol.check_size_problem(info, sizes)
        if self._is_local:  # a fifo listed with size 0 would block verify and pull forever
            for name in info.files:
                if (
                    stray := layout.local_stray(self.fs, posixpath.join(folder, name), folder=False)
                ) is not None:
                    raise CorruptCheckpointError(f"{info.url}/{name}: {stray}")

    def verify(self, step: int, deep: bool = True, *, meter: TransferMeter | None = None) -> bool:
        """True when the checkpoint is committed and intact; otherwise an exception saying what is wrong.

        ``deep`` (the default) reads every payload byte and compares checksums; ``deep=False``
        checks existence and sizes only. ``meter`` is told the bytes read.
        """
        info = self.read_manifest(step)
        self._check_sizes(info)
        if deep:
            transfer.verify_checksums(payload_plane(self), self.retry, info, self.step_path(step), meter)
        return True

    def _warn_once(self, step: int, message: str) -> None:
        """Log ``message`` about ``step`` once per store (a listing repeats, its warnings need not)."""
        if (step, message) not in self._warned:
            self._warned.add((step, message))
            log.warning(message)

    # ---------------------------------------------------------------- pulling
    def pull(
        self,
        step: int | None,
        dest: str | os.PathLike[str],
        *,
        force: bool = False,
        meter: TransferMeter | None = None,
    ) -> Path:
        """Download a committed checkpoint into the local folder ``dest`` and verify it; return ``dest``.

        ``step=None`` pulls :meth:`latest`. Files are fetched in parallel into a hidden sibling
        folder that is renamed to ``dest`` only once complete and verified, so an interrupted pull
        never leaves a folder that looks complete. When ``dest`` already holds this checkpoint
        (same manifest, files verified) nothing is downloaded. A ``dest`` that holds anything but
        this run's checkpoint files is refused (:class:`UnsafeDestinationError`) unless ``force``;
        a symbolic link, a file and the current directory (or above) always are. ``meter``: the bytes.
        """
        if step is None:
            info = self.latest()
            if info is None:
                raise CheckpointNotFoundError(f"no committed checkpoint in {self.url}")
        else:
            info = self.read_manifest(step)
        return pull_checkpoint(self, info, dest, force=force, meter=meter)

    # ---------------------------------------------------------------- deleting
    def delete(self, step: int) -> None:
        """Delete one checkpoint: its manifest first (it stops counting), then its payload.

        Each part is confirmed gone before the next: a store that answers a delete as done but
        keeps objects raises :class:`DeleteIncompleteError` naming them, and a manifest that stayed
        keeps its payload (the checkpoint stays committed and whole). A step folder that is a
        symbolic link is another run's: :class:`ForeignCheckpointError`.
        """
        delete_step(self, step)

    def _exists(self, path: str) -> bool:
        return self.retry.call(lambda: layout.exists_fresh(self.fs, path), f"check {self.url_of(path)}")

    def prune(
        self,
        keep_last: int,
        lineage: str | None = FOLLOWED_LINEAGE,
        protected: Iterable[int] = (),
        vouched: Iterable[int] | None = None,
    ) -> list[int]:
        """Keep the newest ``keep_last`` valid checkpoints of ``lineage`` (0 keeps all); return the steps deleted.

        ``lineage`` defaults to :data:`FOLLOWED_LINEAGE`: the one ``latest()`` follows (the newest
        commit's). Damaged checkpoints are neither counted nor deleted, another lineage's are never
        touched, nor are the ``protected`` steps (see ``commit.retention_victims``); with ``vouched``
        (a run's own commits and resume point) only those count toward ``keep_last``. Only checkpoints this call saw
        committed are touched, so a commit racing the prune is safe. A checkpoint the store would
        not (wholly) delete is logged with what stayed and not returned. What it costs, and what
        this store remembers between calls to bound it: :mod:`~spot_callbacks.store.retention`.
        """
        return retention.prune(self, keep_last, lineage, protected, FOLLOWED_LINEAGE, vouched)


def pull_checkpoint(
    store: CheckpointStore,
    info: CheckpointInfo,
    dest: str | os.PathLike[str],
    *,
    force: bool = False,
    meter: TransferMeter | None = None,
    manifest: bytes | None = None,
) -> Path:
    """:meth:`CheckpointStore.pull` of ``info``, a manifest read already (not read again to start).

    ``manifest``: the bytes ``info`` was parsed from, read in this same resume (:class:`WalkReads`),
    written as the pulled folder's manifest once the files match it (parsed and compared again, never
    trusted more than a read would be); ``None``: the store's manifest is read again after the files
    and must still be ``info`` (else the pull is damaged, nothing kept).
    """
    target = Path(os.path.abspath(Path(dest).expanduser()))
    if transfer.local_copy_matches(info, target):
        log.info("spot_callbacks: %s already holds %s; not downloading", target, info.url)
        return target

    def committed(step: int) -> CheckpointInfo | None:
        return info if manifest is not None and step == info.step else committed_at(store, step)

    check_pull_dest(store.url, committed, info, target, force=force)
    return transfer.pull_into(
        store.fs, payload_plane(store), store.retry, info, store.step_path(info.step), target, meter,
        manifest=manifest,
    )  # fmt: skip


def _stray(why: str) -> str:
    return (
        f"{why}; no run wrote that, so it is never read as a checkpoint nor deleted here (remove it by hand)"
    )


def manifest_verdicts(store: CheckpointStore) -> list[protocol.Verdict]:
    """Every step folder of ``store`` holding a manifest, oldest first, with the manifest parsed or
    why it cannot be trusted (one listing and the manifests, none parsed past
    ``SPOT_MANIFEST_MAX_BYTES``; never a payload): what ``spot-callbacks ls`` lists."""
    return store._verdicts_of(store.step_folders())


def newest_valid(
    store: CheckpointStore,
    infos: list[CheckpointInfo],
    on_damaged: Callable[[CheckpointInfo, str], None] | None = None,
) -> CheckpointInfo | None:
    """The newest of ``infos`` (oldest first) whose files have the manifest's sizes; each one
    skipped goes to ``on_damaged(info, reason)`` (default: a warning), none is deleted."""
    for info in reversed(infos):
        problem = store.damage(info)
        if problem is None:
            return info
        if on_damaged is not None:
            on_damaged(info, problem)
        else:
            store._warn_once(info.step, protocol.damaged_message(info.url, problem))
    return None


def committed_at(store: CheckpointStore, step: int) -> CheckpointInfo | None:
    """The manifest of ``step`` in ``store`` when it is committed, else ``None``."""
    try:
        return store.read_manifest(step)
    except (CheckpointNotFoundError, ManifestError):
        return None


def refuse_foreign(store: CheckpointStore, step: int) -> None:
    """Raise :class:`ForeignCheckpointError` when the folder of ``step`` is a symbolic link, or (local
    disk: ``layout.local_stray``) not a readable folder, or its ``manifest.json`` not a regular file."""
    store._refuse_foreign(step)


def payload_plane(store: CheckpointStore) -> DataPlane:
    """The data plane that moves payload bytes now: ``store.data_plane`` when it serves ``store.fs``,
    else fsspec on ``store.fs`` (said once in the log, with the reason)."""
    plane = dataplane.plane_for(store.data_plane, store.fs)
    dataplane.announce(store.url, plane)
    return plane


def delete_step(store: CheckpointStore, step: int) -> bool:
    """:meth:`CheckpointStore.delete`; whether the step had a manifest (the writer's ``begin`` says so)."""
    folder = store.step_path(step)
    store._refuse_foreign(step)
    manifest = posixpath.join(folder, MANIFEST_NAME)
    had_manifest = store._exists(manifest)
    if had_manifest:
        url = f"{store.step_url(step)}/{MANIFEST_NAME}"
        store.retry.call(lambda: layout.remove_file(store, manifest), f"delete {url}")
        if store._exists(manifest):
            raise DeleteIncompleteError(
                f"the store kept {url} although it answered the delete as done (a bucket policy or an "
                f"object lock?): checkpoint {store.step_url(step)} is still committed, its files untouched",
                [url],
            )
    if store._exists(folder):
        retention.remove_folder(store, folder, f"delete {store.url_of(folder)}")
        remaining = sorted(transfer.file_sizes(store.fs, store.retry, folder, f"list {store.url_of(folder)}"))
        if remaining:
            urls = [f"{store.url_of(folder)}/{name}" for name in remaining]
            raise DeleteIncompleteError(
                f"the store kept {len(urls)} file(s) of {store.url_of(folder)} although it answered the "
                f"delete as done: {', '.join(urls[:5])}{' ...' if len(urls) > 5 else ''} (its manifest is "
                "gone: it is no longer committed)",
                urls,
            )
    return had_manifest


def _read_manifests(
    store: CheckpointStore, paths: list[str], unreadable: dict[int, str], step_of: dict[str, int]
) -> dict[str, bytes | FileNotFoundError]:
    """The bytes of every manifest in ``paths``; one the store refuses (PermissionError) goes
    to ``unreadable`` with why, and the others are still read."""
    if not paths:
        return {}
    what = f"read manifests under {store.url}"
    # A ranged read would bound the download too, but backends answer a range past the end of a
    # small or empty object differently (InvalidRange); the size is checked before parsing.
    try:
        return transfer.read_files(store.fs, store.retry, paths, store.root, what)
    except (PermissionError, IsADirectoryError):
        if len(paths) == 1:
            raise
    found: dict[str, bytes | FileNotFoundError] = {}
    for path in paths:  # which one: read them one by one
        try:
            found.update(_read_manifests(store, [path], unreadable, step_of))
        except (PermissionError, IsADirectoryError) as err:
            unreadable[step_of[path]] = f"{store.url_of(path)} cannot be read: {err.strerror or err}"
    return found


def stored_times(
    store: CheckpointStore, folders: dict[int, str], listing: dict[str, Any] | None = None
) -> dict[int, float]:
    """When the store wrote the manifest of each step folder in ``folders`` (step -> path), by the
    store's own clock, where it says (``commit.stored_time``): what orders the lineages.

    One recursive listing of the run folder (object stores: 1,000 keys a request; ``listing``: one
    taken already, :func:`_root_listing`), never a request per checkpoint; on the local disk the
    ``mtime`` of each manifest (no symbolic link followed). A store that gives no time, or a
    listing that fails, gives none: the manifests' ``created`` decide.
    """
    wanted = {posixpath.join(path, MANIFEST_NAME): step for step, path in folders.items()}
    if not wanted:
        return {}
    if store._is_local:
        found = {}
        for path, step in wanted.items():
            with contextlib.suppress(OSError):
                found[step] = os.lstat(path).st_mtime
        return found
    if listing is None:
        listing = _root_listing(store)
    times = {}
    for path, entry in listing.items():
        listed = wanted.get(path.rstrip("/"))
        if listed is not None and (stamp := protocol.stored_time(entry)) is not None:
            times[listed] = stamp
    return times


def _root_listing(store: CheckpointStore) -> dict[str, Any]:
    """Every object under the run folder with its details (path -> entry); none where the listing fails."""
    try:
        listing: dict[str, Any] = store.retry.call(
            lambda: store.fs.find(store.root, withdirs=False, detail=True), f"list {store.url}"
        )
        return listing
    except FileNotFoundError:
        return {}
    except Exception as err:  # noqa: BLE001 - without the store's times, the manifests' own decide
        log.warning(
            "spot_callbacks: could not list when %s's manifests were written (%s); ordering its lineages "
            "by the times their manifests say instead", store.url, err,
        )  # fmt: skip
        return {}


@dataclass(frozen=True)
class RunListing:
    """The run folder's listings taken ahead of a resume (``preflight.probe_listings``): its entries,
    and every object under it with its details (``objects``; ``None``: not taken, or that listing failed)."""

    entries: list[str]
    objects: dict[str, Any] | None = None


def folders_and_times(
    store: CheckpointStore, taken: RunListing | None = None
) -> tuple[dict[int, str], dict[int, float]]:
    """:meth:`CheckpointStore.step_folders` and :func:`stored_times` of them. On an object store the
    two listings go out at once (one round trip, not two: 25 ms less per resume on a cloud link);
    neither depends on the other's answer, and both come before any manifest is read. ``taken``: the
    listings the preflight's probe took just before (what it lacks is listed here; with no step folder
    there is no time to list)."""
    folders, stored_at, _ = _folders_times_objects(store, taken)
    return folders, stored_at


def _folders_times_objects(
    store: CheckpointStore, taken: RunListing | None
) -> tuple[dict[int, str], dict[int, float], dict[str, Any] | None]:
    """:func:`folders_and_times`, and the recursive listing of the run folder they used (``None``: none
    taken, the local disk, or it failed)."""
    if taken is not None:
        folders = store.step_folders(taken.entries)
        if not folders:
            return folders, {}, None
        objects = taken.objects
        if objects is None and not store._is_local:
            objects = _root_listing(store)
        return folders, stored_times(store, folders, objects), objects
    if store._is_local:
        folders = store.step_folders()
        return folders, stored_times(store, folders), None
    answer: list[dict[str, Any]] = []
    lister = threading.Thread(
        target=lambda: answer.append(_root_listing(store)), name="spot-list", daemon=True
    )
    lister.start()
    try:
        folders = store.step_folders()
    finally:
        lister.join()
    objects = answer[0] if answer else None
    return folders, stored_times(store, folders, objects or {}), objects


@dataclass
class WalkReads:
    """What one :func:`walk_down` read on its way (the run folder's recursive listing, the manifests'
    bytes), for the damage check and the pull of the same resume to use rather than read again.

    Made by the caller for one walk and dropped with it: never a cache across resumes (a later one
    lists and reads afresh).
    """

    objects: dict[str, Any] | None = None  # path -> details, as fs.find(detail=True) gives them
    manifests: dict[int, bytes] = field(default_factory=dict)  # step -> the manifest bytes parsed

    def sizes_of(self, store: CheckpointStore, info: CheckpointInfo) -> dict[str, int | None] | None:
        """The sizes of the files in ``info``'s folder (name -> size) from the listing, or ``None`` (list
        the folder) unless the listing vouches for them: an object store's, holding this step's
        ``manifest.json`` with the size of the bytes ``info`` was parsed from. The manifest is written
        after its files (rule 1), so a listing that holds it holds them as they were at the commit; one
        taken before the commit (or before another commit of the same step) does not hold that manifest.
        """
        raw = self.manifests.get(info.step)
        if self.objects is None or raw is None or store._is_local:
            return None
        folder = store.step_path(info.step).rstrip("/") + "/"
        sizes: dict[str, int | None] = {}
        for path, entry in self.objects.items():
            if path.startswith(folder):
                sizes[path[len(folder) :]] = entry.get("size") if isinstance(entry, dict) else None
        if sizes.get(MANIFEST_NAME) != len(raw):
            return None
        return sizes


def lineage_ordered(
    store: CheckpointStore, infos: list[CheckpointInfo]
) -> tuple[list[CheckpointInfo], dict[int, float]]:
    """``infos`` (oldest first) in the order :meth:`CheckpointStore.latest` tries them, reversed (the
    current lineage, of the manifest the store wrote last, last: ``commit.resume_order``), and the
    store's times of their manifests (:func:`stored_times`): what ``spot-callbacks ls`` and ``report`` follow."""
    stored_at = stored_times(store, {info.step: store.step_path(info.step) for info in infos})
    return protocol.resume_order(infos, stored_at), stored_at


def _walk_down(store: CheckpointStore) -> CheckpointInfo | None:
    """:meth:`CheckpointStore.latest`: the newest checkpoint of :func:`walk_down` whose sizes match."""
    return walk_down(store, store.damage)[0]


# The first batch of manifests read also holds the ones the store wrote last (a fresh run's low
# steps below an old lineage's thousands), so the current lineage is known from it.
NEWEST_STORED_FIRST = 4


def walk_down(
    store: CheckpointStore,
    problem_of: Callable[[CheckpointInfo], str | None],
    own: str | None = None,
    taken: RunListing | None = None,
    reads: WalkReads | None = None,
) -> tuple[CheckpointInfo | None, list[CheckpointInfo]]:
    """The newest checkpoint ``problem_of`` finds nothing wrong with (``None``: a problem, said once
    as damage), and the checkpoints read on the way, oldest first.

    One listing and :func:`stored_times`' (at once: :func:`folders_and_times`), then the manifests, :data:`LATEST_BATCH` at a time: the
    :data:`NEWEST_STORED_FIRST` the store wrote last, then from the highest step down. The current
    lineage (``commit.current_lineage``: of the manifest the store wrote last) is tried from its
    highest step down, and only when none of it is valid another lineage's, highest first
    (``commit.resume_order``; ``own``: the asking run's lineage, while it runs). Each checkpoint is
    judged once, so a resume that pulls each candidate to judge it pulls none twice. ``taken``: the
    listings taken just before (:class:`RunListing`), not taken again. ``reads``: given, it gets what
    was read on the way (:class:`WalkReads`), for ``problem_of`` to use rather than read it again.
    """
    folders, stored_at, objects = _folders_times_objects(store, taken)
    if reads is not None:
        reads.objects = objects
    newest_stored = sorted(stored_at, key=lambda step: (stored_at[step], step))[-NEWEST_STORED_FIRST:]
    order = [*reversed(newest_stored), *(s for s in sorted(folders, reverse=True) if s not in newest_stored)]
    by_step: dict[int, CheckpointInfo] = {}
    judged: dict[int, str | None] = {}

    def valid(info: CheckpointInfo) -> bool:
        if info.step not in judged:
            problem = judged[info.step] = problem_of(info)
            if problem is not None:
                store._warn_once(info.step, protocol.damaged_message(info.url, problem))
        return judged[info.step] is None

    for start in range(0, len(order), LATEST_BATCH):
        end = start + LATEST_BATCH
        batch = {step: folders[step] for step in order[start:end]}
        read = store._verdicts_of(batch, reads.manifests if reads is not None else None)
        by_step.update((info.step, info) for info in store._infos(read))
        seen = [by_step[step] for step in sorted(by_step)]
        lineage = protocol.current_lineage(seen, stored_at, own)
        # The highest step not read yet: one found below it (read early, as the store's newest) waits.
        unread_top = order[end] if end < len(order) else -1
        for info in reversed(seen):
            if protocol.lineage_of(info) == lineage and info.step > unread_top and valid(info):
                return info, seen
    seen = [by_step[step] for step in sorted(by_step)]
    found = next(
        (info for info in reversed(protocol.resume_order(seen, stored_at, own)) if valid(info)), None
    )
    return found, seen
