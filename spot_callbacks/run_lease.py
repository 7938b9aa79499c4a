"""The run lock held while training: the writer takes it, every rank learns a refusal.

One training run per ``dirpath`` (see ``store/runlock.py`` for the lock itself): the writer takes
the lock when training starts and releases it after the last upload. A lock another live run
holds stops every rank with :class:`~spot_callbacks.errors.RunLockedError`. Before the lock, the
store is proven usable (``store/preflight.py``): a misconfigured ``dirpath`` stops every rank with
:class:`~spot_callbacks.errors.StoreUnavailableError` before the first step. A lock that another
run takes over later is noticed by its heartbeat (:attr:`RunLease.lost`).
"""

from __future__ import annotations

import logging

from spot_callbacks.errors import CheckpointError, RunLockedError, StoreUnavailableError
from spot_callbacks.store import CheckpointStore
from spot_callbacks.store.preflight import preflight
from spot_callbacks.store.runlock import RELEASE_TIMEOUT_S, RunLock
from spot_callbacks._dist import broadcast_object, is_writer

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

    def acquire(self) -> None:
        """Prove the store usable and take the lock on the writer (collective), before anything is
        written; every rank raises :class:`StoreUnavailableError` or :class:`RunLockedError` alike."""
        refusal: CheckpointError | None = None
        if is_writer() and self.lock is None:
            lock = RunLock(self.store)
            try:
                preflight(self.store)
                lock.acquire()
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

    @property
    def lost(self) -> bool:
        """True once the heartbeat found another run's lock in place of ours (see RunLock.lost)."""
        return self.lock is not None and self.lock.lost

    def release(self, timeout_s: float | None = RELEASE_TIMEOUT_S) -> None:
        """Release the lock, waiting at most ``timeout_s`` for the store (see :meth:`RunLock.release`)."""
        if self.lock is not None:
            self.lock.release(timeout_s)
            self.lock = None
