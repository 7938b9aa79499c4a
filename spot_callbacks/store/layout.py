"""The remote layout: step folder names, URLs and paths, backend quirks, and which local files are payload.

A run is a folder ``<dirpath>/`` holding one ``step-<09d>/`` folder per checkpoint. Paths are
what the fsspec filesystem takes (``fsspec.core.url_to_fs``); URLs are what a user reads, in the
protocol they wrote (``az://``, although adlfs calls itself ``abfs``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from spot_callbacks.store.backends import backend_of, fs_protocols
from spot_callbacks.store.resolve import resolve_filesystem

# Every file name a step folder is known by, defined here once (the frameworks' own names stay theirs):
MANIFEST_NAME = "manifest.json"  # written last: the commit
STATE_FILE = "state.ckpt"  # the one payload file of a single-writer checkpoint (Lightning, the engine)
# torch.distributed.checkpoint's index of every shard: a hidden name, yet payload.
DCP_METADATA_FILE = ".metadata"
_DCP_RANK_METADATA = re.compile(r"__\d+\.metadata")  # DCP's rank-local index (use_collectives=False)
HF_TRAINER_STATE_FILE = "trainer_state.json"  # the HF Trainer reads it first on every resume
SHARDED_META_FILE = "meta.pt"  # a sharded checkpoint's non-tensor rest (Lightning's _METADATA_FILENAME)
DCP_SHARD_FILE = "__{rank}_0.distcp"  # DCP's FileSystemWriter: one per rank
# Beside the step folders: one record per process that trained here (accounting/attempts.py).
ATTEMPTS_FOLDER = ".spot-attempts"
_STEP_DIR = re.compile(r"^step-(\d{9,})$")

log = logging.getLogger("spot_callbacks")


# Who writes a step folder's files. The engine's saves take the persister from it
# (saving.py's PERSISTERS): the layout, not the adapter's call, decides how a checkpoint commits.
ONE_WRITER = "one writer"  # the writer rank writes every file; the others write nothing
RANK_SHARDS = "rank shards"  # every rank its DCP shards; rank 0 the shards' index and the non-tensor rest
EVERY_RANK = "every rank"  # every rank (on several nodes: each node's main process) its own files


@dataclass(frozen=True)
class StepLayout:
    """One kind of step folder: what it is called, the file names the library gives it, who writes them.

    ``files`` holds the names this library defines (``{rank}`` in one: a file per rank); a
    framework's folder keeps the framework's own names. ``written_by`` picks the persister.

    Example:
        >>> STATE_LAYOUT.files, STATE_LAYOUT.written_by
        (('state.ckpt',), 'one writer')
        >>> SHARDED_LAYOUT.rank_files(2)
        ['__0_0.distcp', '__1_0.distcp']
    """

    name: str
    files: tuple[str, ...]
    written_by: str

    def rank_files(self, world_size: int) -> list[str]:
        """The per-rank names of a run of ``world_size`` ranks."""
        return [
            name.format(rank=rank) for name in self.files if "{rank}" in name for rank in range(world_size)
        ]


# The step folders this library writes (a new per-rank file is a name here, and EVERY_RANK as writer):
STATE_LAYOUT = StepLayout("single-file", (STATE_FILE,), ONE_WRITER)  # Lightning, the engine's save_state
SHARDED_LAYOUT = StepLayout(
    "sharded", (DCP_METADATA_FILE, SHARDED_META_FILE, DCP_SHARD_FILE), RANK_SHARDS
)  # Lightning's sharded strategies, save_sharded_state
FOLDER_LAYOUT = StepLayout("framework folder", (), ONE_WRITER)  # HF's checkpoint-N on one node
RANK_FOLDER_LAYOUT = StepLayout("multi-node folder", (), EVERY_RANK)  # HF across nodes, FSDP's shards


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
    """The step of a ``step-N`` folder name, or ``None`` for any other name.

    Example:
        >>> parse_step_dirname("step-000012000"), parse_step_dirname("checkpoint-12000")
        (12000, None)
    """
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def is_local_fs(fs: Any) -> bool:
    """True for the local disk, where a write is not atomic and a rename is."""
    return any(backend_of(protocol).local for protocol in fs_protocols(fs))


def open_filesystem(dirpath: str, storage_options: dict[str, Any] | None) -> tuple[Any, str, str | None]:
    """``(fs, root, protocol)`` of a run folder: the filesystem, the folder's path in it, and the
    protocol the user wrote when the filesystem answers to it (``None``: the filesystem's own).

    Example:
        >>> fs, root, protocol = open_filesystem("memory://doc-layout/run/", None)
        >>> root, protocol
        ('/doc-layout/run', 'memory')
    """
    options = dict(storage_options or {})
    protocol, _ = fsspec.core.split_protocol(dirpath)
    opens_with = backend_of(protocol).opens_with if protocol is not None else None
    if opens_with is not None:
        opens_with(options)
    fs, root = resolve_filesystem(dirpath, options)
    return fs, root.rstrip("/") or root, protocol if protocol in fs_protocols(fs) else None


def url_of(fs: Any, path: str, protocol: str | None) -> str:
    """The URL of a filesystem path, in ``protocol`` (``None``: the filesystem's own).

    Example:
        >>> import posixpath
        >>> fs, root, _ = open_filesystem("memory://doc-url/run", None)
        >>> url_of(fs, posixpath.join(root, step_dirname(3)), None)
        'memory:///doc-url/run/step-000000003'
    """
    url = fs.unstrip_protocol(path)
    if protocol is None or url.startswith(f"{protocol}://"):
        return url
    _, bare_path = fsspec.core.split_protocol(url)
    return f"{protocol}://{bare_path}"


# ----------------------------------------------------------------- backend quirks
def list_folder(fs: Any, folder: str) -> list[str]:
    """The paths directly under ``folder``, read fresh (not from the listing cache)."""
    try:
        return fs.ls(folder, detail=False, refresh=True)
    except TypeError:  # filesystems whose ls() takes no refresh argument
        return fs.ls(folder, detail=False)


def is_link(fs: Any, path: str) -> bool:
    """True for a symbolic link on the local disk (object stores have none)."""
    return is_local_fs(fs) and os.path.islink(path)


_KINDS = (
    (stat.S_ISDIR, "a folder"), (stat.S_ISREG, "a file"), (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a named pipe (fifo)"), (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
)  # fmt: skip


def local_stray(fs: Any, path: str, *, folder: bool) -> str | None:
    """Why the local entry ``path`` is not what the layout puts there (``folder``: a plain folder,
    else a regular file), or ``None`` (it is, it does not exist, or the store is not a local disk).

    A local store can hold what no run wrote: a file named like a step folder, a folder named
    ``manifest.json``, a fifo (reading it would block forever), a socket. Readers skip such an
    entry, ``rm`` refuses it, and nothing reads through it. Symbolic links are judged by the
    callers (:func:`is_link`): a linked step folder is another run's.

    Example:
        >>> import tempfile
        >>> base = tempfile.mkdtemp()
        >>> local_stray(fsspec.filesystem("file"), base, folder=False)
        'it is a folder, not a file'
        >>> local_stray(fsspec.filesystem("file"), base, folder=True) is None
        True
    """
    if not is_local_fs(fs):
        return None
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as err:
        return f"it cannot be examined ({err.strerror or err})"
    if stat.S_ISLNK(mode) and folder:
        return None
    if stat.S_ISDIR(mode) if folder else stat.S_ISREG(mode):
        if os.access(path, os.R_OK | (os.X_OK if folder else 0)):
            return None
        return "it cannot be read (permission denied)"
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular entry")
    return f"it is {kind}, not {'a folder' if folder else 'a file'}"


def missing_root_reason(fs: Any, root: str) -> str | None:
    """Why the run folder ``root`` cannot hold checkpoints (it, or its bucket, is missing), or ``None``.

    On the local disk a folder exists or not; in an object store a "folder" is a prefix, which
    exists only while objects are under it, so only the bucket is checked there.

    Example:
        >>> missing_root_reason(fsspec.filesystem("file"), "/nonexistent/run")
        'no such folder: /nonexistent/run'
    """
    if is_local_fs(fs):
        if not os.path.exists(root):
            return f"no such folder: {root}"
        return None if os.path.isdir(root) else f"{root} is not a folder"
    if any(backend_of(protocol).bucketed for protocol in fs_protocols(fs)):
        bucket = root.split("/", 1)[0]
        if not exists_fresh(fs, bucket):
            return f"the bucket (container) {bucket!r} does not exist, or these credentials cannot see it"
    return None


def exists_fresh(fs: Any, path: str) -> bool:
    if hasattr(fs, "invalidate_cache"):
        fs.invalidate_cache(path)
    return fs.exists(path)


# fs.rm, never fs.rm_file: adlfs and gcsfs inherit a sync rm_file that creates a coroutine
# and never awaits it, so the object silently stays.
def remove_file(store: Any, path: str) -> None:
    """Delete one object of ``store``. s3fs sends even one object's delete as DeleteObjects: a server
    that refuses it gets a plain DELETE, learned once for every later delete (:func:`in_bulk_else_one_by_one`)."""
    in_bulk_else_one_by_one(store, lambda: store.fs.rm(path), lambda: store.fs.rm_file(path))


def in_bulk_else_one_by_one(store: Any, bulk: Callable[[], Any], one_by_one: Callable[[], Any]) -> None:
    """``bulk()``; on a server that refuses bulk deletes, ``one_by_one()`` now and for every later
    delete of ``store`` (:func:`learn_single_deletes`): the one mechanism of single-object deletes,
    retention's and this module's."""
    if single_deletes(store):
        one_by_one()
        return
    try:
        bulk()
    except (NotImplementedError, OSError) as err:
        if not bulk_delete_refused(err):
            raise
        learn_single_deletes(store, err)
        one_by_one()


def single_deletes(store: Any) -> bool:
    """True once ``store``'s server refused a bulk delete (:func:`learn_single_deletes`)."""
    return bool(getattr(store, "_single_deletes", False))


def learn_single_deletes(store: Any, err: BaseException) -> None:
    """Remember that ``store``'s server refuses bulk deletes (``err``, its answer), saying so once.

    Example:
        >>> class Store: url = "s3://b/run"
        >>> store = Store(); learn_single_deletes(store, OSError(errno.ENOSYS, "no")); single_deletes(store)
        True
    """
    if single_deletes(store):
        return
    store._single_deletes = True  # this store, from now on
    log.info(
        "spot_callbacks: %s does not take bulk deletes (%s); deleting one object at a time",
        getattr(store, "url", "the store"), err,
    )  # fmt: skip


def bulk_delete_refused(err: BaseException) -> bool:
    """A server without DeleteObjects (some S3-compatible stores): 501 NotImplemented, which s3fs
    raises as ``OSError(ENOSYS)``, or a method it does not allow.

    Example:
        >>> bulk_delete_refused(OSError(errno.ENOSYS, "not implemented")), bulk_delete_refused(PermissionError("denied"))
        (True, False)
    """
    if isinstance(err, FileNotFoundError):
        return False  # the object is gone: an answer about the object, not about the method
    if isinstance(err, NotImplementedError) or getattr(err, "errno", None) == errno.ENOSYS:
        return True
    text = str(err).lower()
    return "not implemented" in text or "notimplemented" in text or "method not allowed" in text


def remove_tree(fs: Any, folder: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        fs.rm(folder, recursive=True)


# ----------------------------------------------------------------- local payload
def local_payload_names(folder: Path) -> list[str]:
    """Relative posix names of the files under a local checkpoint folder, manifest excluded.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> for name in ("state.pt", ".state.pt.tmp", MANIFEST_NAME):
        ...     _ = (folder / name).write_bytes(b"x")
        >>> local_payload_names(folder)
        ['state.pt']
    """
    names = []
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            name = path.relative_to(folder).as_posix()
            if name != MANIFEST_NAME and not is_temporary_name(name):
                names.append(name)
    return names


def is_temporary_name(name: str) -> bool:
    """True for a writer's temporary (a hidden file or folder), which is never payload.

    DCP's ``.metadata`` (HF/accelerate FSDP SHARDED_STATE_DICT, Lightning's sharded save) is the
    exception: without it the shards next to it cannot be loaded. DCP writes it as
    ``.metadata.tmp`` first, which stays out.

    Example:
        >>> is_temporary_name("model/.metadata"), is_temporary_name("model/.metadata.tmp")
        (False, True)
    """
    *folders, base = name.split("/")
    return any(part.startswith(".") for part in folders) or (
        base.startswith(".") and base != DCP_METADATA_FILE
    )


def is_dcp_index(name: str) -> bool:
    """True for the file name of a DCP index: ``.metadata`` or a rank's ``__N.metadata``.

    Example:
        >>> [is_dcp_index(n) for n in (".metadata", "__3.metadata", "meta.pt")]
        [True, True, False]
    """
    return name == DCP_METADATA_FILE or _DCP_RANK_METADATA.fullmatch(name) is not None


def holds_dcp_index(folder: Path) -> bool:
    """True when a file under the local ``folder`` (at any depth) is a DCP index (:func:`is_dcp_index`)."""
    return any(path.is_file() and is_dcp_index(path.name) for path in Path(folder).rglob("*"))
