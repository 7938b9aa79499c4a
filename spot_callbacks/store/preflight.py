"""Proving a store usable before training: write, read back, list and delete one probe object.

A bucket that does not exist, a key the store refuses or a read-only folder otherwise shows
only when the first checkpoint fails, after the run paid for its steps. :func:`preflight`
runs on the writer before anything else is written: a permanent failure raises
:class:`~spot_callbacks.errors.StoreUnavailableError` at once, a transient one (timeouts, 5xx,
a refused connection) is retried within ``$SPOT_PREFLIGHT_TIMEOUT_S`` (default 60 s; a refused
connection gets half of it) and then raises the same error. ``SPOT_PREFLIGHT=0`` skips it.

The probe, ``<dirpath>/.spot-preflight-<token>``, is the only object it writes, and it is deleted.
"""

from __future__ import annotations

import errno
import logging
import posixpath
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import spot_callbacks.settings as settings
from spot_callbacks.errors import AttemptTimeoutError, SpotError, StoreUnavailableError
from spot_callbacks.store.backends import backend_of, fs_protocols
from spot_callbacks.store.checkpoint_store import RunListing
from spot_callbacks.store.diagnosis import Diagnosis, causes, diagnose
from spot_callbacks.store.layout import list_folder, missing_root_reason, remove_file
from spot_callbacks.store.retry import call_with_timeout
from spot_callbacks.store.transfer import get_bytes, put_bytes

if TYPE_CHECKING:
    from spot_callbacks.store.checkpoint_store import CheckpointStore

log = logging.getLogger("spot_callbacks")
T = TypeVar("T")

PREFLIGHT_ENV = settings.PREFLIGHT.name
PREFLIGHT_TIMEOUT_ENV = settings.PREFLIGHT_TIMEOUT_S.name
DEFAULT_BUDGET_S = 60.0
PROBE_PREFIX = ".spot-preflight-"
_BACKOFF_S = (0.5, 1.0, 2.0, 4.0)
_CONNECT_CHECK_S = 2.0
_TIMEOUT_FIX = f"raise {PREFLIGHT_TIMEOUT_ENV} for a slow store"


class _ProbeMismatch(SpotError, ValueError):
    """The probe read back is not what was written (permanent: a store that changes bytes)."""


class _ProbeNotListed(SpotError, OSError):
    """The probe is not in the listing yet (transient: an eventually consistent listing)."""


def preflight(
    store: CheckpointStore,
    budget_s: float | None = None,
    enabled: bool | None = None,
    on_writable: Callable[[], None] | None = None,
) -> set[str] | None:
    """Prove that ``store`` can hold checkpoints, or raise :class:`StoreUnavailableError` within ``budget_s``;
    return the names its listing found directly in the run folder (``None``: not checked).

    ``budget_s`` defaults to ``$SPOT_PREFLIGHT_TIMEOUT_S`` (60 s); ``enabled`` to ``$SPOT_PREFLIGHT``
    (``0`` skips the check, with a warning). The error is logged as one line; each failed attempt's
    traceback only at debug level. ``on_writable`` runs once the probe object is written (the store
    answers and takes writes), before the rest of the check, in this thread: what must be in the store
    as early as it can be (the process's attempt record) is written then, one write after the other.

    Example:
        >>> from spot_callbacks.store import CheckpointStore
        >>> store = CheckpointStore("memory://doc-preflight/run")
        >>> sorted(preflight(store, budget_s=10)), store.fs.exists(store.root)
        ([], False)
    """
    if not preflight_enabled(enabled):
        log.warning(
            "spot_callbacks: %s=0: NOT checking that %s can hold checkpoints; training goes on without a "
            "proven store, and checkpoints that cannot be persisted are reported as they fail, their local "
            "copies kept",
            PREFLIGHT_ENV, store.url,
        )  # fmt: skip
        if on_writable is not None:
            on_writable()
        return None
    budget_s = preflight_budget_s() if budget_s is None else budget_s
    probe = _Probe(store, budget_s, on_writable=on_writable)
    try:
        probe.run()
    except StoreUnavailableError as err:
        log.error("spot_callbacks: %s", err)
        err.said_in_log = True
        raise
    return probe.listed - {posixpath.basename(probe.path)}


def probe_readable(store: CheckpointStore, budget_s: float | None = None) -> list[str]:
    """The entries of ``store``'s run folder (``[]``: nothing there, or no such folder), read within the
    preflight's bounds, or :class:`StoreUnavailableError` with the cause and the fix.

    The read-only half of :func:`preflight` (nothing is written), for what only reads a store
    (the ``spot-callbacks`` command): the same diagnosis, the same budget (``$SPOT_PREFLIGHT_TIMEOUT_S``,
    half of it for a refused connection), one line instead of the backend's retries and tracebacks.
    A missing bucket raises (a listing of it would be empty just the same).

    Example:
        >>> from spot_callbacks.store import CheckpointStore
        >>> probe_readable(CheckpointStore("memory://doc-probe/nothing-here"), budget_s=10)
        []
    """
    probe = _Probe(store, preflight_budget_s() if budget_s is None else budget_s, reading=True)
    entries = probe.attempt(probe.listing, "list dirpath")
    if not entries:
        _refuse_a_missing_bucket(probe)
    return entries


def probe_listings(store: CheckpointStore, budget_s: float | None = None, objects: bool = True) -> RunListing:
    """:func:`probe_readable` for a resume: its listing of the run folder, and every object under it
    with its details listed at the same time (what orders the lineages: ``checkpoint_store.stored_times``),
    handed to the resume (``resume.pull_latest``), which lists neither again: one round trip where a
    probe and then the resume's own listings took two.

    Only the probe's listing is bounded and diagnosed; the other one, on a thread beside it (object
    stores; the local disk needs none), is taken as it comes: when it fails (or the probe does) the
    resume lists the objects itself, as without a probe. ``objects=False``: the probe's listing only
    (a rank that does not pick the checkpoint: one recursive listing per run, not one per rank).

    Example:
        >>> from spot_callbacks.store import CheckpointStore
        >>> probe_listings(CheckpointStore("memory://doc-probe/nothing-there"), budget_s=10)
        RunListing(entries=[], objects={})
    """
    found: list[dict[str, Any]] = []
    lister = None
    if objects and not store._is_local:
        lister = threading.Thread(target=_list_objects, args=(store, found), name="spot-list", daemon=True)
        lister.start()
    entries = probe_readable(store, budget_s)  # raises for a store that cannot be read: nothing waits then
    if lister is not None:
        lister.join(settings.STORE_TIMEOUT_S.value())  # as one attempt of the resume's own listing may take
    return RunListing(entries, found[0] if found else None)


def _list_objects(store: CheckpointStore, into: list[dict[str, Any]]) -> None:
    """Every object under ``store``'s run folder with its details, appended to ``into`` (nothing when
    the listing fails: the caller lists again, with the store's retries)."""
    try:
        into.append(store.fs.find(store.root, withdirs=False, detail=True))
    except FileNotFoundError:
        into.append({})
    except Exception:  # noqa: BLE001 - the resume lists again, and says what fails then
        log.debug(
            "spot_callbacks: listing the objects of %s beside the probe failed", store.url, exc_info=True
        )


def _refuse_a_missing_bucket(probe: _Probe) -> None:
    """An empty listing: raise when the bucket itself is missing (a listing of it is just as empty)."""
    store = probe.store
    missing = probe.attempt(lambda: missing_root_reason(store.fs, store.root), "find dirpath's bucket")
    # A missing local folder is as empty as a prefix with nothing under it: not an error here.
    if missing is not None and not missing.startswith("no such folder"):
        found = Diagnosis(True, missing, "create it first, or correct its name in dirpath")
        raise probe.error("list dirpath", found, FileNotFoundError(missing))


def preflight_enabled(enabled: bool | None = None) -> bool:
    """``enabled`` if given, else ``$SPOT_PREFLIGHT`` (on unless ``0``, ``false``, ``off`` or ``no``).

    Example:
        >>> preflight_enabled(), preflight_enabled(False)
        (True, False)
    """
    if enabled is not None:
        return enabled
    return settings.PREFLIGHT.value()


def preflight_budget_s() -> float:
    """``$SPOT_PREFLIGHT_TIMEOUT_S`` (default 60): how long the preflight may retry a transient failure.

    Example:
        >>> preflight_budget_s()
        60.0
    """
    return settings.PREFLIGHT_TIMEOUT_S.value()


def _is_connect_timeout(error: BaseException) -> bool:
    """A connection that never opened (botocore's ConnectTimeoutError, aiohttp's, a socket's)."""
    return any("ConnectTimeout" in type(e).__name__ or "Connect timeout" in str(e) for e in causes(error))


class _Probe:
    """One preflight of one store: the probe's path, the deadline, and the steps against it."""

    def __init__(
        self,
        store: CheckpointStore,
        budget_s: float,
        reading: bool = False,
        on_writable: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.on_writable = on_writable
        self.reading = reading
        self.budget_s = budget_s
        self.started = time.monotonic()
        # Until the store first answers anything, a refused endpoint is retried for half the connect
        # timeout (a refusal comes back in milliseconds: that is a dozen tries, enough for a server
        # still starting) and a silent one (accepts, never answers) for twice it: seconds, not the budget.
        connect_s = settings.CONNECT_TIMEOUT_S.value()
        self.refused_until = self.started + min(connect_s / 2, budget_s / 2)
        self.refused = False  # the last try was refused: the next one may not outlive refused_until
        self.first_answer_by = self.started + min(2 * connect_s, budget_s)
        self.answered = False
        self.deadline = self.started + budget_s
        self.path = posixpath.join(store.root, f"{PROBE_PREFIX}{uuid.uuid4().hex[:12]}")
        self.listed: set[str] = set()  # the names in the run folder, as the check's listing found them
        self.payload = f"spot_callbacks preflight of {store.url}\n".encode()
        self.protocol = fs_protocols(store.fs)[0]
        self.bucket = store.root if backend_of(self.protocol).local else store.root.lstrip("/").split("/")[0]

    def run(self) -> None:
        fs = self.store.fs
        self.attempt(lambda: put_bytes(fs, self.path, self.payload), "write a probe object")
        try:
            if self.on_writable is not None:
                self.on_writable()
            self.attempt(self.read_back, "read the probe back")
            self.attempt(self.find_in_listing, "list dirpath")
        except BaseException:
            self.discard()
            raise
        self.attempt(lambda: remove_file(self.store, self.path), "delete the probe object")
        elapsed_s = time.monotonic() - self.started
        log.debug("spot_callbacks: preflight of %s passed in %.2fs", self.store.url, elapsed_s)

    def listing(self) -> list[str]:
        try:
            return list_folder(self.store.fs, self.store.root)
        except FileNotFoundError:  # an object store's prefix with nothing under it, a missing folder
            return []

    def read_back(self) -> None:
        if hasattr(self.store.fs, "invalidate_cache"):
            self.store.fs.invalidate_cache(self.path)
        raw = get_bytes(self.store.fs, self.path)
        if raw != self.payload:
            raise _ProbeMismatch(f"read {len(raw)} bytes back from {self.path}, wrote {len(self.payload)}")

    def find_in_listing(self) -> None:
        names = {
            posixpath.basename(entry.rstrip("/")) for entry in list_folder(self.store.fs, self.store.root)
        }
        if posixpath.basename(self.path) not in names:
            raise _ProbeNotListed(f"{self.path} is not listed under {self.store.root} yet")
        self.listed = names

    def attempt(self, step: Callable[[], T], what: str) -> T:
        """``step`` until it succeeds (its value), fails permanently, or the budget is spent (then raise)."""
        waiter = threading.Event()
        for tries in range(1, 10_000):
            limit = self.deadline if self.answered else min(self.deadline, self.first_answer_by)
            if self.refused and not self.answered:  # botocore's own retries must not outlive the window
                limit = min(limit, self.refused_until + 0.5)
            remaining_s = limit - time.monotonic()
            try:
                value = call_with_timeout(step, max(remaining_s, 0.05), f"preflight: {what}", _TIMEOUT_FIX)
                self.answered = True
                return value
            except Exception as err:  # noqa: BLE001 - every failure is diagnosed, the raw one kept at debug
                log.debug("spot_callbacks: preflight of %s: %s failed", self.store.url, what, exc_info=True)
                found = self.diagnose(err)
                if found.permanent:
                    raise self.error(what, found, err) from None
                silent = isinstance(err, AttemptTimeoutError) or _is_connect_timeout(err)
                if not (found.unreachable or silent):
                    self.answered = True  # an answer, if an error one (a 503): the whole budget applies
                pause_s = _BACKOFF_S[min(tries - 1, len(_BACKOFF_S) - 1)]
                self.refused = found.unreachable
                if found.unreachable:
                    give_up_at = self.refused_until if not self.answered else self.deadline
                elif silent and not self.answered:
                    give_up_at = self.first_answer_by
                else:
                    give_up_at = self.deadline
                if time.monotonic() + pause_s >= give_up_at:
                    spent_s = time.monotonic() - self.started
                    raise self.error(what, found, err, f" (still failing after {spent_s:.0f}s)") from None
                waiter.wait(pause_s)
        raise AssertionError("unreachable: the budget ends the loop")

    def diagnose(self, error: BaseException) -> Diagnosis:
        if isinstance(error, _ProbeMismatch):
            return Diagnosis(
                True, f"the store returned other bytes than were written ({error})", "check the store"
            )
        found = diagnose(error, self.protocol, self.bucket, reading=self.reading)
        if isinstance(error, AttemptTimeoutError) and _endpoint_refuses(self.store.fs):
            # A backend that retries a refused connection longer than our attempt lasts (gcsfs)
            # looks hung from here; one direct connect tells the two apart.
            return diagnose(
                ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), self.protocol, ""
            )
        return found

    def error(
        self, what: str, found: Diagnosis, err: BaseException, spent: str = ""
    ) -> StoreUnavailableError:
        if not spent:
            fix = found.fix
        elif not self.answered:  # nothing ever answered: a longer budget would not have helped
            fix = f"{found.fix}; if the store is only starting, raise {settings.CONNECT_TIMEOUT_S.name}"
        else:
            fix = f"{found.fix}; or raise {PREFLIGHT_TIMEOUT_ENV} (now {self.budget_s:.0f}s)"
        return StoreUnavailableError(self.store.dirpath, f"could not {what}: {found.cause}{spent}", fix, err)

    def discard(self) -> None:
        """Best effort, briefly: the probe of a preflight that failed after writing it."""
        try:
            call_with_timeout(lambda: remove_file(self.store, self.path), 5.0, "delete the probe object")
        except Exception:  # noqa: BLE001 - a stray probe is harmless; the failure that led here is the news
            log.debug("spot_callbacks: could not delete the probe %s", self.path, exc_info=True)


def _endpoint_refuses(fs: object) -> bool:
    """True when the ``endpoint_url`` of ``fs``'s options refuses a TCP connection right now."""
    options = getattr(fs, "storage_options", None) or {}
    endpoint = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url")
    if not isinstance(endpoint, str):
        return False
    try:
        parts = urlsplit(endpoint)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return False
    if not parts.hostname:
        return False
    try:
        socket.create_connection((parts.hostname, port), timeout=_CONNECT_CHECK_S).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False
