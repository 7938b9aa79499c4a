"""The background persister: local checkpoint folders -> durable, committed checkpoints in a store.

Two worker threads form a pipeline. The *writer* runs each job's ``write`` (serialize a staged
state into scratch) in submission order, so staging buffers are freed quickly. The *uploader*
makes one checkpoint durable at a time and commits it (manifest last). When uploads fall behind,
the newest written checkpoint wins: an older one still waiting for the uploader is dropped.
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

from spot_callbacks.checksums import FileDigest
from spot_callbacks.store import MANIFEST_NAME, CheckpointInfo, CheckpointStore

log = logging.getLogger("spot_callbacks")


class PersistError(RuntimeError):
    """A checkpoint could not be made durable; ``url`` names where it was going, ``__cause__`` why."""

    def __init__(self, step: int, url: str, cause: BaseException, local_dir: Path | None) -> None:
        kept = f"; the local copy is kept in {local_dir}" if local_dir and local_dir.exists() else ""
        super().__init__(
            f"checkpoint of step {step} could not be persisted to {url}: {type(cause).__name__}: {cause}{kept}"
        )
        self.step = step
        self.url = url
        self.cause = cause
        self.local_dir = local_dir


@dataclass
class PersistJob:
    """One checkpoint on its way to the store.

    ``local_dir`` holds the payload files, or will once ``write`` has run in the background
    (``write`` returns the digests of what it wrote). ``on_written`` runs after ``write``,
    whether it succeeded or not (release staging buffers there).
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


class Persister:
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
        self.store = store
        self.keep_last = keep_last
        self.keep_local_copy = keep_local_copy
        self.records: list[PersistRecord] = []
        self.failures: list[PersistError] = []
        self.last_committed: CheckpointInfo | None = None
        self._unreported = 0
        self._cond = threading.Condition()
        self._to_write: deque[PersistJob] = deque()
        self._to_upload: PersistJob | None = None
        self._busy_writing = False
        self._busy_uploading: PersistJob | None = None
        self._write_times: dict[int, float] = {}
        self._local_committed: Path | None = None
        self._closed = False
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
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted checkpoint is committed or failed; False if ``timeout`` ran out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._to_write or self._busy_writing or self._to_upload or self._busy_uploading:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    @property
    def idle(self) -> bool:
        with self._cond:
            return not (self._to_write or self._busy_writing or self._to_upload or self._busy_uploading)

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

    def close(self, timeout: float | None = None) -> bool:
        """Finish pending work (up to ``timeout``) and stop the workers; True if all finished."""
        finished = self.wait(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if finished:
            self._writer.join()
            self._uploader.join()
        return finished

    # ------------------------------------------------------------- workers
    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._to_write and not self._closed:
                    self._cond.wait()
                if not self._to_write:
                    return
                job = self._to_write.popleft()
                self._busy_writing = True
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
                self._busy_writing = False
                if written:
                    self._write_times[job.step] = time.perf_counter() - started
                    dropped, self._to_upload = self._to_upload, job
                    if dropped is not None:
                        log.info(
                            "spot_callbacks: dropping checkpoint of step %d before upload: step %d is newer",
                            dropped.step, job.step,
                        )  # fmt: skip
                        self._discard_local(dropped)
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
            self.last_committed = info
        log.info(
            "spot_callbacks: committed %s (%s, %.1f MB in %.2fs, %.0f MB/s)",
            info.url, job.reason, info.size_bytes / 1e6, upload_s, record.mb_per_s,
        )  # fmt: skip
        self._keep_local(job)
        try:
            self.store.prune(self.keep_last)
        except Exception as err:  # noqa: BLE001 - retention failing must not fail the commit
            log.warning(
                "spot_callbacks: retention in %s failed, will retry after the next commit: %s",
                self.store.url,
                err,
            )

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
