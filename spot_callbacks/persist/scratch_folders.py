"""The scratch folders of every dirpath on this machine: whom each serves, which a live run holds,
and the bound across dirpaths.

Each run's scratch folder (``<base>/<hash of the store URL>``, :func:`default_scratch_root`) holds a
record, ``.spot-scratch.json``: the dirpath it serves (the URL without user name or password) and
the time of its last use. Every process of a run that uses it holds a marker,
``.spot-scratch-live-<pid>.json`` (pid, host, the process's start time), while it lives: a folder
whose marker names a running process of this host, or any process of another host (which cannot be
checked from here), is *held*, and nothing deletes it.

The policy (:func:`claim_scratch`, called once when an engine is made): the run records its own
folder, then deletes the other dirpaths' folders of the same base not used for longer than
``$SPOT_SCRATCH_KEEP_S`` (7 days) that no live run holds, on a thread of its own (``spot-scratch-sweep``):
a machine reused for many runs does not wait for it before its first step. ``spot-callbacks scratch`` lists them all
and ``--clean`` deletes what no live run holds. Nothing outside the base is deleted, nothing through
a link, and in a base the user chose (``scratch_dir=``, ``$SPOT_SCRATCH``) only folders with a record.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import socket
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import spot_callbacks.settings as settings
from spot_callbacks.persist.scratch import (
    default_scratch_root,
    per_user_base,
    private_scratch_root,
    scratch_base,
)

log = logging.getLogger("spot_callbacks")

RECORD_NAME = ".spot-scratch.json"
LIVE_PREFIX = ".spot-scratch-live-"
_FOLDER_NAME = re.compile(r"^[0-9a-f]{12}$")


def url_without_credentials(url: str) -> str:
    """``url`` without the user name and password a URL may carry.

    Example:
        >>> url_without_credentials("ftp://user:secret@host:21/runs/a")
        'ftp://host:21/runs/a'
        >>> url_without_credentials("s3://bucket/run")
        's3://bucket/run'
    """
    try:
        parts = urlsplit(url)
        if parts.username is None and parts.password is None:
            return url
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port is not None else host
    except ValueError:
        return "(a URL that cannot be parsed, not shown)"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _process_start(pid: int) -> str | None:
    """The start time of ``pid`` as the kernel counts it (Linux), so a reused pid is not taken for the run."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat_line.rsplit(")", 1)[-1].split()[19]


MAX_PID = 2**22  # Linux's pid_max limit (as store/runlock.py): a larger pid names no process to check
_MAX_EPOCH_S = 2.0**40  # seconds since the epoch past any clock (year ~36800): a larger time is unknown


def _marker_pid(record: dict[str, object]) -> int | None:
    """The pid a live marker names, or ``None`` (unknown) when it is not a pid a process can have.

    A marker is read back from disk, so anything may be there: ``10**30`` is not an exception.

    Example:
        >>> _marker_pid({"pid": 123}), _marker_pid({"pid": 10**30}), _marker_pid({"pid": True})
        (123, None, None)
    """
    pid = record.get("pid")
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid <= MAX_PID else None


def _recorded_time(value: object) -> float | None:
    """A recorded time (seconds since the epoch), or ``None`` (unknown) when it is no such time.

    Example:
        >>> _recorded_time(1.5e9), _recorded_time(10**400), _recorded_time(float("nan")), _recorded_time(-1)
        (1500000000.0, None, None, None)
    """
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    if isinstance(value, int) and not 0 <= value <= _MAX_EPOCH_S:
        return None
    seconds = float(value)
    return seconds if math.isfinite(seconds) and 0.0 <= seconds <= _MAX_EPOCH_S else None


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OSError, OverflowError):
        return False
    return True


def _write_json(path: Path, value: dict[str, object]) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(value, out)
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, object]:
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode) or os.lstat(path).st_size > 64 * 1024:
            return {}
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class ScratchFolder:
    """One scratch folder as found on disk.

    Example:
        >>> folder = ScratchFolder(Path("/tmp/x/03236a011055"), "s3://bucket/run", 10, 0.0, None)
        >>> folder.held, folder.name
        (False, '03236a011055')
    """

    path: Path
    dirpath: str | None  # None: a folder made before records were written
    size_bytes: int
    last_used: float  # seconds since the epoch: the record's time or the newest file, whichever is later
    held_by: str | None  # "pid 123" / "pid 123 on host-b" of a live run; None: no live run holds it

    @property
    def held(self) -> bool:
        return self.held_by is not None

    @property
    def name(self) -> str:
        return self.path.name


def _live_holder(folder: Path) -> str | None:
    host = socket.gethostname()
    for marker in sorted(folder.glob(f"{LIVE_PREFIX}*.json")):
        record = _read_json(marker)
        pid, marker_host = _marker_pid(record), record.get("host")
        if pid is None or not isinstance(marker_host, str):
            continue
        if marker_host != host:
            return f"pid {pid} on {marker_host}"
        started = record.get("started")
        if _pid_running(pid) and (started is None or started == _process_start(pid)):
            return f"pid {pid}"
    return None


def _walk(folder: Path) -> tuple[int, float]:
    """Bytes of the files under ``folder`` and the newest modification time, links not followed."""
    size, newest = 0, os.lstat(folder).st_mtime
    for top, dirs, files in os.walk(folder, followlinks=False):
        for name in dirs + files:
            with contextlib.suppress(OSError):
                found = os.lstat(os.path.join(top, name))
                newest = max(newest, found.st_mtime)
                if stat.S_ISREG(found.st_mode):
                    size += found.st_size
    return size, newest


def _is_scratch_folder(path: Path, base_is_ours: bool) -> bool:
    """A real folder of the base with a run key's name; in a base the user chose, one with a record too."""
    if not _FOLDER_NAME.match(path.name):
        return False
    try:
        found = os.lstat(path)
    except OSError:
        return False
    if stat.S_ISLNK(found.st_mode) or not stat.S_ISDIR(found.st_mode):
        return False
    getuid = getattr(os, "getuid", None)
    if getuid is not None and found.st_uid != getuid():
        return False
    return base_is_ours or os.path.lexists(path / RECORD_NAME)


def list_scratch(base: Path | None = None) -> list[ScratchFolder]:
    """Every scratch folder in ``base`` (default: :func:`~spot_callbacks.persist.scratch.scratch_base`), least recently used first.

    Example:
        >>> import tempfile
        >>> base = Path(tempfile.mkdtemp())
        >>> (base / "03236a011055").mkdir()
        >>> claim = claim_scratch(base / "03236a011055", "s3://bucket/run")
        >>> [(f.dirpath, f.held_by is not None) for f in list_scratch(base)]
        [('s3://bucket/run', True)]
        >>> claim.release(); list_scratch(base)[0].held
        False
    """
    base = scratch_base() if base is None else Path(base)
    found = [_scan(path, _read_json(path / RECORD_NAME)) for path in _scratch_paths(base)]
    return sorted((folder for folder in found if folder is not None), key=lambda folder: folder.last_used)


def _scratch_paths(base: Path) -> list[Path]:
    """The scratch folders of ``base`` (:func:`_is_scratch_folder`), by name."""
    base_is_ours = base == per_user_base()
    paths = sorted(base.iterdir()) if base.is_dir() and not base.is_symlink() else []
    return [path for path in paths if _is_scratch_folder(path, base_is_ours)]


def _scan(path: Path, record: dict[str, object]) -> ScratchFolder | None:
    """The folder ``path`` with its ``record`` read: sized, its last use and its holder found (``None``:
    it went away)."""
    dirpath = record.get("dirpath")
    try:
        size, newest = _walk(path)
    except OSError:
        return None
    recorded_s = _recorded_time(record.get("last_used"))
    last_used = newest if recorded_s is None else max(newest, recorded_s)
    return ScratchFolder(
        path, dirpath if isinstance(dirpath, str) else None, size, last_used, _live_holder(path)
    )


def delete_scratch_folder(folder: ScratchFolder, base: Path) -> bool:
    """Delete ``folder`` unless a live run holds it now, it is a link, or it is not directly in ``base``."""
    path = folder.path
    if path.parent != Path(base) or os.path.islink(path) or _live_holder(path) is not None:
        return False
    # The record goes last: a deletion cut short (the process exits while a sweep runs) leaves a folder
    # that is still recognised, in a base the user chose too, and is deleted by a later sweep.
    with contextlib.suppress(OSError):
        for entry in os.scandir(path):
            if entry.name == RECORD_NAME:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)  # rmtree never follows a link inside
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)


class ScratchClaim:
    """This process's hold on its scratch folder: the record of the dirpath, the live marker.

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp()) / "03236a011055"; root.mkdir()
        >>> claim = ScratchClaim(root, "s3://bucket/run")
        >>> json.loads((root / RECORD_NAME).read_text())["dirpath"], claim.marker.exists()
        ('s3://bucket/run', True)
        >>> claim.release(); claim.marker.exists()
        False
    """

    def __init__(self, root: Path, store_url: str) -> None:
        self.root = Path(root)
        self.marker = self.root / f"{LIVE_PREFIX}{os.getpid()}.json"
        pid = os.getpid()
        self._forget_dead_markers()
        _write_json(self.marker, {"pid": pid, "host": socket.gethostname(), "started": _process_start(pid)})
        _write_json(
            self.root / RECORD_NAME, {"dirpath": url_without_credentials(store_url), "last_used": time.time()}
        )

    def _forget_dead_markers(self) -> None:
        host = socket.gethostname()
        for marker in self.root.glob(f"{LIVE_PREFIX}*.json"):
            record = _read_json(marker)
            pid = _marker_pid(record)
            if record.get("host") == host and (pid is None or not _pid_running(pid)):
                with contextlib.suppress(OSError):
                    marker.unlink()

    def release(self) -> None:
        """The run is over: the folder is no longer held by this process (it stays, for a restart)."""
        with contextlib.suppress(OSError):
            self.marker.unlink()

    def holds_only_its_record(self) -> bool:
        """The folder holds nothing but the run's record and live markers: no step was ever staged."""
        with contextlib.suppress(OSError):
            return all(p.name == RECORD_NAME or p.name.startswith(LIVE_PREFIX) for p in self.root.iterdir())
        return False


_CLAIMS: dict[Path, ScratchClaim] = {}  # this process's, by folder: held until the process ends


def claim_scratch_root(store_url: str, scratch_dir: str | None = None) -> Path:
    """:func:`~spot_callbacks.persist.scratch.private_scratch_root`, recorded and held by this process
    (:func:`claim_scratch`) until it ends; an engine calls it once.

    Example:
        >>> import tempfile
        >>> root = claim_scratch_root("s3://bucket/run", scratch_dir=tempfile.mkdtemp())
        >>> [folder.dirpath for folder in list_scratch(root.parent)]
        ['s3://bucket/run']
    """
    made = not os.path.lexists(default_scratch_root(store_url, scratch_dir))
    root = private_scratch_root(store_url, scratch_dir)
    _CLAIMS[root] = claim_scratch(root, store_url)
    if made:
        _MADE.add(root)
    return root


_MADE: set[Path] = set()  # the scratch folders this process created (not found from an earlier run)


def drop_unused_scratch_root(root: Path) -> bool:
    """Undo :func:`claim_scratch_root` for a start that failed before its first step (a refused store):
    the folder goes if this process made it, nothing but its record is in it and no other live process
    (another rank of this machine) holds it. A folder an earlier run left, with its copies, stays.

    Example:
        >>> import tempfile
        >>> root = claim_scratch_root("s3://bucket/run", scratch_dir=tempfile.mkdtemp())
        >>> drop_unused_scratch_root(root), root.exists()
        (True, False)
    """
    root = Path(root)
    claim = _CLAIMS.get(root)
    if claim is None or root not in _MADE or not claim.holds_only_its_record():
        return False
    claim.release()
    del _CLAIMS[root]
    _MADE.discard(root)
    if _live_holder(root) is not None:
        return False
    shutil.rmtree(root, ignore_errors=True)
    return not os.path.lexists(root)


def claim_scratch(root: Path, store_url: str) -> ScratchClaim:
    """Record and hold ``root`` for ``store_url``; delete the other dirpaths' folders of its base that
    no live run holds and nobody used for ``$SPOT_SCRATCH_KEEP_S`` (``off``: keep them all), on a
    daemon thread (:func:`wait_for_sweeps`): the hold is taken when this returns, the sweep may go on."""
    claim = ScratchClaim(root, store_url)
    keep_s = settings.SCRATCH_KEEP_S.value()
    if keep_s is not None:
        sweep = threading.Thread(
            target=_sweep_quietly, args=(Path(root).parent, keep_s, Path(root)), name="spot-scratch-sweep",
            daemon=True,
        )  # fmt: skip
        with _SWEEPS_LOCK:
            _SWEEPS.append(sweep)
        sweep.start()
    return claim


_SWEEPS: list[threading.Thread] = []  # the sweeps this process started (claim_scratch)
_SWEEPS_LOCK = threading.Lock()


def wait_for_sweeps(timeout_s: float | None = None) -> bool:
    """Wait for the sweeps :func:`claim_scratch` started in this process; False if one still runs
    after ``timeout_s``.

    Example:
        >>> wait_for_sweeps(timeout_s=10)
        True
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with _SWEEPS_LOCK:
        sweeps = list(_SWEEPS)
    for sweep in sweeps:
        sweep.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    with _SWEEPS_LOCK:
        _SWEEPS[:] = [sweep for sweep in _SWEEPS if sweep.is_alive()]
        return not _SWEEPS


def _sweep_quietly(base: Path, older_than_s: float, keep: Path) -> None:
    """:func:`sweep_scratch` on the sweep's thread: what fails there is said, and training goes on."""
    try:
        sweep_scratch(base, older_than_s=older_than_s, keep=keep)
    except Exception:  # noqa: BLE001 - a folder left for the next sweep is no reason to stop a run
        log.warning("spot_callbacks: scratch %s: the sweep of old folders failed", base, exc_info=True)


def sweep_scratch(
    base: Path, older_than_s: float | None = None, keep: Path | None = None
) -> list[ScratchFolder]:
    """Delete the folders of ``base`` that no live run holds (``older_than_s``: only those not used for
    that long; ``keep``: never this one). Returns what was deleted.

    A folder whose record says it was used within ``older_than_s`` is kept without walking its files
    (its last use is never older than its record's): only the candidates are sized.
    """
    now = time.time()
    deleted = []
    candidates = []
    for path in _scratch_paths(base):
        if path == keep:
            continue
        record = _read_json(path / RECORD_NAME)
        recorded_s = _recorded_time(record.get("last_used"))
        if older_than_s is not None and recorded_s is not None and now - recorded_s < older_than_s:
            continue
        if (folder := _scan(path, record)) is not None:
            candidates.append(folder)
    for folder in sorted(candidates, key=lambda folder: folder.last_used):
        if folder.held:
            continue
        if older_than_s is not None and now - folder.last_used < older_than_s:
            continue
        if delete_scratch_folder(folder, base):
            deleted.append(folder)
    if deleted and keep is not None:
        log.info(
            "spot_callbacks: scratch %s: deleted %d folder%s of other dirpaths unused for over %s (%s freed; "
            "$SPOT_SCRATCH_KEEP_S sets how long): %s",
            base, len(deleted), "" if len(deleted) == 1 else "s", _days(older_than_s),
            _mib(sum(f.size_bytes for f in deleted)), ", ".join(f.dirpath or f.name for f in deleted),
        )  # fmt: skip
    return deleted


def _days(seconds: float | None) -> str:
    if seconds is None:
        return "any time"
    return f"{seconds / 86400:g} days" if seconds >= 86400 else f"{seconds:g} s"


def _mib(size_bytes: int) -> str:
    return f"{size_bytes / 1024**2:.1f} MiB"
