"""What every persister keeps about the steps submitted to it: how each settled, what commits cost, what failed."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from spot_callbacks.errors import PersistError
from spot_callbacks.preemption.exit_guard import guard
from spot_callbacks.store import CheckpointInfo
from spot_callbacks.store.meter import TransferMeter

log = logging.getLogger("spot_callbacks")

Outcome = Literal["committed", "failed", "dropped"]

_waking = threading.local()  # .held: the trackers whose submissions wait for the block's end


@contextlib.contextmanager
def workers_woken_after() -> Iterator[None]:
    """Checkpoints submitted in this block (by this thread) wake their persister's workers when the
    block ends, not at the submission.

    A worker woken in the middle of a training hook takes the GIL for its first Python (opening the
    folder, ``torch.save``'s pickling), and the rest of the hook (the Trainer's log of the checkpoint's
    metrics, the bookkeeping) waits up to the interpreter's switch interval (5 ms) for it each time it
    wants it back: a blocked window several times the bookkeeping's CPU. Woken at the hook's end, the
    worker's first Python overlaps training's next step instead, whose torch ops release the GIL.

    Example:
        >>> with workers_woken_after():
        ...     pass  # persister.submit(job): queued now, its workers woken here
    """
    if getattr(_waking, "held", None) is not None:  # nested: the outer block wakes them
        yield
        return
    held: list[StepTracker] = []
    _waking.held = held
    try:
        yield
    finally:
        _waking.held = None
        for tracker in held:
            with tracker._cond:
                tracker._cond.notify_all()


@dataclass
class CheckpointJob:
    """One checkpoint on its way to the store: what every persister's job holds.

    ``deadline`` (epoch seconds) makes it an emergency checkpoint that must commit by then;
    ``owns_local_dir``: the folder is the run's to delete (not a framework's or a user's).

    Example:
        >>> job = CheckpointJob(step=5, reason="interval", framework="demo", local_dir=Path("/scratch/step-5"))
        >>> job.deadline is None and job.owns_local_dir
        True
    """

    step: int
    reason: str
    framework: str
    local_dir: Path
    epoch: int | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    owns_local_dir: bool = True
    deadline: float | None = None
    submitted_at: float = field(default_factory=time.monotonic)
    write_s: float = 0.0  # set once its files are written


@dataclass(frozen=True)
class PersistRecord:
    """What one committed checkpoint cost to persist.

    Example:
        >>> from datetime import datetime, timezone
        >>> info = CheckpointInfo(3, "memory://run/step-3", datetime.now(timezone.utc), "interval", 8_000_000, "demo")
        >>> record = PersistRecord(info, write_s=1.0, upload_s=2.0, bytes=8_000_000, queued_s=0.5)
        >>> record.persist_s, record.mb_per_s
        (3.0, 4.0)
    """

    info: CheckpointInfo
    write_s: float
    upload_s: float
    bytes: int
    queued_s: float

    @property
    def persist_s(self) -> float:
        return self.write_s + self.upload_s

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.upload_s if self.upload_s > 0 else float("inf")


class StepTracker(ABC):
    """The submitted steps of one persister: how each settled, the commit records, failures, and waiting on them.

    One condition guards it and the subclass's own queues. A subclass says which steps its queues
    hold (queued, being written or uploading: it is idle when none) and joins its workers; it keeps
    the job being uploaded in ``_busy_uploading`` and, where it has a writer thread, the jobs to write
    in ``_to_write``.

    Example:
        >>> class NothingQueued(StepTracker):
        ...     def _queued_steps(self): return []
        ...     def _join_workers(self): pass
        >>> tracker = NothingQueued()
        >>> tracker.wait(timeout=1), tracker.wait_for_step(3, timeout=1), tracker.unsettled_steps(), tracker.close()
        (True, False, [], True)
    """

    def __init__(self) -> None:
        self.records: list[PersistRecord] = []
        self.failures: list[PersistError] = []
        self.last_committed: CheckpointInfo | None = None
        self._unreported = 0
        self._cond = threading.Condition()  # reentrant: the record helpers below take it again
        self._outcomes: dict[int, Outcome] = {}
        self._to_write: deque[Any] = deque()  # the writer stage, in a persister that has one
        self._busy_writing: Any = None
        self._busy_uploading: CheckpointJob | None = None
        self._closed = False
        self._meters: dict[int, TransferMeter] = {}  # step -> its upload's meter, while it uploads
        guard(self)  # the process never exits while a worker is inside torch.save

    def upload_meter(self, step: int | None = None) -> TransferMeter | None:
        """The meter of this process's upload of ``step`` (``None``: the newest upload running) while it
        runs; None before it starts and after."""
        with self._cond:
            if step is None:
                return self._meters[max(self._meters)] if self._meters else None
            return self._meters.get(step)

    @contextlib.contextmanager
    def _metering(self, step: int) -> Iterator[TransferMeter]:
        """A meter for the upload of ``step`` in the block, seen by :meth:`upload_meter` while it runs."""
        meter = TransferMeter("upload")
        with self._cond:
            self._meters[step] = meter
        try:
            yield meter
        finally:
            with self._cond:
                if self._meters.get(step) is meter:
                    del self._meters[step]

    def _wake_workers(self) -> None:
        """Lock held: a job was queued; its workers are woken now, or at the end of the caller's
        :func:`workers_woken_after` block."""
        held = getattr(_waking, "held", None)
        if held is None:
            self._cond.notify_all()
        elif self not in held:
            held.append(self)

    def _idle(self) -> bool:
        """Lock held: nothing queued, writing or uploading."""
        return not self._queued_steps()

    @abstractmethod
    def _join_workers(self) -> None:
        """Join the worker threads once they have stopped (after :meth:`close` finished the work)."""

    def worker_threads(self) -> list[threading.Thread]:
        """The threads doing this persister's work (joined, with a bound, when the process exits)."""
        return []

    def close(self, timeout: float | None = None) -> bool:
        """Finish pending work (up to ``timeout``) and stop the workers; True if all finished."""
        finished = self.wait(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if finished:
            self._join_workers()
        return finished

    def _wait_until(self, done: Callable[[], bool], timeout: float | None) -> bool:
        """Wait (lock held while checking) until ``done()``; False if ``timeout`` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            held = getattr(_waking, "held", None)
            if held is not None and self in held:  # waiting on workers this block has not woken yet
                held.remove(self)
                self._cond.notify_all()
            while not done():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted checkpoint is committed, failed or dropped; False if ``timeout`` ran out."""
        return self._wait_until(self._idle, timeout)

    def wait_for_step(self, step: int, timeout: float | None = None) -> bool:
        """Block until the checkpoint of ``step`` settled; True if it committed.

        Unlike :meth:`wait`, uploads of older checkpoints still in flight are not waited for.
        """
        self._wait_until(lambda: step in self._outcomes or self._idle(), timeout)
        with self._cond:
            return self._outcomes.get(step) == "committed"

    def unsettled_steps(self) -> list[int]:
        """The submitted steps not committed, failed or dropped yet (queued, being written or uploading)."""
        with self._cond:
            return sorted({step for step in self._queued_steps() if step not in self._outcomes})

    @abstractmethod
    def _queued_steps(self) -> list[int]:
        """Lock held: the steps of the jobs queued, being written or uploading."""

    @property
    def idle(self) -> bool:
        with self._cond:
            return self._idle()

    @property
    def in_flight_step(self) -> int | None:
        """The step being uploaded now, if any."""
        with self._cond:
            return self._busy_uploading.step if self._busy_uploading else None

    def new_failures(self) -> list[PersistError]:
        """Failures not yet returned by this method (the adapters report them at the next step)."""
        with self._cond:
            fresh = self.failures[self._unreported :]
            self._unreported = len(self.failures)
        return fresh

    # ----------------------------------------------- for the subclasses
    def _start_writing(self) -> Any:
        """For the writer thread: block until a job is queued to write and make it the one being written;
        None once closed with nothing left to write."""
        with self._cond:
            while not self._to_write and not self._closed:
                self._cond.wait()
            self._busy_writing = self._to_write.popleft() if self._to_write else None
            return self._busy_writing

    def _not_written(self) -> list[Any]:
        """Lock held: the jobs queued to write or being written."""
        return [*self._to_write, *([self._busy_writing] if self._busy_writing is not None else [])]

    def _settle(self, step: int, outcome: Outcome) -> None:
        """Lock held: the checkpoint of ``step`` is done with."""
        self._outcomes[step] = outcome

    def _record_commit(self, step: int, record: PersistRecord) -> bool:
        """Settle ``step`` as committed; True when it is the newest commit so far.

        An older upload that finished after an emergency checkpoint does not replace it.
        """
        with self._cond:
            self.records.append(record)
            newest = self.last_committed is None or record.info.step >= self.last_committed.step
            if newest:
                self.last_committed = record.info
            self._settle(step, "committed")
            self._cond.notify_all()
        return newest

    def _record_failure(
        self, step: int, url: str, cause: BaseException, kept: Path | None, *, say: bool = True
    ) -> None:
        """Settle ``step`` as failed with a :class:`PersistError` (logged when ``say``); ``kept``: its local copy."""
        error = PersistError(step, url, cause, kept)
        error.__cause__ = cause
        if say:
            log.error("spot_callbacks: %s", error)
        with self._cond:
            self.failures.append(error)
            self._settle(step, "failed")
            self._cond.notify_all()
