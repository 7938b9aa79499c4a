"""The run lock: one training run writes into a ``dirpath`` at a time.

Two runs pointed at the same ``dirpath`` by mistake would interleave their checkpoints and prune
each other's. The first run writes ``<dirpath>/.spot-lock.json`` (host, pid, run id, started,
heartbeat) and refreshes its heartbeat from a background thread; a second run that finds a lock
with a fresh heartbeat refuses to start (:class:`RunLockedError`). A lock whose heartbeat is older
than ``SPOT_LOCK_STALE_S`` (default 10 s), or whose owner is a dead process on this host, is
taken over with a warning: a run killed without notice (kill -9, a vanished machine) leaves its
lock behind, and the run that resumes it must not be blocked for long. ``SPOT_FORCE_LOCK=1``
takes over any lock.

Two hosts never both hold it. On the local disk (and a shared one) the lock is created
atomically: a fully written temporary is hard-linked to the lock's name, which fails when a lock is
there; a stale lock is taken over by overwriting it in one rename, only if it is still the lock
judged stale, with every lock writer of the folder excluded meanwhile (``flock``). On S3 the writes
are conditional: ``If-None-Match: *`` creates the lock, ``If-Match: <etag>`` takes over exactly the
lock judged stale and refreshes only our own heartbeat, so of runs racing for one lock exactly one
wins and the others raise :class:`RunLockedError` naming it. Stores without conditional writes here
(GCS, Azure, others) fall back to writing and reading back, said once in the log; that catches most
races.

Hosts' clocks disagree, so neither the heartbeat's value nor this host's clock decides. A lock's
age is measured on the **store's** clock: the lock's modification time as the store records it
(``LastModified``/``mtime``) against the modification time of a small probe object this run
writes (once per acquire) — both stamped by the same server. A lock older than
``SPOT_LOCK_STALE_S`` (default 10 s, four missed heartbeats of 2.5 s) by that clock belongs to a
dead run and is taken over at once, so a replacement machine that starts after a hard loss trains
within seconds; a younger one is watched until it is either rewritten (its owner is alive: refused)
or old enough. Where the backend records no modification time, the heartbeat value is judged and a
stale-looking lock is taken over only once it has not changed for :data:`CONFIRM_HEARTBEATS`
heartbeat periods of this host's own monotonic clock. A lock whose heartbeat lies in the future
never holds the next run longer than ``SPOT_LOCK_STALE_S`` of this host's clock.

A replacement need not wait for a dead run's lock to go stale before it trains. A lock that has
missed its owner's heartbeats (unchanged for :data:`CONFIRM_HEARTBEATS` periods by the store's clock)
is *presumed dead*: :meth:`RunLock.acquire` tells its caller (``on_presumed_dead``), which may start
training while the watch goes on in the background, and write nothing until the lock is taken.
A live owner rewrites its lock every period, so a run started by mistake beside a live one is still
refused before its first step; one whose store stalled its heartbeats is refused later, with nothing
written.

The trade-off of a short stale time: a live run whose store stops answering its heartbeats for
longer than ``SPOT_LOCK_STALE_S`` may be taken over by a run started meanwhile; it then learns at
its next heartbeat (a conditional write that fails, or a read-back naming the other run) and stops
checkpointing into that ``dirpath``. Raise ``SPOT_LOCK_STALE_S`` on a store with long stalls.

Every heartbeat reads the lock back before refreshing it: a run whose lock now names another run
has lost it (:attr:`RunLock.lost`, and ``on_lost`` is called once): it stops refreshing, and the
engine stops checkpointing into that ``dirpath`` and says so.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import posixpath
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

import spot_callbacks.settings as settings
from spot_callbacks.errors import ManifestError, RunLockedError
from spot_callbacks.store.backends import conditional_writes, fs_protocols
from spot_callbacks.store.checkpoint_store import CheckpointStore
from spot_callbacks.store.layout import is_local_fs
from spot_callbacks.store.manifest_limits import load_bounded_json
from spot_callbacks.store.transfer import get_bytes, put_bytes

log = logging.getLogger("spot_callbacks")

LOCK_NAME = ".spot-lock.json"
FORCE_ENV = settings.FORCE_LOCK.name
STALE_ENV = settings.LOCK_STALE_S.name
DEFAULT_STALE_S = settings.LOCK_STALE_S.default
HEARTBEATS_PER_STALE = 4  # a live owner refreshes several times before its lock could look stale
# Releasing the lock is the last store call of a run: a store that does not answer must not hold
# up the exit (SIGKILL may be seconds away); a lock left behind only goes stale.
RELEASE_TIMEOUT_S = 10.0
CLAIM_ATTEMPTS = 8  # each failed attempt means another run claimed the lock in between: judge it again
# A lock that looks stale by a clock is taken over only once unchanged for this many heartbeat
# periods of our monotonic clock: a live owner rewrites it every period, whatever its clock says.
CONFIRM_HEARTBEATS = 1.5
MAX_LOCK_BYTES = 64 * 1024  # a lock is about 200 bytes; a larger one is no run's, and never read whole
MAX_PID = 2**22  # Linux's pid_max limit: a larger (or negative) pid names no process to check
STORE_STAMP_RESOLUTION_S = 1.0  # S3 and others stamp LastModified in whole seconds
CLOCK_PROBE_PREFIX = ".spot-clock-"  # <dirpath>/.spot-clock-<run id>: written, read, deleted at once
_said_no_conditional_writes: set[str] = set()


def has_conditional_writes(fs: Any) -> bool:
    """True where this lock uses the store's conditional writes (If-None-Match / If-Match): where the
    backend table promises them (:func:`~spot_callbacks.store.backends.conditional_writes`)."""
    return conditional_writes(fs_protocols(fs)) == "etag"


def _precondition_failed(err: BaseException) -> bool:
    """An S3 conditional write refused (412): s3fs raises FileExistsError for If-None-Match and an
    EINVAL OSError for If-Match; a 409 ConditionalRequestConflict is a concurrent conditional write."""
    if isinstance(err, FileExistsError):
        return True
    for cause in (err, err.__cause__):
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict", "412") or status in (409, 412):
                return True
    return isinstance(err, OSError) and err.errno == errno.EINVAL and "recondition" in str(err)


def stale_after_s() -> float:
    return settings.LOCK_STALE_S.value()


def _timestamp(value: Any) -> float | None:
    """A backend's modification time (a datetime, epoch seconds or an ISO string) as epoch seconds."""
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return _timestamp(datetime.fromisoformat(value.replace("Z", "+00:00")))
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunLock:
    """The lock object of one run in ``store``; :meth:`acquire` once, :meth:`release` at the end.

    Example:
        >>> lock = RunLock(CheckpointStore("memory://doc-lock/run"))
        >>> lock.acquire(); lock.holder()["run_id"] == lock.run_id
        True
        >>> lock.release(); lock.holder() is None
        True
    """

    def __init__(
        self,
        store: CheckpointStore,
        stale_s: float | None = None,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.on_lost = on_lost
        self.lost_reason: str | None = None
        self.stale_s = stale_s if stale_s is not None else stale_after_s()
        self.heartbeat_s = self.stale_s / HEARTBEATS_PER_STALE
        self.run_id = uuid.uuid4().hex
        self.path = posixpath.join(store.root, LOCK_NAME)
        self.url = store.url_of(self.path)
        self._owner = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "run_id": self.run_id,
            "started": datetime.now(timezone.utc).isoformat(),
        }
        self._held = False
        # The lock of a previous run taken over because that run looked dead (stale or a dead pid).
        self.taken_from: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conditional = has_conditional_writes(store.fs)
        self._etag: str | None = None  # of our own last write (conditional heartbeats)
        self._seen_etag: str | None = None  # of the lock as last judged (a conditional take-over)
        self._read_etag: str | None = None  # of the lock as last read by holder(), taken before its content
        self._store_offset_s: float | None = None  # store clock minus this host's clock
        self._store_clock_probed = False
        self._cancel = threading.Event()  # ends a watch whose caller no longer wants the lock
        # A listing of the run folder just taken (the preflight's) showed no lock: acquire() first tries
        # to create it where writes are conditional, without reading it (a HEAD, and s3fs's LIST after a 404).
        self.listed_absent = False

    @property
    def lost(self) -> bool:
        """True once a heartbeat found the lock held by another run: stop writing into this dirpath."""
        return self.lost_reason is not None

    # ----------------------------------------------------------------- reading
    def holder(self) -> dict[str, Any] | None:
        """The lock's content, or None when there is none.

        A lock no run wrote (over :data:`MAX_LOCK_BYTES`, not JSON, NaN, nested deeper than a
        manifest may be, not an object) is ``{"unreadable": why}``: a lock of an unknown run,
        judged by the store's age of it like any other and taken over once it stays unchanged.
        """
        try:
            if self._conditional:
                # The ETag is read *before* the content: a take-over conditional on it can then only
                # replace the very lock judged (or an older one, which the store refuses). Read after
                # the content, it could be a racing winner's, and our If-Match would overwrite it.
                if hasattr(self.store.fs, "invalidate_cache"):
                    self.store.fs.invalidate_cache(self.path)
                info = self.store.retry.call(lambda: self.store.fs.info(self.path), f"check {self.url}")
                etag = info.get("ETag") or info.get("etag")
                self._read_etag = etag if isinstance(etag, str) else None
                size = info.get("size")
            else:
                size = self.store.retry.call(lambda: self.store.fs.size(self.path), f"check {self.url}")
            if size is not None and size > MAX_LOCK_BYTES:
                return {"unreadable": f"{size} bytes, more than a lock's {MAX_LOCK_BYTES}"}
            raw = self.store.retry.call(lambda: get_bytes(self.store.fs, self.path), f"read {self.url}")
        except FileNotFoundError:
            return None
        try:
            doc = load_bounded_json(raw[: MAX_LOCK_BYTES + 1], self.url)
        except ManifestError as err:
            return {"unreadable": str(err)}
        return doc if isinstance(doc, dict) else {"unreadable": f"a JSON {type(doc).__name__}, not an object"}

    def _written_at(self) -> float | None:
        """When the store says the lock object was last written (epoch seconds), or None where the
        backend does not say (or the lock is gone)."""
        try:
            if hasattr(self.store.fs, "invalidate_cache"):
                self.store.fs.invalidate_cache(self.path)
            info = self.store.retry.call(lambda: self.store.fs.info(self.path), f"check {self.url}")
        except FileNotFoundError:
            return None
        etag = info.get("ETag") or info.get("etag")
        self._seen_etag = etag if isinstance(etag, str) else None
        return _modified(info)

    def _store_now(self) -> float | None:
        """The store's clock now (epoch seconds), or None where its objects carry no modification
        time: measured once by writing a probe object and reading the time the store stamped on it."""
        if not self._store_clock_probed:
            self._store_clock_probed = True
            probe = posixpath.join(self.store.root, f"{CLOCK_PROBE_PREFIX}{self.run_id}")
            fs = self.store.fs
            try:
                before = time.time()
                self.store.retry.call(lambda: put_bytes(fs, probe, b""), f"write {self.store.url_of(probe)}")
                if hasattr(fs, "invalidate_cache"):
                    fs.invalidate_cache(probe)
                stamped = _modified(
                    self.store.retry.call(lambda: fs.info(probe), f"check {self.store.url_of(probe)}")
                )
                after = time.time()
                if stamped is not None:
                    self._store_offset_s = stamped - (before + after) / 2
            except Exception as err:  # noqa: BLE001 - judged by the heartbeat instead, as before
                log.warning("spot_callbacks: could not read the store's clock at %s: %s", self.store.url, err)
            finally:
                with contextlib.suppress(Exception):
                    fs.rm(probe)
        return None if self._store_offset_s is None else time.time() + self._store_offset_s

    def _age(self, doc: dict[str, Any]) -> tuple[float, str]:
        """How old the lock looks and by which clock: the store's modification time where the
        backend gives one (a lying or skewed heartbeat value does not matter), else the heartbeat's."""
        written = self._written_at()
        now = self._store_now() if written is not None else None
        if written is not None and now is not None:
            # Stores stamp whole seconds (S3's LastModified): a lock may look up to one second older
            # than it is, so that second is not counted against a live owner.
            return max(now - written - STORE_STAMP_RESOLUTION_S, 0.0), "store"
        heartbeat = _heartbeat(doc)
        return (time.time() - heartbeat if heartbeat is not None else float("inf")), "heartbeat"

    def _stale_reason(self, age_s: float, basis: str) -> str:
        what = "it was last written" if basis == "store" else "its heartbeat is"
        ago = f"{age_s:.0f}s ago, by the store's clock" if basis == "store" else f"{age_s:.0f}s old"
        return f"{what} {ago} (stale after {self.stale_s:.0f}s, {STALE_ENV})"

    def _why_free(self, doc: dict[str, Any]) -> str | None:
        """Why the lock in ``doc`` may be taken over at once, or None: its owner may be alive
        (then :meth:`_watch_heartbeat` decides by watching it on this host's own clock)."""
        if doc.get("run_id") == self.run_id:
            return "it is ours"
        if settings.FORCE_LOCK.value():
            return f"{FORCE_ENV}=1"
        same_host = doc.get("host") == self._owner["host"]
        pid = doc.get("pid")
        pid = pid if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid <= MAX_PID else None
        if same_host and pid == os.getpid():
            return "its owner was an earlier run in this process"
        if same_host and pid is not None and not _pid_alive(pid):
            return f"its owner, process {pid} on this host, is dead"
        age_s, basis = self._age(doc)
        if basis == "store" and age_s > self.stale_s:
            return self._stale_reason(age_s, basis)
        return None

    @property
    def presumed_dead_s(self) -> float:
        """A lock unchanged this long by the store's clock has missed its owner's heartbeats."""
        return CONFIRM_HEARTBEATS * self.heartbeat_s + STORE_STAMP_RESOLUTION_S

    def cancel_wait(self) -> None:
        """End a watch in another thread's :meth:`acquire` at its next look (it raises RunLockedError)."""
        self._cancel.set()

    def _watch_heartbeat(
        self, doc: dict[str, Any], on_presumed_dead: Callable[[str], None] | None = None
    ) -> tuple[dict[str, Any], str | None]:
        """A fresh lock may belong to a run that was just killed (a replacement machine often starts
        within the stale time), and a stale-looking one to a live run on a host whose clock is off:
        watch it rather than fail or evict. A live owner rewrites it within one heartbeat period
        (then we refuse); a dead one leaves it unchanged: taken over once it looks stale and has
        stayed unchanged for ``CONFIRM_HEARTBEATS`` periods, or for ``stale_s``, of this host's
        monotonic clock, whatever the clocks that wrote it say."""
        log.warning(
            "spot_callbacks: %s is locked by %s; waiting up to %.0fs (%s) to see whether that run is alive",
            self.store.url, _owner(doc), self.stale_s, STALE_ENV,
        )  # fmt: skip
        first = (doc.get("heartbeat"), doc.get("run_id"), self._written_at())
        confirm_s = CONFIRM_HEARTBEATS * self.heartbeat_s
        watched_from = time.monotonic()
        current: dict[str, Any] | None = doc
        while True:
            if on_presumed_dead is not None and current is not None:
                age_s, basis = self._age(current)
                if basis == "store" and age_s > self.presumed_dead_s:
                    on_presumed_dead(
                        f"it has missed its owner's heartbeats ({age_s:.0f}s old by the store's clock)"
                    )
                    on_presumed_dead = None
            if self._cancel.wait(min(self.heartbeat_s / 4, 1.0)):
                return doc, None
            current = self.holder()
            if current is None:
                if self.store.retry.call(lambda: self.store.fs.exists(self.path), f"check {self.url}"):
                    continue  # caught mid-write (a local write is not atomic): its owner is writing
                return doc, "it was released"
            if (current.get("heartbeat"), current.get("run_id"), self._written_at()) != first:
                # Rewritten: by its owner (alive) or by a run that took it over between our read of
                # the content and of its stamp. Read it again so the refusal names who holds it now.
                latest = self.holder()
                return (latest, None) if latest is not None else (doc, "it was released")
            why = self._why_free(current)
            if why is not None:
                return current, why
            unchanged_s = time.monotonic() - watched_from
            age_s, basis = self._age(current)
            if basis == "heartbeat" and age_s > self.stale_s and unchanged_s >= confirm_s:
                return current, f"{self._stale_reason(age_s, basis)}, unchanged for {unchanged_s:.0f}s"
            # Its clock says fresh (or the future), ours says dead; the store's own clock judges first.
            if unchanged_s >= self.stale_s + (STORE_STAMP_RESOLUTION_S if basis == "store" else 0.0):
                return current, (
                    f"it has not changed for {unchanged_s:.0f}s of this host's clock ({STALE_ENV}), "
                    "whatever its heartbeat says"
                )

    def dead_run(self) -> tuple[float, float] | None:
        """``(started, last_heartbeat)`` (Unix times) of the previous run whose lock :meth:`acquire`
        took over because it looked dead, or None (none, or the lock did not say sanely)."""
        doc = self.taken_from or {}
        beat, started = doc.get("heartbeat"), doc.get("started")
        started_at = _timestamp(started) if isinstance(started, str) else None
        if not isinstance(beat, (int, float)) or isinstance(beat, bool) or started_at is None:
            return None
        return (started_at, float(beat)) if started_at <= beat < float("inf") else None

    # ----------------------------------------------------------------- writing
    def acquire(self, on_presumed_dead: Callable[[str], None] | None = None) -> None:
        """Take the lock, or raise :class:`RunLockedError` naming the owner and the override.

        While it watches another run's lock, ``on_presumed_dead(why)`` is called once (from this
        thread) when that lock has missed its owner's heartbeats: the caller, running this in another
        thread, may start training meanwhile, writing nothing into the store until this returns.
        """
        self._cancel.clear()
        for attempt in range(CLAIM_ATTEMPTS):
            # No lock by a listing just taken (the preflight's): where writes are conditional it is
            # created (If-None-Match) without reading it first, as after holder() read none.
            listed_absent = attempt == 0 and self.listed_absent and self._conditional
            doc = None if listed_absent else self.holder()
            if doc is None:
                if self._claim():
                    break
                if (winner := self.holder()) is not None:  # another run created it since we read
                    raise self._lost_race_error(winner)
                continue
            why = self._why_free(doc)
            if why is None:
                doc, why = self._watch_heartbeat(doc, on_presumed_dead)
            if why is None:
                raise self._locked_error(doc)
            if doc.get("run_id") != self.run_id:
                log.warning(
                    "spot_callbacks: taking over the run lock %s (%s): %s", self.url, why, _owner(doc)
                )
            if self._take_over(doc):
                if doc.get("run_id") != self.run_id and why != "it was released" and FORCE_ENV not in why:
                    self.taken_from = doc
                break
            if (winner := self.holder()) is not None and winner.get("run_id") != self.run_id:
                raise self._lost_race_error(winner)
        else:
            raise self._locked_error(self.holder() or {})
        # Where the store has no conditional writes, read back: a run that wrote at the same moment
        # usually finds out here rather than after interleaving checkpoints.
        if not self._conditional and not is_local_fs(self.store.fs):
            protocol = fs_protocols(self.store.fs)[0]
            if protocol not in _said_no_conditional_writes:
                _said_no_conditional_writes.add(protocol)
                log.info(
                    "spot_callbacks: %s:// has no conditional writes here; the run lock is written and read "
                    "back, which catches most (not all) races of two runs starting at the same moment", protocol,
                )  # fmt: skip
        # A conditional create or take-over that succeeded is the proof: no other write came between
        # (reading it back costs a resume two more requests, and proves nothing more).
        if not self._conditional:
            doc = self.holder()
            if doc is not None and doc.get("run_id") != self.run_id:
                raise self._locked_error(doc)
        self._held = True
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="spot-lock-heartbeat", daemon=True)
        self._thread.start()

    def _claim(self) -> bool:
        """Create the lock where there is none; False when another run created one first (local only:
        an object store just takes the write)."""
        if self._conditional:
            return self._write_if(create=True)
        if not is_local_fs(self.store.fs):
            self._write()
            return True
        folder = os.path.dirname(self.path)
        os.makedirs(folder, exist_ok=True)
        partial = os.path.join(folder, f"{LOCK_NAME}.{self.run_id}.tmp")
        try:
            with open(partial, "xb") as handle:
                handle.write(self._encoded())
                handle.flush()
                os.fsync(handle.fileno())
            os.link(partial, self.path)  # fails if the name exists: the atomic create
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(partial)
        return True

    def _take_over(self, judged: dict[str, Any]) -> bool:
        """Replace the lock ``judged`` free by ours in one write (the lock never disappears, so its
        old owner's heartbeat reads who took it over); False when another run replaced it first."""
        if self._conditional and judged.get("run_id") != self.run_id:
            # judged is what the last holder() read: replace that object, or none if it changed since
            etag = self._read_etag
            return self._write_if(etag=etag) if etag is not None else self._write_if(create=True)
        if not is_local_fs(self.store.fs) or judged.get("run_id") == self.run_id:
            self._write()
            return True
        with self._local_writers_excluded():
            current = self.holder()
            if current is None:  # released since we judged it: create it, as where there was none
                return self._claim()
            if current != judged:  # another run's lock, or its owner's heartbeat, since we judged
                return False
            self._write()  # written beside and renamed over: the old record is replaced in one step
        return True

    @contextlib.contextmanager
    def _local_writers_excluded(self) -> Iterator[None]:
        """On the local disk, one lock writer of this run folder at a time (a take-over, a heartbeat,
        a release: each reads the lock, then writes it only if it is still what it read). ``flock`` on
        the run folder: released when its process dies, so a killed run never holds it. A filesystem
        without ``flock`` (some network mounts) goes without, and the read-back after a take-over
        still catches most races, as on object stores."""
        if not is_local_fs(self.store.fs):
            yield
            return
        folder = os.open(os.path.dirname(self.path), os.O_RDONLY)
        try:
            with contextlib.suppress(OSError):
                fcntl.flock(folder, fcntl.LOCK_EX)
            yield
        finally:
            os.close(folder)  # releases the flock

    def release(self, timeout_s: float | None = RELEASE_TIMEOUT_S) -> None:
        """Stop the heartbeat and delete the lock if it is still ours, within ``timeout_s``.

        A store that does not answer in time leaves the lock behind (logged): it goes stale and
        the next run takes it over, so the exit is never held up by it.
        """
        if not self._held:
            return
        self._held = False
        self._stop.set()
        started = time.monotonic()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        left = None if timeout_s is None else max(timeout_s - (time.monotonic() - started), 0.0)
        deleting = threading.Thread(target=self._delete_if_ours, name="spot-lock-release", daemon=True)
        deleting.start()
        deleting.join(timeout=left)
        if deleting.is_alive():
            log.warning(
                "spot_callbacks: the store did not answer within %.0fs while releasing the run lock %s; "
                "leaving it behind (it goes stale and the next run takes it over)",
                timeout_s, self.url,
            )  # fmt: skip

    def _delete_if_ours(self) -> None:
        try:
            with self._local_writers_excluded():
                doc = self.holder()
                if doc is not None and doc.get("run_id") == self.run_id:
                    self.store.retry.call(lambda: self.store.fs.rm(self.path), f"delete {self.url}")
        except Exception as err:  # noqa: BLE001 - a lock left behind goes stale; never fail the run for it
            log.warning("spot_callbacks: could not release the run lock %s: %s", self.url, err)

    def _encoded(self) -> bytes:
        return json.dumps({**self._owner, "heartbeat": time.time()}).encode()

    def _write(self) -> None:
        raw = self._encoded()
        # put_bytes writes a local lock beside and renames it, so a reader never sees half a lock.
        self.store.retry.call(lambda: put_bytes(self.store.fs, self.path, raw), f"write {self.url}")

    def _write_if(self, create: bool = False, etag: str | None = None) -> bool:
        """One conditional PUT of our lock: create it where none is (``create``), or replace exactly the
        object whose ETag is ``etag``. False when the store refused (another write came first); a
        retried PUT whose first attempt landed is refused too, so a refusal is checked against the
        lock's content before it counts as lost."""
        raw = self._encoded()
        condition: dict[str, Any] = {"mode": "create"} if create else {"IfMatch": etag}

        def put() -> Any:
            try:
                return self.store.fs.pipe_file(self.path, raw, **condition)
            except Exception as err:
                if _precondition_failed(err):
                    return False
                raise

        answer = self.store.retry.call(put, f"write {self.url}")
        if answer is False:
            current = self.holder()
            if current is None or current.get("run_id") != self.run_id:
                return False
            # our own write after all: its ETag (read before its content) is the next condition
            self._etag = self._read_etag
            return True
        etag_now = answer.get("ETag") if isinstance(answer, dict) else None
        if isinstance(etag_now, str):
            self._etag = etag_now
        else:
            self._written_at()
            self._etag = self._seen_etag
        return True

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                if self._conditional and self._etag is not None:
                    if not self._write_if(etag=self._etag):  # rewritten by another run since our last beat
                        self._lose(self.holder())
                        return
                    continue
                with self._local_writers_excluded():
                    doc = self.holder()
                    ours = doc is not None and doc.get("run_id") == self.run_id
                    if ours:
                        self._write()
                if not ours:
                    self._lose(doc)
                    return
            except Exception as err:  # noqa: BLE001 - the next beat tries again
                log.warning("spot_callbacks: could not refresh the run lock %s: %s", self.url, err)

    def _lose(self, doc: dict[str, Any] | None) -> None:
        whose = f"it is held by another run ({_owner(doc)})" if doc is not None else "it was deleted"
        self.lost_reason = (
            f"this run lost its run lock {self.url}: {whose}; it stops checkpointing into {self.store.url} "
            "so the two runs do not interleave or prune each other's checkpoints"
        )
        log.error("spot_callbacks: %s", self.lost_reason)
        if self.on_lost is not None:
            self.on_lost(self.lost_reason)

    def _lost_race_error(self, winner: dict[str, Any]) -> RunLockedError:
        return RunLockedError(
            f"{self.store.url}: another run took the run lock first ({_owner(winner)}); two runs writing "
            f"into one dirpath would interleave and prune each other's checkpoints. Use another dirpath, "
            f"or stop that run ({self.url})"
        )

    def _locked_error(self, doc: dict[str, Any]) -> RunLockedError:
        return RunLockedError(
            f"{self.store.url} is in use by another run ({_owner(doc)}); two runs writing into one dirpath "
            f"would interleave and prune each other's checkpoints. Use another dirpath, or, if that run is "
            f"gone, wait until its lock is stale ({self.stale_s:.0f}s after its last heartbeat, {STALE_ENV}) "
            f"or set {FORCE_ENV}=1 to take the lock over ({self.url})"
        )


def _modified(info: dict[str, Any]) -> float | None:
    """When an ``fs.info`` record says its object was last written (epoch seconds), or None."""
    for key in ("LastModified", "last_modified", "mtime", "updated", "created"):
        if (found := _timestamp(info.get(key))) is not None:
            return found
    return None


def _heartbeat(doc: dict[str, Any]) -> float | None:
    """The lock's heartbeat as Unix time, or None for anything a run does not write there."""
    beat = doc.get("heartbeat")
    if isinstance(beat, bool) or not isinstance(beat, (int, float)) or not 0 <= beat < 1e11:
        return None
    return float(beat)


def _owner(doc: dict[str, Any]) -> str:
    if "unreadable" in doc:
        return f"a lock no run wrote: {str(doc['unreadable'])[:200]}"
    heartbeat = _heartbeat(doc)
    age = f"{time.time() - heartbeat:.0f}s ago" if heartbeat is not None else "unknown"
    return (
        f"host {repr(doc.get('host'))[:80]}, pid {str(doc.get('pid'))[:40]}, run {str(doc.get('run_id'))[:8]}, "
        f"started {str(doc.get('started'))[:80]}, last heartbeat {age}"
    )
