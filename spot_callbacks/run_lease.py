"""The run lock held while training: the writer takes it, every rank learns a refusal.

One training run per ``dirpath`` (see ``store/runlock.py`` for the lock itself): the writer takes
the lock when training starts and releases it after the last upload. A lock another live run
holds stops every rank with :class:`~spot_callbacks.errors.RunLockedError`. Before the lock, the
store is proven usable (``store/preflight.py``): a misconfigured ``dirpath`` stops every rank with
:class:`~spot_callbacks.errors.StoreUnavailableError` before the first step. A lock that another
run takes over later is noticed by its heartbeat (:attr:`RunLease.lost`).

Every exit releases the lock: :func:`release_on_unwind` wraps a framework's training entry point
(``Trainer.train``, ``Trainer.fit``) so that however it unwinds (an exception in any hook, a
Ctrl-C, a failed start) each of our callbacks' engines is stopped and its lock released. The
Hugging Face Trainer has no exception event, and Lightning's ``on_exception`` of ours is skipped
when another callback's raises first.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from spot_callbacks._dist import broadcast_object, is_writer
from spot_callbacks.errors import CheckpointError, LockLostError, RunLockedError, StoreUnavailableError
from spot_callbacks.store import CheckpointStore
from spot_callbacks.store.preflight import preflight
from spot_callbacks.store.runlock import RELEASE_TIMEOUT_S, RunLock

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
        self.lock_wait_s: float | None = None  # how long taking the lock took (the writer's)

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
                preflight(self.store, on_writable=on_store_writable)
                if on_store_ready is not None:
                    on_store_ready()
                waiting_since = time.monotonic()
                lock.acquire()
                self.lock_wait_s = time.monotonic() - waiting_since
                self.lock = lock
            except (StoreUnavailableError, RunLockedError) as err:
                refusal = err
            except Exception as err:  # noqa: BLE001 - storage trouble is the persister's to report
                log.warning(
                    "spot_callbacks: could not take the run lock of %s, training without it: %s: %s",
                    self.store.url, type(err).__name__, err,
                )  # fmt: skip
        refusal = broadcast_object(refusal)
        if refusal is not None:
            raise refusal

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
        return f"took over the lock of a dead run on {taken.get('host', 'an unknown host')}"

    @property
    def lost(self) -> bool:
        """True once the heartbeat found another run's lock in place of ours (see RunLock.lost)."""
        return self.lock is not None and self.lock.lost

    def lost_error(self, step: int | None, newest_step: int | None) -> LockLostError:
        """The error a run that lost its lock fails with, at the end of ``step`` (every rank: the
        loss is agreed; the owner's details are known on the writer)."""
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
        """Release the lock, waiting at most ``timeout_s`` for the store (see :meth:`RunLock.release`)."""
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
