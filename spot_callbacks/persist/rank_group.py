"""Persisting with every rank: each uploads its own files of a checkpoint, rank 0 commits once all are durable.

One checkpoint is one *round* on a gloo process group of the persister's own (so a slow upload
never stalls a training collective), the same round on every rank:

1. rank 0 picks the newest ready checkpoint (an older one not yet uploading is dropped, as in
   :class:`~spot_callbacks.persist.Persister`), clears a stale folder of its step, and broadcasts
   the choice;
2. every rank uploads its files of it, in parallel, into the same ``step-N/`` folder;
3. every rank reports its files (sizes, checksums) or its failure, naming its node, to rank 0,
   which writes the manifest only when every rank's files are durable: "committed" keeps its
   one meaning;
4. rank 0 broadcasts the outcome and every rank settles the step alike.

A local failure never leaves a peer waiting in a collective: it is reported in the round, and
local work before the round (a scratch folder on a full disk) is agreed on first
(:meth:`RankGroup.agree`). A collective that fails (a peer died or timed out) breaks the group:
nothing uncommitted commits any more, the newest committed checkpoint stands.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

import spot_callbacks.settings as settings
from spot_callbacks._dist import broadcast_object
from spot_callbacks.errors import CheckpointError, PersistError
from spot_callbacks.log import checkpoint_line
from spot_callbacks.persist.heap import trim_heap
from spot_callbacks.persist.scratch import discard_folder
from spot_callbacks.persist.tracking import CheckpointJob, PersistRecord, StepTracker
from spot_callbacks.store import CheckpointStore, CommitWriter, local_payload_names
from spot_callbacks.store.checksums import FileDigest

log = logging.getLogger("spot_callbacks")


Report = tuple[str, Any]  # ("ok", {name: FileDigest}) or ("failed", why), from one rank


def where_this_rank_runs() -> str:
    """Where this rank runs, for an error: torchrun's node rank and the host name."""
    node = settings.environment_variable("GROUP_RANK") or settings.environment_variable("NODE_RANK")
    return f"{f'node {node}, ' if node is not None else ''}host {socket.gethostname()}"


class RankGroup:
    """A gloo process group of a persister's own, with the collectives a round needs.

    Create it on every rank at the same point (``new_group`` is a collective).

    Example (one process; under torchrun every rank runs the same):
        >>> import tempfile
        >>> dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
        >>> group = RankGroup()
        >>> group.broadcast("rank 0's choice"), group.gather(("ok", {})), group.all_gather(["a.bin"])
        ("rank 0's choice", [('ok', {})], [['a.bin']])
        >>> dist.destroy_process_group()
    """

    def __init__(self) -> None:
        self.group = dist.new_group(
            backend="gloo", timeout=timedelta(seconds=settings.SHARDED_TIMEOUT_S.value())
        )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        return broadcast_object(value, self.group)

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` in rank order, on rank 0 (None on the others)."""
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(value, gathered, dst=0, group=self.group)
        return gathered

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` in rank order, on every rank."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def agree(self, action: Callable[[], None], what: str, folder: Path, step: int) -> None:
        """Run ``action`` here, then learn whether it worked on every rank (one all-reduce); raise on all if not."""
        error: BaseException | None = None
        try:
            action()
        except Exception as err:  # noqa: BLE001 - shared with the other ranks first
            error = err
        failed = torch.tensor([0 if error is None else 1])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)
        if error is not None:
            raise OSError(f"rank {self.rank} could not {what} in {folder}: {error}") from error
        if failed.item():
            raise CheckpointError(f"another rank could not {what} for step {step}")


JobT = TypeVar("JobT", bound=CheckpointJob)


class RankGroupPersister(StepTracker, ABC, Generic[JobT]):
    """The round every rank runs per checkpoint (see the module docstring); a subclass brings its jobs.

    Create it on every rank at the same point (it makes a process group); submit on every rank
    the same steps in the same order. A subclass puts submitted jobs on their way with
    :meth:`_enqueue` (and :meth:`_mark_ready` once their files are in ``local_dir``), says what
    its rank uploads (:meth:`_names_to_upload`) and what becomes of the local folder
    (:meth:`_after_round`), and starts ``self._uploader`` when its own state is set up.

    Example (:class:`~spot_callbacks.persist.sharded.ShardedPersister` and
    :class:`~spot_callbacks.persist.folders.NodeFolderPersister` run whole rounds in theirs):
        >>> issubclass(RankGroupPersister, StepTracker), RankGroupPersister.noun
        (True, 'checkpoint')
    """

    noun = "checkpoint"  # what a log line calls one of its checkpoints

    def __init__(self, store: CheckpointStore, keep_last: int = 3) -> None:
        super().__init__()
        self.store = store
        self.writer = CommitWriter(store)  # every step of the commit sequence
        self.keep_last = keep_last
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._uploads = RankGroup()
        self._ready: list[JobT] = []
        self._busy_uploading: JobT | None = None
        self._broken: BaseException | None = None  # set when the upload group failed (a rank died)
        self._uploader = threading.Thread(target=self._upload_loop, name="spot-rank-uploader", daemon=True)

    # ---------------------------------------------------- subclass hooks
    @abstractmethod
    def _enqueue(self, job: JobT) -> None:
        """Lock held: put a submitted job on its way to :meth:`_mark_ready`."""

    def _names_to_upload(self, job: JobT | None) -> tuple[list[str], str | None]:
        """This rank's files of ``job`` and why it could not list them (every rank calls it, each round)."""
        return self._list_own_files(job)

    def _manifest_extra(self) -> dict[str, Any]:
        return {}

    def _written_digests(self, job: JobT) -> dict[str, FileDigest]:
        """Digests of this rank's files known from writing them (the others are hashed as they upload)."""
        return {}

    @abstractmethod
    def _after_round(self, job: JobT, committed: bool) -> None:
        """What becomes of the local folder once its checkpoint committed or failed."""

    @abstractmethod
    def _kept_after_failure(self, job: JobT) -> Path | None:
        """The local copy a failure leaves on this rank (named in the error)."""

    # ------------------------------------------------------------------ API
    def submit(self, job: JobT) -> None:
        """Queue a checkpoint (every rank, same steps, same order); returns at once."""
        with self._cond:
            if self._closed:
                raise RuntimeError(f"this {type(self).__name__} is closed; create a new one")
            self._enqueue(job)
            self._wake_workers()

    def expedite(self, step: int, deadline: float) -> None:
        """Record that the checkpoint of ``step`` must commit by ``deadline``: its commit then skips
        retention, and a commit after it is said.

        Nothing is overtaken: every rank takes part in each upload, in order, and the newest ready
        checkpoint always uploads next. A no-op when that checkpoint settled, or is unknown.
        """
        with self._cond:
            for job in (*self._not_written(), *self._ready, self._busy_uploading):
                if job is not None and job.step == step and (job.deadline is None or deadline < job.deadline):
                    job.deadline = deadline

    def new_failures(self) -> list[PersistError]:
        """Failures not yet returned (on rank 0 only: one report per checkpoint, not one per rank)."""
        fresh = super().new_failures()
        return fresh if self.rank == 0 else []

    def _queued_steps(self) -> list[int]:
        jobs = (*self._not_written(), *self._ready, self._busy_uploading)
        return [job.step for job in jobs if job is not None]

    def _join_workers(self) -> None:
        self._uploader.join()

    def worker_threads(self) -> list[threading.Thread]:
        return [self._uploader]

    def _mark_ready(self, job: JobT) -> None:
        """Lock held: ``job``'s files are in its folder; it waits for a round (or fails: the group is broken)."""
        if self._broken is not None:
            self._fail(job, RuntimeError(f"the upload group is broken (a rank is gone): {self._broken}"))
        else:
            self._ready.append(job)

    # ------------------------------------------------------------- a round
    def _upload_loop(self) -> None:
        while True:
            with self._cond:
                while not self._ready and not (self._closed and self._idle()):
                    self._cond.wait()
                if not self._ready:
                    return
            try:
                self._upload_round()
            except Exception as err:  # noqa: BLE001 - a collective failed: a peer died or timed out
                self._abandon(err)
                return
            trim_heap()  # what the write and upload freed goes back to the OS (heap.py)

    def _upload_round(self) -> None:
        step, stale_error = self._uploads.broadcast(self._choose() if self.rank == 0 else None)
        job = self._take_ready(step)
        started = time.perf_counter()
        report = self._upload(step, job, stale_error)
        upload_s = time.perf_counter() - started
        reports = self._uploads.gather(report)
        outcome = self._commit(step, job, reports, upload_s) if self.rank == 0 else None
        outcome = self._uploads.broadcast(outcome)
        if job is not None:
            self._settle_round(job, outcome, upload_s)

    def _choose(self) -> tuple[int, str | None]:
        """Rank 0: the newest ready checkpoint, and why its step folder could not be cleared (None: it was)."""
        with self._cond:
            step = max(job.step for job in self._ready)
        try:
            self.writer.begin(step)
            return step, None
        except Exception as err:  # noqa: BLE001 - reported in the round, fails the step on every rank
            return step, f"rank 0: {type(err).__name__}: {err}"

    def _take_ready(self, step: int) -> JobT | None:
        """This rank's job of ``step`` (waiting for it to be ready); older ready ones are dropped."""
        with self._cond:
            # Rank 0 may choose a step this rank has yet to submit or write: every rank submits it.
            while not any(job.step >= step for job in self._ready) and (
                self._not_written() or not self._closed
            ):
                self._cond.wait()
            job = next((j for j in self._ready if j.step == step), None)
            for older in [j for j in self._ready if j.step < step]:
                log.info(
                    "spot_callbacks: dropping %s of step %d before upload: step %d is newer",
                    self.noun, older.step, step,
                )  # fmt: skip
                self._ready.remove(older)
                discard_folder(older.local_dir, older.owns_local_dir)
                self._settle(older.step, "dropped")
            if job is not None:
                self._ready.remove(job)
                self._busy_uploading = job
            return job

    def _upload(self, step: int, job: JobT | None, stale_error: str | None) -> Report:
        """Upload this rank's files of ``step``; the report rank 0 commits by."""
        names, list_error = self._names_to_upload(job)
        if job is None:  # every rank submits the same checkpoints, so this is a bug: fail it on all
            return ("failed", f"rank {self.rank} has no checkpoint of step {step} ({where_this_rank_runs()})")
        if stale_error is not None or list_error is not None:
            return ("failed", stale_error or list_error)
        try:
            with self._metering(step) as meter:
                return (
                    "ok",
                    self.writer.upload(step, job.local_dir, names, self._written_digests(job), meter),
                )
        except Exception as err:  # noqa: BLE001 - reported to rank 0, which decides for all
            return ("failed", f"rank {self.rank}: {type(err).__name__}: {err} ({where_this_rank_runs()})")

    def _list_own_files(self, job: JobT | None) -> tuple[list[str], str | None]:
        if job is None:
            return [], None
        try:
            if not job.local_dir.is_dir():
                raise FileNotFoundError("the folder does not exist")
            return local_payload_names(job.local_dir), None
        except Exception as err:  # noqa: BLE001 - reported to rank 0 with the upload reports
            where = f"rank {self.rank} could not list {job.local_dir}"
            return [], f"{where}: {type(err).__name__}: {err} ({where_this_rank_runs()})"

    def _commit(self, step: int, job: JobT | None, reports: list[Report] | None, upload_s: float) -> Report:
        """Rank 0: commit only when every rank's files are durable; name each rank's failure otherwise."""
        assert reports is not None
        failed = [detail for status, detail in reports if status != "ok"]
        if failed or job is None:
            return ("failed", "; ".join(failed) or f"rank 0 has no checkpoint of step {step}")
        if not any(rank_files for _, rank_files in reports):
            return ("failed", f"no rank has files for step {step} (listed {job.local_dir} on each node)")
        files: dict[str, FileDigest] = {}
        for rank, (_, rank_files) in enumerate(reports):
            for name, digest in rank_files.items():
                if name in files:
                    return ("failed", f"ranks wrote the same file {name!r} (rank {rank} and another)")
                files[name] = digest
        try:
            info = self.writer.commit_files(
                job.step,
                files,
                reason=job.reason,
                framework=job.framework,
                epoch=job.epoch,
                metrics={**job.metrics, "upload_s": round(upload_s, 6)},
                extra={**job.extra, **self._manifest_extra()},
            )
        except Exception as err:  # noqa: BLE001
            return ("failed", f"rank 0: {type(err).__name__}: {err}")
        checkpoint_line(
            "spot_callbacks: committed %s (%s, %d rank%s, %.1f MB in %.2fs)",
            info.url, job.reason, self.world_size, "" if self.world_size == 1 else "s", info.size_bytes / 1e6,
            upload_s,
        )  # fmt: skip
        self.writer.settle(info, self.keep_last, job.deadline)
        return ("committed", info)

    def _settle_round(self, job: JobT, outcome: Report, upload_s: float) -> None:
        status, detail = outcome
        committed = status == "committed"
        self._after_round(job, committed)
        if not committed:  # recorded before the job stops being busy: a waiter then sees it
            self._fail(job, CheckpointError(str(detail)))
        with self._cond:
            if committed:
                queued_s = time.monotonic() - job.submitted_at - job.write_s - upload_s
                record = PersistRecord(detail, job.write_s, upload_s, detail.size_bytes, max(queued_s, 0.0))
                self._record_commit(job.step, record)
            self._busy_uploading = None
            self._cond.notify_all()

    def _abandon(self, err: BaseException) -> None:
        """The upload group is broken (a rank is gone): nothing more can commit; fail what is left."""
        log.error(
            "spot_callbacks: rank %d lost its peers while persisting %ss (%s: %s); "
            "nothing uncommitted will commit, the newest committed checkpoint stands",
            self.rank, self.noun, type(err).__name__, err,
        )  # fmt: skip
        with self._cond:
            self._broken = err
            jobs = [job for job in (self._busy_uploading, *self._ready) if job is not None]
        for job in jobs:
            self._after_round(job, committed=False)
            self._fail(job, err)
        with self._cond:  # only now idle: a waiter sees the failures
            self._busy_uploading, self._ready = None, []
            self._cond.notify_all()

    def _fail(self, job: JobT, err: BaseException) -> None:
        url = self.store.step_url(job.step)
        self._record_failure(job.step, url, err, self._kept_after_failure(job), say=self.rank == 0)
