"""The single-writer pipeline: local checkpoint folders -> durable, committed checkpoints in a store.

Two worker threads form a pipeline. The *writer* runs each job's ``write`` (serialize a staged
state into scratch) in submission order, so staging buffers are freed quickly. The *uploader*
makes one checkpoint durable at a time and commits it (manifest last). When uploads fall behind,
the newest written checkpoint wins: an older one still waiting for the uploader is dropped.

An emergency checkpoint (a job with a ``deadline``) goes first: older jobs not yet uploading are
dropped at once, and an upload already in flight is waited for only when the measured upload
speed says both fit before the deadline (:func:`~spot_callbacks.persist.emergency.plan_emergency`);
otherwise the emergency checkpoint is uploaded alongside it, at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from spot_callbacks._format import human_rate, human_size
from spot_callbacks.log import checkpoint_line
from spot_callbacks.persist.emergency import measured_bytes_per_s, plan_emergency
from spot_callbacks.persist.heap import trim_heap
from spot_callbacks.persist.scratch import NewestCommittedFolder, discard_folder, folder_bytes, prune_scratch
from spot_callbacks.persist.tracking import CheckpointJob, Outcome, PersistRecord, StepTracker
from spot_callbacks.store import MANIFEST_NAME, CheckpointStore, CommitWriter
from spot_callbacks.store.checksums import FileDigest
from spot_callbacks.store.transfer import write_local_atomically

log = logging.getLogger("spot_callbacks")


@dataclass
class PersistJob(CheckpointJob):
    """One checkpoint on its way to the store through the :class:`Persister`.

    ``local_dir`` holds the payload files, or will once ``write`` has run in the background
    (``write`` returns the digests of what it wrote). ``on_written`` runs after ``write``,
    whether it succeeded or not (release staging buffers there). ``deadline`` (epoch seconds)
    makes it an emergency checkpoint that must commit by then: older checkpoints give way.

    Example:
        >>> job = PersistJob(step=5, reason="interval", framework="demo", local_dir=Path("/scratch/step-5"))
        >>> job.write is None and job.digests == {}
        True
    """

    write: Callable[[Path], dict[str, FileDigest]] | None = None
    on_written: Callable[[], None] | None = None
    digests: dict[str, FileDigest] = field(default_factory=dict)


SLOW_UPLOAD_FIX = "raise the interval or use interval='auto'"
SLOW_UPLOAD_FIX_AUTO = (
    "interval='auto' sizes the interval by the training stall, not the upload: set a fixed interval "
    "above the upload time, or a faster store"
)


class Persister(StepTracker):
    """Makes checkpoint folders durable in a :class:`CheckpointStore`, off the training loop (one writer).

    Args:
        store: where checkpoints are committed.
        keep_last: committed checkpoints kept by retention after each commit (0 keeps all).
        keep_local_copy: keep the newest committed folder on local disk (with its manifest), so
            a restart on the same machine skips the download.
        scratch_root: the run's scratch folder; after each commit and failure its step folders
            are pruned to what a restart here needs (see :func:`~spot_callbacks.persist.scratch.prune_scratch`).

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

    def __init__(
        self,
        store: CheckpointStore,
        keep_last: int = 3,
        keep_local_copy: bool = True,
        scratch_root: Path | None = None,
    ) -> None:
        super().__init__()
        self.store = store
        self.writer = CommitWriter(store)  # every step of the commit sequence
        self.keep_last = keep_last
        self.keep_local_copy = keep_local_copy
        self.scratch_root = scratch_root
        self._local_dirs: dict[int, Path] = {}  # step -> its scratch folder, to keep while in flight
        self._newest_failed: Path | None = None  # the newest failed copy this run kept in scratch
        self._newest_failed_step = -1
        self._to_upload: PersistJob | None = None
        self._busy_uploading: PersistJob | None = None
        self._busy_since = 0.0
        self._busy_bytes = 0
        self._urgent: PersistJob | None = None  # the emergency checkpoint, until it settles
        self.dropped_for_newer = 0  # checkpoints dropped because a newer one came before they uploaded
        self.slow_upload_fix = SLOW_UPLOAD_FIX  # the first drop's advice (the engine sets auto's)
        self._alongside: dict[int, threading.Thread] = {}  # step -> emergency upload beside the uploader
        self._kept = NewestCommittedFolder()
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
            self._local_dirs[job.step] = job.local_dir
            if job.deadline is not None:
                self._make_urgent(job)
            self._wake_workers()

    def adopt_local_copy(self, folder: Path) -> None:
        """``folder`` (the run's own local copy of a committed checkpoint, e.g. pulled at resume) is
        deleted like this persister's own once a newer checkpoint it owns commits."""
        with self._cond:
            self._kept.adopt(folder)

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

    def _queued_steps(self) -> list[int]:
        jobs = (*self._not_written(), self._to_upload, self._busy_uploading)
        return [job.step for job in jobs if job is not None] + list(self._alongside)

    def _join_workers(self) -> None:
        for thread in self.worker_threads():
            thread.join()

    def worker_threads(self) -> list[threading.Thread]:
        return [self._writer, self._uploader, *list(self._alongside.values())]

    # ------------------------------------------------------------- writing
    def _write_loop(self) -> None:
        while (job := self._start_writing()) is not None:
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
                    job.write_s = time.perf_counter() - started
                    self._hand_to_uploader(job)
                self._cond.notify_all()

    def _hand_to_uploader(self, job: PersistJob) -> None:
        """Lock held, ``job`` written: drop it behind an emergency, dispatch it as one, or queue it."""
        urgent = self._urgent
        if urgent is not None and job is not urgent and job.step < urgent.step:
            self._drop(job, f"the emergency checkpoint of step {urgent.step} goes first")
        elif job.deadline is not None:
            self._dispatch_urgent(job)
        else:
            self._queue_for_upload(job)

    def _queue_for_upload(self, job: PersistJob) -> None:
        dropped, self._to_upload = self._to_upload, job
        if dropped is not None:
            self.dropped_for_newer += 1
            advice = ""
            if self.dropped_for_newer == 1:  # the cause and the fix once; later drops say only which
                busy = self._busy_uploading
                running = (
                    f" (the upload of step {busy.step} has run {time.monotonic() - self._busy_since:.1f} s)"
                    if busy is not None
                    else ""
                )
                advice = f"; uploads take longer than the interval between checkpoints{running}: {self.slow_upload_fix}"
            # Only the first drop is news (it carries the cause); later ones are per-checkpoint lines.
            self._drop(dropped, f"step {job.step} is newer{advice}", every_checkpoint=not advice)

    def _drop(self, job: PersistJob, why: str, every_checkpoint: bool = False) -> None:
        say = checkpoint_line if every_checkpoint else log.info
        say("spot_callbacks: dropping checkpoint of step %d before upload: %s", job.step, why)
        discard_folder(job.local_dir, job.owns_local_dir)
        self._settle(job.step, "dropped")

    def _settle(self, step: int, outcome: Outcome) -> None:
        super()._settle(step, outcome)
        if self._urgent is not None and self._urgent.step == step:
            self._urgent = None

    # ----------------------------------------------------------- emergency
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
        assert job.deadline is not None  # only an urgent job (one with a deadline) comes here
        plan = plan_emergency(
            in_flight_bytes=self._busy_bytes,
            in_flight_elapsed_s=time.monotonic() - self._busy_since,
            emergency_bytes=folder_bytes(job.local_dir),
            bytes_per_s=measured_bytes_per_s(self.records),
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

    def _upload_alongside(self, job: PersistJob) -> None:
        self._upload_then(job, lambda: self._alongside.pop(job.step, None))

    # ----------------------------------------------------------- uploading
    def _upload_loop(self) -> None:
        while True:
            with self._cond:
                while self._to_upload is None and not (self._closed and not self._not_written()):
                    self._cond.wait()
                if self._to_upload is None:
                    return
                job, self._to_upload = self._to_upload, None
                self._busy_uploading = job
                self._busy_since = time.monotonic()
                self._busy_bytes = folder_bytes(job.local_dir)
            self._upload_then(job, self._uploaded)
            trim_heap()  # what the write and upload freed goes back to the OS (heap.py)

    def _uploaded(self) -> None:
        self._busy_uploading = None

    def _upload_then(self, job: PersistJob, no_longer_busy: Callable[[], object]) -> None:
        """Upload and commit ``job`` (a failure is recorded, never raised); then, lock held, ``no_longer_busy``."""
        try:
            self._upload(job)
        except BaseException as err:  # noqa: BLE001 - reported, never raised in a worker
            self._fail(job, err)
        finally:
            with self._cond:
                no_longer_busy()
                self._cond.notify_all()

    def _upload(self, job: PersistJob) -> None:
        queued_s = time.monotonic() - job.submitted_at
        started = time.perf_counter()
        with self._metering(job.step) as meter:
            info = self.writer.write_checkpoint(
                job.step,
                job.local_dir,
                reason=job.reason,
                framework=job.framework,
                epoch=job.epoch,
                digests=job.digests,
                metrics=job.metrics,
                extra=job.extra,
                meter=meter,
            )
        upload_s = time.perf_counter() - started
        record = PersistRecord(info, job.write_s, upload_s, info.size_bytes, queued_s)
        newest = self._record_commit(job.step, record)
        checkpoint_line(
            "spot_callbacks: committed %s (%s, %s in %.2fs, %s)",
            info.url, job.reason, human_size(info.size_bytes), upload_s, human_rate(info.size_bytes, upload_s),
        )  # fmt: skip
        if not newest:  # an older upload that finished after an emergency checkpoint: only say if it was late
            discard_folder(job.local_dir, job.owns_local_dir)
            if job.deadline is not None:
                self.writer.settle(info, self.keep_last, job.deadline)
            return
        self._keep_local(job)
        self._prune_scratch(job)
        self.writer.settle(info, self.keep_last, job.deadline)

    def _keep_local(self, job: PersistJob) -> None:
        if not job.owns_local_dir:
            return
        self._kept.keep(job.local_dir)
        if not self.keep_local_copy:
            self._kept.drop()
            return
        manifest = self.writer.written_manifest(job.step)  # as committed a moment ago: no read of it back
        if manifest is None:  # only for a step this writer did not commit (_upload just did): no local copy
            self._kept.drop()
            return
        try:
            write_local_atomically(job.local_dir / MANIFEST_NAME, manifest)
        except Exception:  # noqa: BLE001 - the local copy is an optimisation only
            self._kept.drop()

    def _fail(self, job: PersistJob, err: BaseException) -> None:
        self._record_failure(job.step, self.store.step_url(job.step), err, job.local_dir)
        if folder_bytes(job.local_dir) and job.step >= self._newest_failed_step:
            self._newest_failed, self._newest_failed_step = job.local_dir, job.step
        self._prune_scratch(job)

    def _prune_scratch(self, job: PersistJob) -> None:
        """Bound scratch after a commit or failure in it: see :func:`prune_scratch`."""
        if self.scratch_root is None or not job.owns_local_dir or job.local_dir.parent != self.scratch_root:
            return
        with self._cond:
            in_flight = [path for step, path in self._local_dirs.items() if step not in self._outcomes]
        try:
            prune_scratch(self.scratch_root, in_flight, self._newest_failed)
        except OSError as err:  # bounding scratch must never fail a checkpoint
            log.warning("spot_callbacks: could not prune the scratch folder %s: %s", self.scratch_root, err)
