"""`CheckpointStore`: the remote layout and the commit protocol over any fsspec filesystem.

A checkpoint is the folder ``<dirpath>/step-<09d>/`` and it is committed iff its
``manifest.json`` exists and parses. The manifest is written last, with one single-object PUT
(atomic on S3, GCS and Azure; rename is not), and lists every payload file with its size and
checksum. Retention deletes a manifest before the payload it describes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import re
import shutil
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import fsspec

from spot_callbacks.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ManifestError,
)
from spot_callbacks.store.checksums import (
    CHECKSUM_ALGORITHM,
    FileDigest,
    checksum_algorithm,
    digest_chunks,
    digest_local_file,
    read_blocks,
)
from spot_callbacks.store.layout import DCP_METADATA_FILE, fs_protocols
from spot_callbacks.store.retry import RetryPolicy, UploadTimeout, call_with_timeout

log = logging.getLogger("spot_callbacks")

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "spot_callbacks.checkpoint"
FORMAT_VERSION = 1
REASONS = ("interval", "steps", "preemption", "exception", "end", "manual")
_STEP_DIR = re.compile(r"^step-(\d{9,})$")
_TRANSFER_THREADS = 8


def step_dirname(step: int) -> str:
    """The folder name of a step: zero-padded so names sort like numbers.

    Example:
        >>> step_dirname(12000)
        'step-000012000'
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be an integer >= 0")
    return f"step-{step:09d}"


def parse_step_dirname(name: str) -> int | None:
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class CheckpointInfo:
    """What a committed checkpoint's manifest says about it.

    Example:
        >>> store = CheckpointStore("memory://doc-info")
        >>> [info.step for info in store.committed()]
        []
    """

    step: int
    url: str
    created: datetime
    reason: str
    size_bytes: int
    framework: str
    epoch: int | None = None
    files: dict[str, FileDigest] = field(default_factory=dict, repr=False)
    metrics: dict[str, Any] = field(default_factory=dict, repr=False)
    extra: dict[str, Any] = field(default_factory=dict, repr=False)


def new_manifest(
    step: int,
    files: dict[str, FileDigest],
    *,
    reason: str,
    framework: str,
    epoch: int | None = None,
    metrics: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    created: datetime | None = None,
) -> dict[str, Any]:
    """The manifest document for a checkpoint whose payload files are all durable."""
    if reason not in REASONS:
        raise ValueError(f"reason={reason!r} is not one of {list(REASONS)}")
    for name in files:
        _check_relative_name(name)
    return {
        "format": MANIFEST_FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "epoch": epoch,
        "created": (created or datetime.now(timezone.utc)).isoformat(),
        "framework": framework,
        "reason": reason,
        "checksum_algorithm": CHECKSUM_ALGORITHM,
        "files": {name: digest.to_json() for name, digest in sorted(files.items())},
        "metrics": metrics or {},
        "extra": extra or {},
    }


def _check_relative_name(name: Any) -> str:
    """Reject payload names that would escape the checkpoint folder when joined to it."""
    if (
        not isinstance(name, str)
        or not name
        or "\\" in name
        or "://" in name
        or name.startswith("/")
        or re.match(r"^[A-Za-z]:", name)
        or any(part in ("", ".", "..") for part in name.split("/"))
        or name == MANIFEST_NAME
    ):
        raise ManifestError(
            f"payload name {name!r} is not a plain relative path inside the checkpoint folder"
        )
    return name


def parse_manifest(raw: bytes, step: int, url: str) -> CheckpointInfo:
    """Validate a manifest's bytes; raise :class:`ManifestError` saying what is wrong."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ManifestError(f"{url}/{MANIFEST_NAME} is not valid JSON ({err})") from None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"{url}/{MANIFEST_NAME} is not a spot_callbacks manifest")
    version = doc.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise ManifestError(f"{url}/{MANIFEST_NAME} has no valid format_version")
    if version > FORMAT_VERSION:
        raise ManifestError(
            f"{url}/{MANIFEST_NAME} has format_version {version}, newer than this spot_callbacks "
            f"reads ({FORMAT_VERSION}); upgrade spot_callbacks to use it"
        )
    if doc.get("step") != step:
        raise ManifestError(
            f"{url}/{MANIFEST_NAME} says step {doc.get('step')!r} but lies in the folder of step {step}"
        )
    files_doc = doc.get("files")
    if not isinstance(files_doc, dict):
        raise ManifestError(f"{url}/{MANIFEST_NAME} has no 'files' table")
    files: dict[str, FileDigest] = {}
    for name, entry in files_doc.items():
        _check_relative_name(name)
        size = entry.get("size") if isinstance(entry, dict) else None
        checksum = entry.get("checksum") if isinstance(entry, dict) else None
        if isinstance(size, bool) or not isinstance(size, int) or size < 0 or not isinstance(checksum, str):
            raise ManifestError(f"{url}/{MANIFEST_NAME} has a bad entry for {name!r}: {entry!r}")
        if checksum_algorithm(checksum) != CHECKSUM_ALGORITHM:
            raise ManifestError(
                f"{url}/{MANIFEST_NAME}: checksum algorithm of {name!r} is {checksum_algorithm(checksum)!r}; "
                f"this spot_callbacks reads {CHECKSUM_ALGORITHM!r}"
            )
        files[name] = FileDigest(size, checksum)
    try:
        created = datetime.fromisoformat(doc["created"])
    except (KeyError, TypeError, ValueError):
        raise ManifestError(f"{url}/{MANIFEST_NAME} has no valid 'created' time") from None
    if created.tzinfo is None:
        created = created.replace(tzinfo=timezone.utc)
    epoch = doc.get("epoch")
    return CheckpointInfo(
        step=step,
        url=url,
        created=created,
        reason=str(doc.get("reason", "")),
        size_bytes=sum(digest.size for digest in files.values()),
        framework=str(doc.get("framework", "")),
        epoch=epoch if isinstance(epoch, int) else None,
        files=files,
        metrics=doc.get("metrics") if isinstance(doc.get("metrics"), dict) else {},
        extra=doc.get("extra") if isinstance(doc.get("extra"), dict) else {},
    )


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
        self.fs, root = fsspec.core.url_to_fs(
            self.dirpath, **_with_upload_defaults(self.dirpath, storage_options)
        )
        self.root = root.rstrip("/") or root
        protocol, _ = fsspec.core.split_protocol(self.dirpath)
        # adlfs names itself "abfs"; report URLs in the protocol the user wrote (az://).
        self._protocol = protocol if protocol in fs_protocols(self.fs) else None
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
        url = self.fs.unstrip_protocol(path)
        if self._protocol and not url.startswith(f"{self._protocol}://"):
            url = f"{self._protocol}://{url.split('://', 1)[1]}"
        return url

    @property
    def is_local(self) -> bool:
        return bool({"file", "local"} & set(fs_protocols(self.fs)))

    def step_path(self, step: int) -> str:
        return posixpath.join(self.root, step_dirname(step))

    def step_url(self, step: int) -> str:
        return self.url_of(self.step_path(step))

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r})"

    # ---------------------------------------------------------------- reading
    def step_folders(self) -> dict[int, str]:
        """Every ``step-N`` folder under the run, committed or not (one listing)."""
        try:
            entries = self.retry.call(
                lambda: self.fs.ls(self.root, detail=False, refresh=True), f"list {self.url}"
            )
        except FileNotFoundError:
            return {}
        except TypeError:  # filesystems whose ls() takes no refresh argument
            entries = self.retry.call(lambda: self.fs.ls(self.root, detail=False), f"list {self.url}")
        folders = {}
        for entry in entries:
            step = parse_step_dirname(posixpath.basename(entry.rstrip("/")))
            if step is not None:
                folders[step] = posixpath.join(self.root, step_dirname(step))
        return folders

    def committed(self) -> list[CheckpointInfo]:
        """Every checkpoint whose manifest exists and parses, oldest first.

        Reads one listing and the manifests (fetched concurrently by async filesystems), never a payload.
        """
        folders = self.step_folders()
        if not folders:
            return []
        manifest_paths = {step: posixpath.join(path, MANIFEST_NAME) for step, path in folders.items()}
        raw_by_path = self._cat_many(list(manifest_paths.values()))
        infos = []
        for step in sorted(manifest_paths):
            raw = raw_by_path.get(manifest_paths[step])
            if raw is None or isinstance(raw, FileNotFoundError):
                continue  # no manifest: not committed (an upload in progress or abandoned)
            if isinstance(raw, BaseException):
                raise raw
            try:
                infos.append(parse_manifest(raw, step, self.step_url(step)))
            except ManifestError as err:
                self._warn_once(step, f"spot_callbacks: ignoring checkpoint {self.step_url(step)}: {err}")
        return infos

    def _cat_many(self, paths: list[str]) -> dict[str, bytes | BaseException]:
        def fetch() -> dict[str, bytes | BaseException]:
            if hasattr(self.fs, "invalidate_cache"):
                self.fs.invalidate_cache(self.root)
            result = self.fs.cat(paths, on_error="return")
            if len(paths) == 1 and not isinstance(result, dict):
                result = {paths[0]: result}
            retryable = [
                e
                for e in result.values()
                if isinstance(e, Exception) and not isinstance(e, FileNotFoundError)
            ]
            if retryable:
                raise retryable[0]
            return result

        return self.retry.call(fetch, f"read manifests under {self.url}")

    def read_manifest(self, step: int) -> CheckpointInfo:
        """The parsed manifest of one step; :class:`CheckpointNotFoundError` if it has none."""
        path = posixpath.join(self.step_path(step), MANIFEST_NAME)
        try:
            raw = self.retry.call(lambda: self.fs.cat_file(path), f"read {self.url_of(path)}")
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"no committed checkpoint at step {step} in {self.url} (no {MANIFEST_NAME} in {self.step_url(step)})"
            ) from None
        return parse_manifest(raw, step, self.step_url(step))

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint whose files exist with the manifest's sizes, or ``None``.

        A checkpoint that fails the check is skipped with a warning naming it and the reason; it
        is never deleted here.
        """
        return self.newest_valid(self.committed())

    def newest_valid(self, infos: list[CheckpointInfo]) -> CheckpointInfo | None:
        """The newest of ``infos`` (oldest first) whose files have the manifest's sizes; the others
        are skipped with a warning, never deleted."""
        for info in reversed(infos):
            try:
                self.check_sizes(info)
            except CorruptCheckpointError as err:
                self._warn_once(
                    info.step,
                    f"spot_callbacks: skipping damaged checkpoint {info.url}: {err}; trying the previous one",
                )
                continue
            return info
        return None

    def check_sizes(self, info: CheckpointInfo) -> None:
        """Raise :class:`CorruptCheckpointError` unless every payload file exists with its manifest size."""
        folder = self.step_path(info.step)
        try:
            listing = self.retry.call(
                lambda: self.fs.find(folder, detail=True, withdirs=False), f"list {info.url}"
            )
        except FileNotFoundError:
            listing = {}
        sizes = {posixpath.relpath(path, folder): entry.get("size") for path, entry in listing.items()}
        for name, digest in info.files.items():
            if name not in sizes:
                raise CorruptCheckpointError(f"{info.url}/{name} is missing")
            if sizes[name] != digest.size:
                raise CorruptCheckpointError(
                    f"{info.url}/{name} is {sizes[name]} bytes but the manifest says {digest.size} (truncated or replaced)"
                )

    def verify(self, step: int, deep: bool = True) -> bool:
        """True when the checkpoint is committed and intact; otherwise an exception saying what is wrong.

        ``deep`` (the default) reads every payload byte and compares checksums; ``deep=False``
        checks existence and sizes only.
        """
        info = self.read_manifest(step)
        self.check_sizes(info)
        if not deep:
            return True

        def check(name: str) -> None:
            path = posixpath.join(self.step_path(step), name)

            def read_digest() -> FileDigest:
                with self.fs.open(path, "rb") as handle:
                    return digest_chunks(read_blocks(handle))

            actual = self.retry.call(read_digest, f"read {info.url}/{name}")
            expected = info.files[name]
            if actual != expected:
                raise CorruptCheckpointError(
                    f"{info.url}/{name} does not match its manifest: checksum {actual.checksum} "
                    f"({actual.size} bytes), expected {expected.checksum} ({expected.size} bytes)"
                )

        _run_parallel(check, list(info.files))
        return True

    # ---------------------------------------------------------------- pulling
    def pull(self, step: int | None, dest: str | os.PathLike[str]) -> Path:
        """Download a committed checkpoint into the local folder ``dest`` and verify it; return ``dest``.

        ``step=None`` pulls :meth:`latest`. Files are fetched in parallel into a hidden sibling
        folder that is renamed to ``dest`` only once complete and verified, so an interrupted pull
        never leaves a folder that looks complete. When ``dest`` already holds this checkpoint
        (same manifest, files verified) nothing is downloaded.
        """
        if step is None:
            latest = self.latest()
            if latest is None:
                raise CheckpointNotFoundError(f"no committed checkpoint in {self.url}")
            info = latest
        else:
            info = self.read_manifest(step)
        dest_path = Path(dest)
        if self.local_copy_matches(info, dest_path):
            log.info("spot_callbacks: %s already holds %s; not downloading", dest_path, info.url)
            return dest_path
        dest_path.parent.mkdir(parents=True, exist_ok=True)
        staging = dest_path.parent / f".{dest_path.name}.partial-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
        try:
            folder = self.step_path(info.step)

            def fetch(name: str) -> None:
                local = staging / name
                local.parent.mkdir(parents=True, exist_ok=True)
                remote = posixpath.join(folder, name)
                self.retry.call(lambda: self.fs.get_file(remote, str(local)), f"download {info.url}/{name}")
                actual = digest_local_file(local)
                if actual != info.files[name]:
                    raise CorruptCheckpointError(
                        f"{info.url}/{name} downloaded as {actual.size} bytes with checksum {actual.checksum}; "
                        f"the manifest says {info.files[name].size} bytes, {info.files[name].checksum}"
                    )

            _run_parallel(fetch, list(info.files))
            (staging / MANIFEST_NAME).write_bytes(self._manifest_bytes(info))
            if dest_path.exists():
                shutil.rmtree(dest_path)
            os.replace(staging, dest_path)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return dest_path

    def local_copy_matches(self, info: CheckpointInfo, folder: Path) -> bool:
        """True when ``folder`` holds exactly this checkpoint: same manifest, every file verified."""
        manifest_file = folder / MANIFEST_NAME
        if not manifest_file.is_file():
            return False
        try:
            local = parse_manifest(manifest_file.read_bytes(), info.step, info.url)
        except ManifestError:
            return False
        if local.files != info.files or local.created != info.created:
            return False
        for name, digest in info.files.items():
            path = folder / name
            if not path.is_file() or path.stat().st_size != digest.size or digest_local_file(path) != digest:
                return False
        return True

    def _manifest_bytes(self, info: CheckpointInfo) -> bytes:
        path = posixpath.join(self.step_path(info.step), MANIFEST_NAME)
        return self.retry.call(lambda: self.fs.cat_file(path), f"read {info.url}/{MANIFEST_NAME}")

    # ---------------------------------------------------------------- writing
    # fs.rm, never fs.rm_file: adlfs and gcsfs inherit a sync rm_file that creates a coroutine
    # and never awaits it, so the object silently stays.
    def clear_stale_step(self, step: int) -> None:
        """Prepare the folder of ``step`` for a new checkpoint.

        A folder that already exists (a run that resumed from an older checkpoint reached this
        step again) loses its manifest first, so it is never committed with mixed payloads.
        """
        folder = self.step_path(step)
        manifest = posixpath.join(folder, MANIFEST_NAME)
        if self._exists(manifest):
            log.info("spot_callbacks: replacing the existing checkpoint %s", self.step_url(step))
            self.retry.call(lambda: self.fs.rm(manifest), f"delete {self.step_url(step)}/{MANIFEST_NAME}")
        if self._exists(folder):
            self._remove_tree(folder)

    def upload_file(self, local_path: str | os.PathLike[str], step: int, name: str) -> None:
        """Upload one payload file into the folder of ``step`` (multipart through the backend).

        An attempt still running after :attr:`upload_timeout` allows for its size is abandoned
        and retried like a failed one.
        """
        _check_relative_name(name)
        remote = posixpath.join(self.step_path(step), name)
        source = os.fspath(local_path)
        what = f"upload {self.step_url(step)}/{name}"
        timeout_s = self.upload_timeout.seconds_for(os.path.getsize(source))
        if self.is_local:
            self.fs.makedirs(posixpath.dirname(remote), exist_ok=True)
        # An abandoned attempt may wake up and finish after its retry did. It writes the same bytes
        # (scratch files are never rewritten in place) whole: an object PUT replaces the object at
        # once, and locally _put renames a finished copy. So a late write is harmless.
        self.retry.call(lambda: call_with_timeout(lambda: self._put(source, remote), timeout_s, what), what)

    def _put(self, source: str, remote: str) -> None:
        if not self.is_local:
            self.fs.put_file(source, remote)
            return
        folder, base = posixpath.split(remote)
        partial = posixpath.join(folder, f".{base}.{uuid.uuid4().hex[:8]}.part")
        try:
            self.fs.put_file(source, partial)
            _fsync_file(partial)
            os.replace(partial, remote)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(partial)
            raise

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
        local_root = Path(folder)
        known = dict(digests or {})

        def upload(name: str) -> tuple[str, FileDigest]:
            digest = known.get(name)
            with ThreadPoolExecutor(max_workers=1) as hasher:
                pending = None if digest else hasher.submit(digest_local_file, local_root / name)
                self.upload_file(local_root / name, step, name)
                digest = digest or pending.result()
            return name, digest

        return dict(_run_parallel(upload, names))

    def commit(self, manifest: dict[str, Any]) -> CheckpointInfo:
        """Write the manifest, which makes the checkpoint visible; every payload file must be durable."""
        step = manifest["step"]
        raw = json.dumps(manifest, indent=1, sort_keys=True).encode()
        info = parse_manifest(raw, step, self.step_url(step))
        path = posixpath.join(self.step_path(step), MANIFEST_NAME)
        if self.is_local:
            self._commit_local(path, raw)
        else:
            what = f"write {self.step_url(step)}/{MANIFEST_NAME}"
            timeout_s = self.upload_timeout.seconds_for(len(raw))
            self.retry.call(
                lambda: call_with_timeout(lambda: self.fs.pipe_file(path, raw), timeout_s, what), what
            )
        return info

    def _commit_local(self, path: str, raw: bytes) -> None:
        # A local write is not atomic, a rename is: write beside, fsync, rename, fsync the folder.
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{MANIFEST_NAME}.{uuid.uuid4().hex[:8]}.tmp")
        with open(tmp, "wb") as handle:
            handle.write(raw)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        _fsync_dir(folder)

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
        local_root = Path(folder)
        names = local_payload_names(local_root)
        if not names:
            raise CheckpointError(f"{local_root} holds no files to checkpoint")
        upload_started = time.perf_counter()
        self.clear_stale_step(step)
        files = self.upload_files(step, local_root, names, digests)
        # Known only now, and recorded with the rest: the manifest is the run's cost record (costs.py).
        metrics = {**(metrics or {}), "upload_s": round(time.perf_counter() - upload_started, 6)}
        manifest = new_manifest(
            step, files, reason=reason, framework=framework, epoch=epoch, metrics=metrics, extra=extra
        )
        return self.commit(manifest)

    # ---------------------------------------------------------------- deleting
    def delete(self, step: int) -> None:
        """Delete one checkpoint: its manifest first (it stops counting), then its payload."""
        folder = self.step_path(step)
        manifest = posixpath.join(folder, MANIFEST_NAME)
        if self._exists(manifest):
            self.retry.call(lambda: self.fs.rm(manifest), f"delete {self.step_url(step)}/{MANIFEST_NAME}")
        if self._exists(folder):
            self._remove_tree(folder)

    def prune(self, keep_last: int) -> list[int]:
        """Keep the newest ``keep_last`` committed checkpoints (0 keeps all); return the steps deleted.

        The newest *valid* checkpoint is never deleted, even when newer damaged ones exist.
        Only checkpoints this call saw committed are touched, so a commit racing the prune is safe.
        """
        if keep_last < 0:
            raise ValueError(f"keep_last={keep_last!r} must be >= 0")
        if keep_last == 0:
            return []
        committed = self.committed()
        if len(committed) <= keep_last:
            return []
        newest = self.newest_valid(committed)
        newest_valid = newest.step if newest is not None else None
        deleted = []
        for info in committed[:-keep_last]:
            if info.step == newest_valid:
                continue
            self.delete(info.step)
            log.info("spot_callbacks: retention deleted %s (keep_last=%d)", info.url, keep_last)
            deleted.append(info.step)
        return deleted

    # ---------------------------------------------------------------- helpers
    def _exists(self, path: str) -> bool:
        if hasattr(self.fs, "invalidate_cache"):
            self.fs.invalidate_cache(path)
        return self.retry.call(lambda: self.fs.exists(path), f"check {self.url_of(path)}")

    def _remove_tree(self, folder: str) -> None:
        def remove() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(folder, recursive=True)

        self.retry.call(remove, f"delete {self.url_of(folder)}")

    def _warn_once(self, step: int, message: str) -> None:
        if (step, message) not in self._warned:
            self._warned.add((step, message))
            log.warning(message)


def local_payload_names(folder: Path) -> list[str]:
    """Relative posix names of the files under a local checkpoint folder, manifest excluded."""
    names = []
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            name = path.relative_to(folder).as_posix()
            if name != MANIFEST_NAME and not _is_temporary(name):
                names.append(name)
    return names


def _is_temporary(name: str) -> bool:
    # Hidden files are writers' temporaries (ours and frameworks'), never payload, except DCP's
    # `.metadata` (HF/accelerate FSDP SHARDED_STATE_DICT, Lightning's sharded save): without it the
    # shards next to it cannot be loaded. DCP writes it as `.metadata.tmp` first, which stays out.
    *folders, base = name.split("/")
    return any(part.startswith(".") for part in folders) or (
        base.startswith(".") and base != DCP_METADATA_FILE
    )


# s3fs uploads a file's parts max_concurrency at a time, each held twice in RAM (the part and
# botocore's copy): 10 (its default) x 50 MiB x 2 is ~1 GB per file in flight, beside the staged
# checkpoint itself. 4 keeps it near 420 MB; storage_options={"max_concurrency": N} overrides.
S3_UPLOAD_CONCURRENCY = 4


def _with_upload_defaults(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    options = dict(storage_options or {})
    protocol, _ = fsspec.core.split_protocol(url)
    if protocol in ("s3", "s3a"):
        options.setdefault("max_concurrency", S3_UPLOAD_CONCURRENCY)
    return options


def _run_parallel(fn: Any, items: Iterable[Any]) -> list[Any]:
    items = list(items)
    if len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(_TRANSFER_THREADS, len(items))) as pool:
        return list(pool.map(fn, items))


def _fsync_file(path: str) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
