"""The run lock held while training: the writer takes it, every rank learns a refusal.

One training run per ``dirpath`` (see ``store/runlock.py`` for the lock itself): the writer takes
the lock when training starts and releases it after the last upload. A lock another live run
holds stops every rank with :class:`~spot_callbacks.errors.RunLockedError`; storage trouble
while taking it is a warning (training goes on without it; the persister reports the storage).
"""

from __future__ import annotations

import logging

from spot_callbacks.errors import RunLockedError
from spot_callbacks.store import CheckpointStore
from spot_callbacks.store.runlock import RunLock
from spot_callbacks.trigger.collectives import broadcast_object, is_writer

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
        """Take the lock on the writer (collective); every rank raises if another run holds it."""
        refusal = None
        if is_writer() and self.lock is None:
            lock = RunLock(self.store)
            try:
                lock.acquire()
                self.lock = lock
            except RunLockedError as err:
                refusal = str(err)
            except Exception as err:  # noqa: BLE001 - storage trouble is the persister's to report
                log.warning(
                    "spot_callbacks: could not take the run lock of %s, training without it: %s: %s",
                    self.store.url, type(err).__name__, err,
                )  # fmt: skip
        refusal = broadcast_object(refusal)
        if refusal is not None:
            raise RunLockedError(refusal)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
