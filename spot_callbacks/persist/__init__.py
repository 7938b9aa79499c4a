"""The background persister: local checkpoint folders -> durable, committed checkpoints in a store.

Two worker threads form a pipeline. The *writer* runs each job's ``write`` (serialize a staged
state into scratch) in submission order, so staging buffers are freed quickly. The *uploader*
makes one checkpoint durable at a time and commits it (manifest last). When uploads fall behind,
the newest written checkpoint wins: an older one still waiting for the uploader is dropped.

An emergency checkpoint (a job with a ``deadline``) goes first: older jobs not yet uploading are
dropped at once, and an upload already in flight is waited for only when the measured upload
speed says both fit before the deadline (:func:`plan_emergency`); otherwise the emergency
checkpoint is uploaded alongside it, at once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spot_callbacks.errors import PersistError
from spot_callbacks.store import MANIFEST_NAME, CheckpointInfo, CheckpointStore, local_payload_names
from spot_callbacks.store.checksums import FileDigest
from spot_callbacks.store.commit import settle_commit

log = logging.getLogger("spot_callbacks")

# An upload that has run this many times longer than its size predicts (plus the grace) is stalled
# or throttled, and no estimate of its end holds.
STALL_FACTOR = 3.0
STALL_GRACE_S = 1.0
SPEED_RECORDS = 3  # the upload speed is measured over the newest few commits


@dataclass
class PersistJob:
    """One checkpoint on its way to the store.

    ``local_dir`` holds the payload files, or will once ``write`` has run in the background
    (``write`` returns the digests of what it wrote). ``on_written`` runs after ``write``,
    whether it succeeded or not (release staging buffers there). ``deadline`` (epoch seconds)
    makes it an emergency checkpoint that must commit by then: older checkpoints give way.
    """

    step: int
    reason: str
    framework: str
    local_dir: Path
    epoch: int | None = None
    write: Callable[[Path], dict[str, FileDigest]] | None = None
    on_written: Callable[[], None] | None = None
    digests: dict[str, FileDigest] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    owns_local_dir: bool = True
    deadline: float | None = None
    submitted_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class PersistRecord:
    """What one committed checkpoint cost to persist."""

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


@dataclass(frozen=True)
class EmergencyPlan:
    """What to do with the upload in flight when an emergency checkpoint arrives (see :func:`plan_emergency`)."""

    finish_in_flight: bool
    seconds_left: float
    in_flight_elapsed_s: float
    in_flight_left_s: float | None = None  # None: no estimate (no speed measured yet, or stalled)
    emergency_s: float | None = None
    stalled: bool = False

    def describe(self, in_flight_step: int, emergency_step: int) -> str:
        if self.stalled:
            needs = (
                f"has been uploading for {self.in_flight_elapsed_s:.1f}s, far longer than its size predicts"
            )
        elif self.in_flight_left_s is None:
            needs = "needs an unknown time (no upload speed measured yet)"
        else:
            needs = (
                f"needs ~{self.in_flight_left_s:.1f}s more and the emergency checkpoint of step "
                f"{emergency_step} ~{self.emergency_s:.1f}s"
            )
        if self.finish_in_flight:
            action = f"finishing step {in_flight_step} first"
        else:
            action = (
                f"uploading step {emergency_step} now, alongside step {in_flight_step} "
                f"(which commits only if it finishes in time)"
            )
        return f"in-flight step {in_flight_step} {needs}, deadline in {self.seconds_left:.1f}s: {action}"


def plan_emergency(
    in_flight_bytes: int,
    in_flight_elapsed_s: float,
    emergency_bytes: int,
    bytes_per_s: float | None,
    seconds_left: float,
) -> EmergencyPlan:
    """Finish the upload in flight first only if it and then the emergency checkpoint both fit in time.

    An upload cannot be cancelled mid-put, so "not finishing" it means uploading the emergency
    checkpoint alongside it at once rather than after it.

    Example:
        >>> plan_emergency(100e6, 1.0, 100e6, bytes_per_s=100e6, seconds_left=30).finish_in_flight
        True
        >>> plan = plan_emergency(4e9, 1.0, 4e9, bytes_per_s=100e6, seconds_left=30)
        >>> plan.finish_in_flight, round(plan.in_flight_left_s)
        (False, 39)
    """
    if not bytes_per_s or bytes_per_s <= 0:
        return EmergencyPlan(False, seconds_left, in_flight_elapsed_s)
    expected_s = in_flight_bytes / bytes_per_s
    if in_flight_elapsed_s > STALL_FACTOR * expected_s + STALL_GRACE_S:
        return EmergencyPlan(False, seconds_left, in_flight_elapsed_s, stalled=True)
    left_s = max(expected_s - in_flight_elapsed_s, 0.0)
    emergency_s = emergency_bytes / bytes_per_s
    return EmergencyPlan(
        left_s + emergency_s <= seconds_left, seconds_left, in_flight_elapsed_s, left_s, emergency_s
    )


def folder_bytes(folder: Path) -> int:
    """Bytes of the payload files in a local checkpoint folder (0 when it does not exist)."""
    if not folder.is_dir():
        return 0
    return sum((folder / name).stat().st_size for name in local_payload_names(folder))


def default_scratch_root(store_url: str, scratch_dir: str | None = None) -> Path:
    """The local staging folder of one run: ``scratch_dir``, else ``$SPOT_SCRATCH``, else a temp dir.

    Runs are kept apart by a short hash of the store URL, so two runs can share a scratch disk.
    """
    base = (
        scratch_dir
        or os.environ.get("SPOT_SCRATCH")
        or os.path.join(tempfile.gettempdir(), "spot-callbacks-scratch")
    )
    run_key = hashlib.sha256(store_url.encode()).hexdigest()[:12]
    return Path(base).expanduser() / run_key


class PersistQueue:
    """What every persister shares: settled steps, failures, and waiting on them under one condition.

    Subclasses define ``_idle()`` (nothing queued, writing or uploading) and keep the job being
    uploaded in ``_busy_uploading``.
    """

    def __init__(self) -> None:
        self.records: list[PersistRecord] = []
        self.failures: list[PersistError] = []
        self.last_committed: CheckpointInfo | None = None
        self._unreported = 0
        self._cond = threading.Condition()
        self._outcomes: dict[int, str] = {}  # step -> "committed", "failed" or "dropped"
        self._busy_uploading: Any = None
        self._closed = False

    def _idle(self) -> bool:
        raise NotImplementedError

    def _join_workers(self) -> None:
        """Join the worker threads once they have stopped (after :meth:`close` finished the work)."""
        raise NotImplementedError

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


class Persister(PersistQueue):
    """Makes checkpoint folders durable in a :class:`CheckpointStore`, off the training loop.

    Args:
        store: where checkpoints are committed.
        keep_last: committed checkpoints kept by retention after each commit (0 keeps all).
        keep_local_copy: keep the newest committed folder on local disk (with its manifest), so
            a restart on the same machine skips the download.

    Example:
        >>> import tempfile, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp()) / "step-5"; folder.mkdir()
        >>> _ = (folder / "state.bin").write_bytes(b"abc")
        >>> persister = Persister(CheckpointStore("memory://doc-persist/run"), keep_last=2)
        >>> persister.submit(PersistJob(step=5, reason="manual", framework="demo", local_dir=folder))
        >>> persister.wait(timeout=30)
        True
        >>> persister.last_committed.step
        5
        >>> persister.close()
        True
    """

    def __init__(self, store: CheckpointStore, keep_last: int = 3, keep_local_copy: bool = True) -> None:
        super().__init__()
        self.store = store
        self.keep_last = keep_last
        self.keep_local_copy = keep_local_copy
        self._to_write: deque[PersistJob] = deque()
        self._to_upload: PersistJob | None = None
        self._busy_writing: PersistJob | None = None
        self._busy_uploading: PersistJob | None = None
        self._busy_since = 0.0
        self._busy_bytes = 0
        self._urgent: PersistJob | None = None  # the emergency checkpoint, until it settles
        self._alongside: dict[int, threading.Thread] = {}  # step -> emergency upload beside the uploader
        self._write_times: dict[int, float] = {}
        self._local_committed: Path | None = None
        self._writer = threading.Thread(target=self._write_loop, name="spot-writer", daemon=True)
        self._uploader = threading.Thread(target=self._upload_loop, name="spot-uploader", daemon=True)
        self._writer.start()
        self._uploader.start()

    # ------------------------------------------------------------------ API
    def submit(self, job: PersistJob) -> None:
        """Queue a checkpoint; returns at once."""
        with self._cond:
            if self._closed:
                raise RuntimeError("this Persister is closed; create a new one")
            self._to_write.append(job)
            if job.deadline is not None:
                self._make_urgent(job)
            self._cond.notify_all()

    def expedite(self, step: int, deadline: float) -> None:
        """Make the queued checkpoint of ``step`` an emergency one that must commit by ``deadline``.

        Older checkpoints not yet uploading are dropped. A no-op when that checkpoint is already
        uploading, settled, or unknown.
        """
        with self._cond:
            candidates = [*self._to_write, self._busy_writing, self._to_upload]
            job = next((j for j in candidates if j is not None and j.step == step), None)
            if job is None or (job.deadline is not None and job.deadline <= deadline):
                return  # unknown, or urgent already
            job.deadline = deadline
            self._make_urgent(job)
            self._cond.notify_all()

    def _idle(self) -> bool:
        return not (
            self._to_write or self._busy_writing or self._to_upload or self._busy_uploading or self._alongside
        )

    def _join_workers(self) -> None:
        self._writer.join()
        self._uploader.join()
        for thread in list(self._alongside.values()):
            thread.join()

    # ------------------------------------------------------------- workers
    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._to_write and not self._closed:
                    self._cond.wait()
                if not self._to_write:
                    return
                job = self._to_write.popleft()
                self._busy_writing = job
            started = time.perf_counter()
            try:
                if job.write is not None:
                    job.digests.update(job.write(job.local_dir))
                written = True
            except BaseException as err:  # noqa: BLE001 - reported, never raised in a worker
                written = False
                self._fail(job, err)
            finally:
                if job.on_written is not None:
                    job.on_written()
            with self._cond:
                self._busy_writing = None
                if written:
                    self._write_times[job.step] = time.perf_counter() - started
                    urgent = self._urgent
                    if urgent is not None and job is not urgent and job.step < urgent.step:
                        self._drop(job, f"the emergency checkpoint of step {urgent.step} goes first")
                    elif job.deadline is not None:
                        self._dispatch_urgent(job)
                    else:
                        self._queue_for_upload(job)
                self._cond.notify_all()

    def _queue_for_upload(self, job: PersistJob) -> None:
        dropped, self._to_upload = self._to_upload, job
        if dropped is not None:
            self._drop(dropped, f"step {job.step} is newer")

    def _drop(self, job: PersistJob, why: str) -> None:
        log.info("spot_callbacks: dropping checkpoint of step %d before upload: %s", job.step, why)
        self._discard_local(job)
        self._settle(job, "dropped")

    def _settle(self, job: PersistJob, outcome: str) -> None:
        self._outcomes[job.step] = outcome
        if self._urgent is job:
            self._urgent = None

    def _make_urgent(self, job: PersistJob) -> None:
        """Lock held: older checkpoints not yet uploading give way to ``job``."""
        self._urgent = job
        why = f"the emergency checkpoint of step {job.step} goes first"
        older = [j for j in self._to_write if j is not job and j.step < job.step]
        self._to_write = deque(j for j in self._to_write if not any(j is o for o in older))
        for dropped in older:
            if dropped.on_written is not None:
                dropped.on_written()
            self._drop(dropped, why)
        pending = self._to_upload
        if pending is not None and pending is not job and pending.step < job.step:
            self._to_upload = None
            self._drop(pending, why)
        elif pending is job:  # written already, waiting behind the upload in flight
            self._to_upload = None
            self._dispatch_urgent(job)

    def _dispatch_urgent(self, job: PersistJob) -> None:
        """Lock held, ``job`` written: upload it next, or now beside the upload in flight (see plan_emergency)."""
        in_flight = self._busy_uploading
        if in_flight is None:
            self._queue_for_upload(job)
            return
        plan = plan_emergency(
            in_flight_bytes=self._busy_bytes,
            in_flight_elapsed_s=time.monotonic() - self._busy_since,
            emergency_bytes=folder_bytes(job.local_dir),
            bytes_per_s=self._bytes_per_s(),
            seconds_left=job.deadline - time.time(),
        )
        log.warning("spot_callbacks: %s", plan.describe(in_flight.step, job.step))
        if plan.finish_in_flight:
            self._queue_for_upload(job)
            return
        thread = threading.Thread(
            target=self._upload_alongside, args=(job,), name="spot-emergency", daemon=True
        )
        self._alongside[job.step] = thread
        thread.start()

    def _bytes_per_s(self) -> float | None:
        recent = self.records[-SPEED_RECORDS:]
        seconds = sum(r.upload_s for r in recent)
        return sum(r.bytes for r in recent) / seconds if recent and seconds > 0 else None

    def _upload_alongside(self, job: PersistJob) -> None:
        try:
            self._upload(job)
        except BaseException as err:  # noqa: BLE001
            self._fail(job, err)
        finally:
            with self._cond:
                self._alongside.pop(job.step, None)
                self._cond.notify_all()

    def _upload_loop(self) -> None:
        while True:
            with self._cond:
                while self._to_upload is None and not (
                    self._closed and not self._to_write and not self._busy_writing
                ):
                    self._cond.wait()
                if self._to_upload is None:
                    return
                job, self._to_upload = self._to_upload, None
                self._busy_uploading = job
                self._busy_since = time.monotonic()
                self._busy_bytes = folder_bytes(job.local_dir)
            try:
                self._upload(job)
            except BaseException as err:  # noqa: BLE001
                self._fail(job, err)
            finally:
                with self._cond:
                    self._busy_uploading = None
                    self._cond.notify_all()

    def _upload(self, job: PersistJob) -> None:
        queued_s = time.monotonic() - job.submitted_at
        started = time.perf_counter()
        info = self.store.write_checkpoint(
            job.step,
            job.local_dir,
            reason=job.reason,
            framework=job.framework,
            epoch=job.epoch,
            digests=job.digests,
            metrics=job.metrics,
            extra=job.extra,
        )
        upload_s = time.perf_counter() - started
        record = PersistRecord(
            info, self._write_times.pop(job.step, 0.0), upload_s, info.size_bytes, queued_s
        )
        with self._cond:
            self.records.append(record)
            # An older upload that finished after an emergency checkpoint does not replace it.
            newest = self.last_committed is None or info.step >= self.last_committed.step
            if newest:
                self.last_committed = info
            self._settle(job, "committed")
            self._cond.notify_all()
        log.info(
            "spot_callbacks: committed %s (%s, %.1f MB in %.2fs, %.0f MB/s)",
            info.url, job.reason, info.size_bytes / 1e6, upload_s, record.mb_per_s,
        )  # fmt: skip
        if not newest:
            self._discard_local(job)
            if job.deadline is not None:
                settle_commit(self.store, info, self.keep_last, job.deadline)  # only says it was late
            return
        self._keep_local(job)
        settle_commit(self.store, info, self.keep_last, job.deadline)

    def _keep_local(self, job: PersistJob) -> None:
        if not job.owns_local_dir:
            return
        previous, self._local_committed = self._local_committed, job.local_dir
        if previous is not None and previous != job.local_dir:
            shutil.rmtree(previous, ignore_errors=True)
        if self.keep_local_copy:
            try:
                manifest = self.store.fs.cat_file(f"{self.store.step_path(job.step)}/{MANIFEST_NAME}")
                (job.local_dir / MANIFEST_NAME).write_bytes(manifest)
            except Exception:  # noqa: BLE001 - the local copy is an optimisation only
                shutil.rmtree(job.local_dir, ignore_errors=True)
                self._local_committed = None
        else:
            shutil.rmtree(job.local_dir, ignore_errors=True)
            self._local_committed = None

    def _discard_local(self, job: PersistJob) -> None:
        if job.owns_local_dir:
            shutil.rmtree(job.local_dir, ignore_errors=True)

    def _fail(self, job: PersistJob, err: BaseException) -> None:
        error = PersistError(job.step, self.store.step_url(job.step), err, job.local_dir)
        error.__cause__ = err
        log.error("spot_callbacks: %s", error)
        with self._cond:
            self.failures.append(error)
            self._settle(job, "failed")
            self._cond.notify_all()
