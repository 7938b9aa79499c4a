"""The run lock held while training: the writer takes it, every rank learns a refusal.

One training run per ``dirpath`` (see ``store/runlock.py`` for the lock itself): the writer takes
the lock when training starts and releases it after the last upload. A lock another live run
holds stops every rank with :class:`~spot_callbacks.errors.RunLockedError`. Before the lock, the
store is proven usable (``store/preflight.py``): a misconfigured ``dirpath`` stops every rank with
:class:`~spot_callbacks.errors.StoreUnavailableError` before the first step. A lock that another
run takes over later is noticed by its heartbeat (:attr:`RunLease.lost`).

A replacement machine often arrives while a hard-killed run's lock is still fresh. A run of one
process does not wait for it to go stale: once the lock has missed its owner's heartbeats (by the
store's clock) training starts, the lock is watched on in a background thread and taken over when
stale, and every write into the store waits for it (:meth:`RunLease.hold_for_writing`; with the
default 10 s stale time and any interval longer than that, nothing waits). If the owner turns out
alive, the run stops with :class:`RunLockedError` at its next step, nothing written. Runs of several
processes wait before their first step, as their ranks would otherwise have to agree on every write.

Every exit releases the lock: :func:`release_on_unwind` wraps a framework's training entry point
(``Trainer.train``, ``Trainer.fit``) so that however it unwinds (an exception in any hook, a
Ctrl-C, a failed start) each of our callbacks' engines is stopped and its lock released. The
Hugging Face Trainer has no exception event, and Lightning's ``on_exception`` of ours is skipped
when another callback's raises first.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from spot_callbacks._dist import broadcast_object, distributed_ready, is_writer
from spot_callbacks.errors import CheckpointError, LockLostError, RunLockedError, StoreUnavailableError
from spot_callbacks.log import raised_at
from spot_callbacks.store import CheckpointStore
from spot_callbacks.store.preflight import preflight
from spot_callbacks.store.runlock import LOCK_NAME, RELEASE_TIMEOUT_S, RunLock

log = logging.getLogger("spot_callbacks")


class RunLease:
    """The writer's hold on the run lock of a store, taken and released around training.

    Example:
        >>> import tempfile
        >>> lease = RunLease(CheckpointStore(tempfile.mkdtemp()))
        >>> lease.acquire(); lease.lock is not None
        True
        >>> lease.release(); lease.lock is None
        True
    """

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self.lock: RunLock | None = None
        self.lock_wait_s: float | None = None  # how long the writer waited for the lock before training
        self.refusal: RunLockedError | None = None  # the lock watched while training was another live run's
        self._waiting: threading.Thread | None = None  # the watch that goes on while training runs
        self._waited: RunLock | BaseException | None = None  # what that watch ended with
        self._pending_lock: RunLock | None = None
        self.trained_while_waiting = False  # training began before the lock was this run's

    def acquire(
        self,
        on_store_ready: Callable[[], None] | None = None,
        on_store_writable: Callable[[], None] | None = None,
    ) -> None:
        """Prove the store usable and take the lock on the writer (collective), before anything is
        written; every rank raises :class:`StoreUnavailableError` or :class:`RunLockedError` alike.
        On the writer, ``on_store_writable`` runs inside the preflight once its probe is written (see
        :func:`preflight`), ``on_store_ready`` once the store is proven, before the lock is taken."""
        refusal: CheckpointError | None = None
        if is_writer() and self.lock is None:
            lock = RunLock(self.store)
            try:
                self.store.warm_data_plane()  # meanwhile: the resume's pull finds its clients built
                listed = preflight(self.store, on_writable=on_store_writable)
                if on_store_ready is not None:
                    on_store_ready()
                # The preflight's listing, just taken, showed no lock: try creating it (a conditional
                # write) before reading it, two requests less (runlock.RunLock.acquire).
                lock.listed_absent = listed is not None and LOCK_NAME not in listed
                waiting_since = time.monotonic()
                if distributed_ready():
                    lock.acquire()
                    self.lock = lock
                else:
                    self._acquire_while_training(lock)
                self.lock_wait_s = time.monotonic() - waiting_since
            except (StoreUnavailableError, RunLockedError) as err:
                refusal = err
            except Exception as err:  # noqa: BLE001 - storage trouble is the persister's to report
                log.warning(
                    "spot_callbacks: could not take the run lock of %s, training without it: %s: %s (%s)",
                    self.store.url, type(err).__name__, err, raised_at(err),
                )  # fmt: skip
        refusal = broadcast_object(refusal)
        if refusal is not None:
            raise refusal

    def _acquire_while_training(self, lock: RunLock) -> None:
        """Take ``lock`` in a thread; return once it is ours, refused, or presumed dead (then the
        thread watches on and :meth:`poll` / :meth:`hold_for_writing` collect its answer)."""
        ready = threading.Event()
        presumed: list[str] = []

        def presume(why: str) -> None:
            presumed.append(why)
            ready.set()

        def take() -> None:
            try:
                lock.acquire(on_presumed_dead=presume)
                self._waited = lock
            except BaseException as err:  # noqa: BLE001 - handed to the training thread
                self._waited = err
            finally:
                ready.set()

        self._pending_lock = lock
        self._waiting = threading.Thread(target=take, name="spot-lock-wait", daemon=True)
        self._waiting.start()
        ready.wait()
        if self._waiting.is_alive():
            self.trained_while_waiting = True
            log.warning(
                "spot_callbacks: training starts while the run lock of %s goes stale (%s); nothing is "
                "written into it until the lock is this run's", self.store.url, presumed[0],
            )  # fmt: skip
            return
        outcome = self._waited
        self._collect()
        if isinstance(outcome, (StoreUnavailableError, RunLockedError)):
            self.refusal = None  # refused before training: raised to every rank by acquire, as before
            raise outcome

    def _collect(self) -> None:
        """Take the watch's answer: the lock, a refusal (raised here at start, else kept in
        :attr:`refusal`), or storage trouble (training goes on without the lock, as at start)."""
        waiting, outcome = self._waiting, self._waited
        if waiting is None or waiting.is_alive():
            return
        self._waiting = self._waited = self._pending_lock = None
        if isinstance(outcome, RunLock):
            self.lock = outcome
        elif isinstance(outcome, (StoreUnavailableError, RunLockedError)):
            self.refusal = outcome if isinstance(outcome, RunLockedError) else RunLockedError(str(outcome))
        elif isinstance(outcome, BaseException):
            log.warning(
                "spot_callbacks: could not take the run lock of %s, training without it: %s: %s",
                self.store.url, type(outcome).__name__, outcome,
            )  # fmt: skip

    @property
    def pending(self) -> bool:
        """True while the lock is still being watched (training runs meanwhile, writing nothing)."""
        return self._waiting is not None

    def poll(self) -> bool:
        """Collect the background watch's answer if it has one; True when it just did."""
        if self._waiting is None or self._waiting.is_alive():
            return False
        self._collect()
        return True

    def hold_for_writing(self) -> None:
        """Before anything is written into the store: wait for a lock still watched (at most until it
        is stale), and raise :class:`RunLockedError` if it turned out to be another live run's."""
        if self._waiting is not None:
            started = time.monotonic()
            log.info("spot_callbacks: the checkpoint waits for the run lock of %s", self.store.url)
            self._waiting.join()
            self._collect()
            log.info("spot_callbacks: waited %.1fs for the run lock", time.monotonic() - started)
        if self.refusal is not None:
            raise self.refusal

    def dead_run(self) -> tuple[float, float] | None:
        """``(started, last_heartbeat)`` of a previous run seen dead through its stale lock at
        :meth:`acquire` (writer only; see :meth:`RunLock.dead_run`): an interruption no manifest records."""
        return self.lock.dead_run() if self.lock is not None else None

    def lock_cause(self) -> str | None:
        """Why taking the lock took the time it did, in a few words (writer only), or None."""
        if self.lock is None:
            return None
        taken = self.lock.taken_from
        if taken is None:
            return "free"
        meanwhile = " while training" if self.trained_while_waiting else ""
        return f"took over the lock of a dead run on {taken.get('host', 'an unknown host')}{meanwhile}"

    @property
    def lost(self) -> bool:
        """True once the heartbeat found another run's lock in place of ours (see RunLock.lost), or the
        lock watched while training turned out to be another live run's."""
        return self.refusal is not None or (self.lock is not None and self.lock.lost)

    def lost_error(self, step: int | None, newest_step: int | None) -> LockLostError | RunLockedError:
        """The error a run that lost its lock fails with, at the end of ``step`` (every rank: the
        loss is agreed; the owner's details are known on the writer)."""
        if self.refusal is not None:
            at = f" at step {step}" if step is not None else ""
            return RunLockedError(f"{self.refusal} (found{at}, before this run wrote anything)")
        why = self.lock.lost_reason if self.lock is not None else None
        at = f" at step {step}" if step is not None else ""
        newest = f"step {newest_step}" if newest_step is not None else "none"
        return LockLostError(
            f"this run lost the run lock of {self.store.url}{at}: another run took it over "
            f"({why or 'seen by the writer rank'}). It stopped checkpointing there, so the two runs do not "
            f"interleave or prune each other's checkpoints; its newest checkpoint is {newest}. Stop the "
            "other run (or give one of them another dirpath), then resume from the store's newest checkpoint"
        )

    def release(self, timeout_s: float | None = RELEASE_TIMEOUT_S) -> None:
        """Release the lock, waiting at most ``timeout_s`` for the store (see :meth:`RunLock.release`);
        a watch still going on is ended first (a lock it takes meanwhile is released too)."""
        if self._waiting is not None and self._pending_lock is not None:
            self._pending_lock.cancel_wait()
            self._waiting.join(timeout_s)
            self._collect()
            self.refusal = None  # ended by us: not another run's
        if self.lock is not None:
            self.lock.release(timeout_s)
            self.lock = None


_UNWIND_MARK = "_spot_releases_on_unwind"


def release_on_unwind(owner: type, method: str, spot_callbacks_of: Callable[[Any], Iterable[Any]]) -> None:
    """Wrap ``owner.method`` so that when it returns or raises, ``callback.engine.abandon(error)``
    runs for each callback ``spot_callbacks_of(self)`` yields (a no-op for an engine that finished).

    Idempotent and process-wide, like the framework method it wraps; the original error is always
    the one raised (a failure while releasing is logged).

    Example:
        >>> class Engine:
        ...     def abandon(self, error):
        ...         print("released after", type(error).__name__)
        >>> class Trainer:
        ...     callbacks = [type("Spot", (), {"engine": Engine()})()]
        ...     def train(self):
        ...         raise KeyError("step 5")
        >>> release_on_unwind(Trainer, "train", lambda trainer: trainer.callbacks)
        >>> try:
        ...     Trainer().train()
        ... except KeyError as err:
        ...     print("raised", err)
        released after KeyError
        raised 'step 5'
    """
    original = getattr(owner, method)
    if getattr(original, _UNWIND_MARK, False):
        return

    @functools.wraps(original)
    def entry_point(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            result = original(self, *args, **kwargs)
        except BaseException as error:
            _abandon_all(spot_callbacks_of(self), error)
            raise
        _abandon_all(spot_callbacks_of(self), None)
        return result

    setattr(entry_point, _UNWIND_MARK, True)
    setattr(owner, method, entry_point)


def _abandon_all(callbacks: Iterable[Any], error: BaseException | None) -> None:
    for callback in callbacks:
        engine = getattr(callback, "engine", None)
        try:
            if engine is not None:
                engine.abandon(error)
        except BaseException as failure:  # noqa: BLE001 - the training's own error is the one to raise
            log.warning(
                "spot_callbacks: releasing the run after %s failed: %s: %s",
                type(error).__name__ if error is not None else "the end of training",
                type(failure).__name__, failure,
            )  # fmt: skip
