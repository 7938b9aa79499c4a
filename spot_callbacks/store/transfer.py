"""Moving bytes: parallel uploads, pulls and checksum reads, per-attempt timeouts, and the local disk.

Payload files move through a data plane (:mod:`~spot_callbacks.store.dataplane`: the fastest client
for the protocol, else fsspec); manifests and small objects through the fsspec filesystem itself.

Every call goes through a :class:`~spot_callbacks.store.retry.RetryPolicy`, so each attempt is
bounded: uploads by :class:`~spot_callbacks.store.retry.UploadTimeout` for their size, payload
reads by :meth:`~spot_callbacks.store.retry.RetryPolicy.timeout_for` theirs, the rest by the
policy's ``attempt_timeout_s``.

An object PUT replaces the object whole, and a local write does not: on the local disk every
file is written beside its final name, fsynced and renamed (:func:`put_file`, :func:`put_bytes`),
so a reader, or a late abandoned attempt, never sees or leaves half a file. This module knows
nothing of what makes a checkpoint committed (that is :mod:`spot_callbacks.store.commit`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import mmap
import os
import posixpath
import shutil
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

from spot_callbacks.errors import CorruptCheckpointError, ManifestError
from spot_callbacks.store.checksums import (
    CHECKSUM_ALGORITHM,
    FileDigest,
    StreamHash,
    checksum_algorithm,
    digest_local_file,
)
from spot_callbacks.store.layout import MANIFEST_NAME, is_local_fs
from spot_callbacks.store.manifest import CheckpointInfo, parse_manifest
from spot_callbacks.store.manifest_limits import ManifestLimits
from spot_callbacks.store.meter import TransferMeter
from spot_callbacks.store.retry import UPLOAD_TIMEOUT_FIX, RetryPolicy, UploadTimeout

if TYPE_CHECKING:
    from spot_callbacks.store.clients.base import DataPlane

log = logging.getLogger("spot_callbacks")
T = TypeVar("T")
TRANSFER_THREADS = 8


def run_parallel(fn: Callable[[Any], T], items: Iterable[Any]) -> list[T]:
    """``[fn(item) for item in items]``, on up to :data:`TRANSFER_THREADS` threads.

    Example:
        >>> run_parallel(len, ["a", "bb", "ccc"])
        [1, 2, 3]
    """
    items = list(items)
    if len(items) <= 1:
        return [fn(item) for item in items]
    # Daemon workers, not a ThreadPoolExecutor: an executor's threads are joined when its block ends
    # and again at interpreter exit, so a transfer stuck on a stalled server would keep a process that
    # was told to stop (a SIGTERM during a pull) from exiting. As with pool.map, every item started is
    # finished before an error is raised (the first one); after an error no new item starts.
    results: list[Any] = [None] * len(items)
    errors: list[BaseException] = []
    next_index = iter(range(len(items)))
    lock, done = threading.Lock(), threading.Event()
    workers = min(TRANSFER_THREADS, len(items))
    running = [workers]

    def work() -> None:
        try:
            while True:
                with lock:
                    index = None if errors else next(next_index, None)
                if index is None:
                    return
                try:
                    results[index] = fn(items[index])
                except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
                    with lock:
                        errors.append(err)
        finally:
            with lock:
                running[0] -= 1
                if running[0] == 0:
                    done.set()

    for number in range(workers):
        threading.Thread(target=work, name=f"spot-transfer-{number}", daemon=True).start()
    done.wait()  # interruptible: a signal handler's exception leaves the workers behind, as daemons
    if errors:
        raise errors[0]
    return results


def call_in_time(retry: RetryPolicy, fn: Callable[[], T], timeout_s: float | None, what: str) -> T:
    """``fn`` (an upload) retried by ``retry``, each attempt abandoned (and retried) after ``timeout_s``."""
    return retry.call(fn, what, timeout_s=timeout_s, fix=UPLOAD_TIMEOUT_FIX)


# ----------------------------------------------------------------- writing
def put_file(fs: Any, source: str, remote: str, callback: Any = None) -> None:
    """Upload a local file to ``remote``; on the local disk, atomically (copy beside, fsync, rename).
    ``callback``: fsspec's, told the bytes sent where the backend tells them."""
    told = {} if callback is None else {"callback": callback}
    if is_local_fs(fs):
        _replace_atomically(remote, ".part", lambda partial, handle: fs.put_file(source, partial, **told))
    else:
        fs.put_file(source, remote, **told)


def put_bytes(fs: Any, path: str, raw: bytes) -> None:
    """Write ``raw`` as one object; on the local disk write beside, fsync, rename, fsync the folder.

    Example:
        >>> import fsspec, tempfile
        >>> fs, folder = fsspec.filesystem("file"), tempfile.mkdtemp()
        >>> put_bytes(fs, f"{folder}/note.json", b"{}"); os.listdir(folder)
        ['note.json']
    """
    if is_local_fs(fs):
        _replace_atomically(path, ".tmp", lambda partial, handle: fs.pipe_file(partial, raw))
    else:
        fs.pipe_file(path, raw)


def write_local_atomically(path: Path, raw: bytes) -> None:
    """Write ``raw`` to the local ``path`` whole or not at all: a new temporary beside it, fsynced, renamed.

    A link planted at ``path`` is replaced, never written through.

    Example:
        >>> import tempfile
        >>> target = Path(tempfile.mkdtemp()) / "manifest.json"
        >>> write_local_atomically(target, b"{}"); target.read_bytes()
        b'{}'
    """
    _replace_atomically(os.fspath(path), ".tmp", lambda partial, handle: handle.write(raw))


# A new file only: an existing name, a planted symbolic link included, is never opened or followed.
_NEW_FILE_FLAGS = (
    os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
)
_TEMPORARY_NAME_TRIES = 8


def open_new_temporary(folder: str, base: str, suffix: str) -> tuple[str, BinaryIO]:
    """A hidden temporary beside ``base`` that did not exist before (``O_EXCL | O_NOFOLLOW``): its path, open.

    A name already taken (by a link someone planted, say) is skipped for another random one.

    Example:
        >>> import tempfile
        >>> path, handle = open_new_temporary(tempfile.mkdtemp(), "a.bin", ".tmp"); handle.close()
        >>> os.path.basename(path).startswith(".a.bin.") and path.endswith(".tmp")
        True
    """
    for _ in range(_TEMPORARY_NAME_TRIES):
        partial = os.path.join(folder, f".{base}.{uuid.uuid4().hex[:8]}{suffix}")
        try:
            return partial, os.fdopen(os.open(partial, _NEW_FILE_FLAGS, 0o666), "wb")
        except FileExistsError:
            continue
    raise FileExistsError(
        f"no free temporary name beside {os.path.join(folder, base)} after {_TEMPORARY_NAME_TRIES} tries"
    )


def _replace_atomically(path: str, suffix: str, write: Callable[[str, BinaryIO], object]) -> None:
    """Create a new temporary beside ``path``, ``write(temporary, handle)`` it (through the handle or the
    filesystem's own call on its path), check it is still the file created, fsync, rename, fsync the folder."""
    folder, base = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    partial, handle = open_new_temporary(folder, base, suffix)
    try:
        with handle:
            write(partial, handle)
            handle.flush()
            created, now = os.fstat(handle.fileno()), os.lstat(partial)
            if (created.st_dev, created.st_ino) != (now.st_dev, now.st_ino):
                raise OSError(f"{partial} was replaced while it was written; not renaming it to {base}")
            os.fsync(handle.fileno())
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise
    _fsync_dir(folder)


def upload_file(
    plane: DataPlane,
    retry: RetryPolicy,
    upload_timeout: UploadTimeout,
    source: str,
    remote: str,
    what: str,
    meter: TransferMeter | None = None,
    name: str = "",
    *,
    digest: bool = False,
) -> FileDigest | None:
    """Upload one file through the data ``plane``, each attempt abandoned after what ``upload_timeout``
    allows for its size; ``meter`` is told its bytes as ``name``. With ``digest``, return the digest
    of the bytes the succeeding attempt sent where the plane hashes what it sends, else ``None``."""
    timeout_s = upload_timeout.seconds_for(os.path.getsize(source))
    meter = meter or TransferMeter()
    # An abandoned attempt may wake up and finish after its retry did. It writes the same bytes
    # (scratch files are never rewritten in place) whole: an object PUT (a multipart upload's
    # completion included) replaces the object at once, and locally put_file renames a finished
    # copy. So a late write is harmless.
    sent = call_in_time(
        retry, lambda: plane.upload(source, remote, moved=meter.attempt(name), digest=digest), timeout_s, what
    )
    meter.file_done(name)
    return sent


MAPPED_WINDOW_BYTES = 16 * 1024 * 1024


def digest_mapped(path: str | os.PathLike[str], checksum_kind: str = CHECKSUM_ALGORITHM) -> FileDigest:
    """The digest of a local file read through 16 MiB memory maps: no copy out of the page cache, a
    third of the CPU of ``read()`` into a buffer (measured: 0.11 vs 0.3 CPU-s/GB), and the RSS
    of one window at a time.

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "a.bin"); _ = open(path, "wb").write(b"hello")
        >>> digest_mapped(path) == digest_local_file(path)
        True
    """
    with open(path, "rb", buffering=0) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size == 0:
            return digest_local_file(path, checksum_kind)
        hasher = StreamHash(checksum_kind)
        for offset in range(0, size, MAPPED_WINDOW_BYTES):
            length = min(MAPPED_WINDOW_BYTES, size - offset)
            with mmap.mmap(handle.fileno(), length, access=mmap.ACCESS_READ, offset=offset) as window:
                if hasattr(window, "madvise"):
                    window.madvise(mmap.MADV_SEQUENTIAL)
                hasher.update(window)
    return FileDigest(size, hasher.checksum())


def upload_with_digests(
    upload: Callable[[Path, str, bool], FileDigest | None],
    folder: Path,
    names: list[str],
    digests: dict[str, FileDigest] | None = None,
    meter: TransferMeter | None = None,
    *,
    hashes_as_it_sends: bool = False,
) -> dict[str, FileDigest]:
    """``upload(folder / name, name, wants_digest)`` for every name in parallel; return every file's digest.

    Digests known from writing the files are reused. The others come from the upload itself where
    the client hashes the bytes it reads to send them (``hashes_as_it_sends``, ``upload`` returning
    the digest: one read of each byte); else they are computed while the upload runs, one file
    after another in one thread, in the order the uploads start. An upload that could not hash
    what it sent (it returned ``None``) is hashed after it. ``meter`` learns the files' sizes
    (``upload`` tells it the bytes).
    """
    if meter is not None:
        meter.expect({name: (folder / name).stat().st_size for name in names})
    known = dict(digests or {})
    # One hashing thread, not one per file: the hash is a few hundredths of a CPU-second per GB and
    # keeps ahead of any upload, and 8 hashing threads beside 16 upload threads on 2 cores only add
    # switches. A failed upload cancels the hashes not started (none is left running for long).
    hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spot-hash")
    try:
        pending = {
            name: hasher.submit(digest_mapped, folder / name)
            for name in names
            if name not in known and not hashes_as_it_sends
        }

        def upload_one(name: str) -> tuple[str, FileDigest]:
            sent = upload(folder / name, name, name not in known)
            if name in known:
                return name, known[name]
            if name in pending:
                return name, pending[name].result()
            return name, sent if sent is not None else digest_mapped(folder / name)

        return dict(run_parallel(upload_one, names))
    finally:
        hasher.shutdown(wait=True, cancel_futures=True)


# ----------------------------------------------------------------- reading
_SPLITS_WHOLE_READS: dict[type, bool] = {}


def _splits_whole_reads(fs_class: type) -> bool:
    """True for a filesystem class whose whole-object read takes ``max_concurrency`` (s3fs, adlfs)."""
    found = _SPLITS_WHOLE_READS.get(fs_class)
    if found is None:
        method = getattr(fs_class, "_cat_file", None)
        try:
            found = method is not None and "max_concurrency" in inspect.signature(method).parameters
        except (TypeError, ValueError):
            found = False
        _SPLITS_WHOLE_READS[fs_class] = found
    return found


def whole_read_options(fs: Any) -> dict[str, Any]:
    """The keyword arguments of ``fs.cat_file`` / ``fs.cat`` that read a small object in one request.

    s3fs given a ``max_concurrency`` over 1 (``backends.py`` sets 4, for its uploads) first asks the
    size of every object read whole (a HEAD) to split a large one into ranges; the objects read whole
    here (manifests, the run lock, the preflight's probe, attempt records) are small, and one GET each
    reads them. Ranges would only start past s3fs's block size (50 MiB), far above any of them.

    Example:
        >>> import fsspec
        >>> whole_read_options(fsspec.filesystem("memory"))
        {}
    """
    if getattr(fs, "max_concurrency", 1) > 1 and _splits_whole_reads(type(fs)):
        return {"max_concurrency": 1}
    return {}


def get_bytes(fs: Any, path: str) -> bytes:
    """``fs.cat_file(path)``: a small object's bytes in one request (:func:`whole_read_options`).

    Example:
        >>> import fsspec
        >>> fs = fsspec.filesystem("memory"); fs.pipe_file("/doc-get/a", b"x")
        >>> get_bytes(fs, "/doc-get/a")
        b'x'
    """
    raw: bytes = fs.cat_file(path, **whole_read_options(fs))
    return raw


def read_files(
    fs: Any, retry: RetryPolicy, paths: list[str], cached_under: str, what: str
) -> dict[str, bytes | FileNotFoundError]:
    """Every file's bytes, or FileNotFoundError for a missing one; any other error is retried, then raised.

    Async filesystems fetch the files concurrently.
    """

    def fetch() -> dict[str, bytes | FileNotFoundError]:
        if hasattr(fs, "invalidate_cache"):
            fs.invalidate_cache(cached_under)
        result = fs.cat(paths, on_error="return", **whole_read_options(fs))
        if len(paths) == 1 and not isinstance(result, dict):  # one path: fsspec returns its bytes bare
            result = {paths[0]: result}
        for outcome in result.values():
            if isinstance(outcome, BaseException) and not isinstance(outcome, FileNotFoundError):
                raise outcome
        return result

    return retry.call(fetch, what)


def file_sizes(fs: Any, retry: RetryPolicy, folder: str, what: str) -> dict[str, int | None]:
    """The size of every file under ``folder`` by its name relative to it (one listing; none if it is gone)."""
    try:
        listing = retry.call(lambda: fs.find(folder, detail=True, withdirs=False), what)
    except FileNotFoundError:
        return {}
    return {posixpath.relpath(path, folder): entry.get("size") for path, entry in listing.items()}


def verify_checksums(
    plane: DataPlane,
    retry: RetryPolicy,
    info: CheckpointInfo,
    folder: str,
    meter: TransferMeter | None = None,
) -> None:
    """Read every payload byte of ``info`` (in ``folder``) through the data ``plane`` and raise unless
    each checksum matches; ``meter`` is told the bytes read."""
    meter = meter or TransferMeter("verify")
    meter.expect({name: digest.size for name, digest in info.files.items()})

    def check(name: str) -> None:
        expected = info.files[name]
        kind = checksum_algorithm(expected.checksum)
        timeout_s = retry.timeout_for(expected.size)
        remote = posixpath.join(folder, name)
        actual = retry.call(
            lambda: plane.digest(
                remote, timeout_s, expected.size, moved=meter.attempt(name), checksum_kind=kind
            ),
            f"read {info.url}/{name}",
            timeout_s=timeout_s,
        )
        if actual != expected:
            raise CorruptCheckpointError(
                f"{info.url}/{name} does not match its manifest: checksum {actual.checksum} "
                f"({actual.size} bytes), expected {expected.checksum} ({expected.size} bytes)"
            )
        meter.file_done(name)

    run_parallel(check, list(info.files))


def pull_into(
    fs: Any,
    plane: DataPlane,
    retry: RetryPolicy,
    info: CheckpointInfo,
    folder: str,
    dest: Path,
    meter: TransferMeter | None = None,
    *,
    manifest: bytes | None = None,
) -> Path:
    """Download checkpoint ``info`` (in ``folder``) into ``dest``, verifying every file; return ``dest``.

    Payload files come through the data ``plane`` (checksummed as they arrive where it streams),
    the manifest through ``fs``. A ``dest`` that already holds this checkpoint is kept as it is;
    otherwise the files arrive in a hidden sibling folder renamed to ``dest`` only once complete,
    so an interrupted pull never leaves a folder that looks complete. ``meter`` is told the bytes.
    ``manifest``: the bytes ``info`` was parsed from, read just before by the caller, written as the
    folder's manifest rather than read again (still parsed and compared with ``info``).
    """
    meter = meter or TransferMeter("pull")
    meter.expect({name: digest.size for name, digest in info.files.items()})
    if local_copy_matches(info, dest):
        log.info("spot_callbacks: %s already holds %s; not downloading", dest, info.url)
        for name in info.files:
            meter.file_done(name)
        return dest

    def fetch(name: str) -> None:
        local = staging / name
        local.parent.mkdir(parents=True, exist_ok=True)
        remote = posixpath.join(folder, name)
        expected = info.files[name]
        kind = checksum_algorithm(expected.checksum)
        timeout_s = retry.timeout_for(expected.size)
        actual = retry.call(
            lambda: plane.download(
                remote, str(local), timeout_s, expected.size, moved=meter.attempt(name), checksum_kind=kind
            ),
            f"download {info.url}/{name}",
            timeout_s=timeout_s,
        )
        if actual != expected:
            raise CorruptCheckpointError(
                f"{info.url}/{name} downloaded as {actual.size} bytes with checksum {actual.checksum}; "
                f"the manifest says {expected.size} bytes, {expected.checksum}"
            )
        meter.file_done(name)

    remote_manifest = posixpath.join(folder, MANIFEST_NAME)
    with staged_folder(dest) as staging:
        run_parallel(fetch, list(info.files))
        limits = ManifestLimits.from_env()
        raw = manifest
        if raw is None:
            raw = retry.call(
                lambda: _read_at_most(fs, remote_manifest, limits.max_manifest_bytes + 1),
                f"read {info.url}/{MANIFEST_NAME}",
            )
        (staging / MANIFEST_NAME).write_bytes(_same_manifest(raw, info, limits))
    return dest


def _read_at_most(fs: Any, path: str, nbytes: int) -> bytes:
    with fs.open(path, "rb") as handle:
        return handle.read(nbytes)


def _same_manifest(raw: bytes, info: CheckpointInfo, limits: ManifestLimits) -> bytes:
    """The manifest a pull writes, read again after the files: bounded, parsed, and the one the
    files were verified against (the store may have changed since), else the pull is damaged."""
    again = parse_manifest(raw, info.step, info.url, limits)
    if again.files != info.files or again.created != info.created:
        raise CorruptCheckpointError(
            f"{info.url}/{MANIFEST_NAME} changed during the pull (another commit of step {info.step}?): "
            "the files fetched were checked against the manifest read before; not kept"
        )
    return raw


@contextlib.contextmanager
def staged_folder(dest: Path) -> Iterator[Path]:
    """A hidden empty sibling of ``dest`` that replaces ``dest`` when the block succeeds, and is
    removed when it fails.

    Example:
        >>> import tempfile
        >>> dest = Path(tempfile.mkdtemp()) / "pulled"
        >>> with staged_folder(dest) as staging:
        ...     _ = (staging / "a.bin").write_bytes(b"a")
        >>> sorted(p.name for p in dest.parent.iterdir()), (dest / "a.bin").read_bytes()
        (['pulled'], b'a')
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        yield staging
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def local_copy_matches(info: CheckpointInfo, folder: Path) -> bool:
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
        if (
            not path.is_file()
            or path.stat().st_size != digest.size
            or digest_local_file(path, checksum_algorithm(digest.checksum)) != digest
        ):
            return False
    return True


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
