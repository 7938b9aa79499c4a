"""Sharded checkpoints (FSDP, DTensor state) through ``torch.distributed.checkpoint``, every rank persisting its own.

No rank ever holds the whole state. At a checkpoint every rank copies *its* shards into reused
host buffers (DCP's :class:`~torch.distributed.checkpoint.staging.DefaultStager`: pinned memory and
a side stream on CUDA), and training goes on. In the background, on CPU (gloo) process groups of
their own so a slow upload never stalls a training collective, the ranks then:

1. write the staged shards with ``dcp.save`` into a rank-private scratch folder (one
   ``__{rank}_0.distcp`` each; rank 0 also writes DCP's ``.metadata`` and the non-tensor
   ``meta.pt``), which frees the staging buffers for the next checkpoint;
2. agree on which written checkpoint to upload (rank 0 picks the newest: an older one not yet
   uploading is dropped, as in :class:`~spot_callbacks.persist.Persister`);
3. upload their own files in parallel, each rank to the same ``step-N/`` folder;
4. report their files (sizes, checksums) or their failure to rank 0, which writes the manifest
   listing every rank's files only when all of them are durable. "Committed" keeps its one meaning.

The folder is an ordinary DCP checkpoint (plus ``meta.pt``, the layout Lightning's
``ModelParallelStrategy`` reads), so a resume loads it through DCP, which reshards onto any world size.

The same machinery persists a folder a framework has already written on several nodes (HF's
``checkpoint-N`` in a node-local ``output_dir``, see :meth:`ShardedPersister.folder_job`): nothing
is written, each node's local main process uploads its copy's files, and a file every node sees
(a shared filesystem) is uploaded once, by the lowest rank that lists it.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spot_callbacks.errors import CheckpointError, PersistError
from spot_callbacks.persist import PersistQueue, PersistRecord
from spot_callbacks.store import (
    CheckpointInfo,
    CheckpointStore,
    local_payload_names,
    new_manifest,
    step_dirname,
)
from spot_callbacks.store.checksums import FileDigest
from spot_callbacks.store.commit import settle_commit
from spot_callbacks.trigger.collectives import broadcast_object

log = logging.getLogger("spot_callbacks")

META_FILE = "meta.pt"  # the non-tensor rest of the checkpoint (Lightning's _METADATA_FILENAME)
# Collectives of the checkpoint groups wait for the slowest rank's upload, which can take long.
GROUP_TIMEOUT_S = float(os.environ.get("SPOT_SHARDED_TIMEOUT_S", "7200"))


def is_sharded_state(state: Any) -> bool:
    """True when ``state`` holds a DTensor or ShardedTensor anywhere (no rank has all of it).

    Example:
        >>> is_sharded_state({"model": {"w": torch.ones(2)}, "step": 3})
        False
    """
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(state, (DTensor, ShardedTensor)):
        return True
    if isinstance(state, dict):
        return any(is_sharded_state(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return any(is_sharded_state(value) for value in state)
    return False


def load_sharded_state(folder: str | os.PathLike[str], state: dict[str, Any]) -> dict[str, Any]:
    """Load a sharded checkpoint folder into ``state`` in place (resharding as needed); return ``meta.pt``.

    ``state`` holds the current (sharded) state dicts under the keys they were saved with, e.g.
    ``{"model": get_model_state_dict(model)}``; apply them afterwards (``set_state_dict``).
    ``meta.pt`` is read with ``weights_only=True``: it never runs code.

    Example:
        >>> import tempfile, torch.distributed.checkpoint as dcp
        >>> folder = tempfile.mkdtemp()
        >>> _ = dcp.save({"model": {"w": torch.arange(3.0)}}, checkpoint_id=folder, no_dist=True)
        >>> state = {"model": {"w": torch.zeros(3)}}
        >>> load_sharded_state(folder, state)
        {}
        >>> state["model"]["w"]
        tensor([0., 1., 2.])
    """
    import torch.distributed.checkpoint as dcp

    folder = Path(folder)
    dcp.load(state, checkpoint_id=folder, no_dist=not dist.is_initialized())
    meta_path = folder / META_FILE
    return torch.load(meta_path, weights_only=True) if meta_path.is_file() else {}


@dataclass
class ShardedJob:
    """One sharded checkpoint on its way to the store (the same job on every rank)."""

    step: int
    reason: str
    framework: str
    staged: dict[str, Any]
    local_dir: Path
    epoch: int | None = None
    meta: bytes | None = None  # rank 0: the serialized non-tensor rest, written as meta.pt
    metrics: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    deadline: float | None = None
    submitted_at: float = field(default_factory=time.monotonic)
    write_s: float = 0.0
    ready: bool = False  # local_dir holds the files already (a framework's folder): nothing to write
    lists_folder: bool = True  # this rank uploads files of local_dir (a folder job: each node's local main)
    owns_local_dir: bool = True  # False: the framework's folder, never deleted here


def serialize_meta(meta: dict[str, Any]) -> bytes:
    """The non-tensor rest of a checkpoint as ``torch.save`` bytes (taken on the training thread: a snapshot)."""
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    return buffer.getvalue()


class ShardedPersister(PersistQueue):
    """Makes sharded checkpoints durable with every rank uploading its own files; rank 0 commits.

    Create it on every rank at the same point (it makes two gloo process groups, a collective);
    call :meth:`submit` on every rank with the same steps in the same order. It offers the
    interface of :class:`~spot_callbacks.persist.Persister` the engine uses.

    Args:
        store: where checkpoints are committed.
        scratch_root: this run's scratch folder; each rank writes under ``shards/rank-N/``.
        keep_last: committed checkpoints kept by retention after each commit (0 keeps all).

    Example (one process; under torchrun every rank runs the same):
        >>> import tempfile, torch.distributed as dist
        >>> from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor
        >>> dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
        >>> mesh = DeviceMesh("cpu", [0])
        >>> state = {"model": {"w": distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])}}
        >>> store = CheckpointStore("memory://doc-sharded/run")
        >>> persister = ShardedPersister(store, scratch_root=Path(tempfile.mkdtemp()))
        >>> persister.submit_state(step=7, reason="manual", framework="demo", state=state)
        >>> persister.wait_for_step(7, timeout=60)
        True
        >>> sorted(store.latest().files)
        ['.metadata', '__0_0.distcp']
        >>> persister.close()
        True
        >>> dist.destroy_process_group()
    """

    def __init__(self, store: CheckpointStore, scratch_root: Path, keep_last: int = 3) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        super().__init__()
        self.store = store
        self.keep_last = keep_last
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.scratch = Path(scratch_root) / "shards" / f"rank-{self.rank}"
        cuda = torch.cuda.is_available()
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=cuda,
            )
        )
        # Two threads issue collectives at the same time: each needs a group of its own.
        timeout = timedelta(seconds=GROUP_TIMEOUT_S)
        self._write_group = dist.new_group(backend="gloo", timeout=timeout)
        self._upload_group = dist.new_group(backend="gloo", timeout=timeout)
        self._to_write: list[ShardedJob] = []
        self._written: list[ShardedJob] = []
        self._busy_writing: ShardedJob | None = None
        self._busy_uploading: ShardedJob | None = None
        self._broken: BaseException | None = None  # set when the upload group failed (a rank died)
        self._local_committed: Path | None = None  # the newest committed folder job's own folder
        self._writer = threading.Thread(target=self._write_loop, name="spot-shard-writer", daemon=True)
        self._uploader = threading.Thread(target=self._upload_loop, name="spot-shard-uploader", daemon=True)
        self._writer.start()
        self._uploader.start()

    # ------------------------------------------------------------------ API
    def stage(self, state: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """Copy this rank's shards of ``state`` into the reused host buffers; return them and their bytes.

        Waits first for the previous checkpoint's local write, whose buffers the staging reuses.
        """
        self.wait_written()
        staged = self.stager.stage(state)
        return staged, _tensor_bytes(staged)

    def submit(self, job: ShardedJob) -> None:
        """Queue a staged checkpoint (every rank, same steps, same order); returns at once."""
        with self._cond:
            if self._closed:
                raise RuntimeError("this ShardedPersister is closed; create a new one")
            self._to_write.append(job)
            self._cond.notify_all()

    def submit_state(
        self,
        step: int,
        reason: str,
        framework: str,
        state: dict[str, Any],
        *,
        meta: dict[str, Any] | None = None,
        epoch: int | None = None,
    ) -> None:
        """:meth:`stage` then :meth:`submit`: the caller waits only for the copy of its shards."""
        staged, nbytes = self.stage(state)
        self.submit(
            self.job(
                step, reason, framework, staged, meta=meta, epoch=epoch, metrics={"staged_bytes": nbytes}
            )
        )

    def job(
        self,
        step: int,
        reason: str,
        framework: str,
        staged: dict[str, Any],
        *,
        meta: dict[str, Any] | None = None,
        epoch: int | None = None,
        metrics: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        deadline: float | None = None,
    ) -> ShardedJob:
        """The job of one checkpoint on this rank (``meta`` is serialized now, on rank 0 only)."""
        return ShardedJob(
            step=step,
            reason=reason,
            framework=framework,
            staged=staged,
            local_dir=self.scratch / step_dirname(step),
            epoch=epoch,
            meta=serialize_meta(meta) if meta is not None and self.rank == 0 else None,
            metrics=dict(metrics or {}),
            extra=dict(extra or {}),
            deadline=deadline,
        )

    def folder_job(
        self,
        step: int,
        reason: str,
        framework: str,
        folder: Path,
        *,
        lists_folder: bool,
        owns_folder: bool = False,
        epoch: int | None = None,
        metrics: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        deadline: float | None = None,
    ) -> ShardedJob:
        """The job of a folder already written, on every rank; ``lists_folder`` on one process per node.

        Each listing rank uploads the files of its ``folder`` (node-local or shared); a name more
        than one rank lists is uploaded by the lowest of them only. ``owns_folder``: keep only the
        newest committed folder, as :class:`~spot_callbacks.persist.Persister` does.
        """
        return ShardedJob(
            step=step,
            reason=reason,
            framework=framework,
            staged={},
            local_dir=Path(folder),
            epoch=epoch,
            metrics=dict(metrics or {}),
            extra=dict(extra or {}),
            deadline=deadline,
            ready=True,
            lists_folder=lists_folder,
            owns_local_dir=owns_folder and lists_folder,
        )

    def wait_written(self, timeout: float | None = None) -> bool:
        """Block until every queued checkpoint is written to scratch (the staging buffers are free)."""
        return self._wait_until(lambda: not self._to_write and self._busy_writing is None, timeout)

    def expedite(self, step: int, deadline: float) -> None:
        """Kept for the Persister interface: the newest written checkpoint always uploads next here.

        An upload in flight cannot be overtaken (every rank takes part in each one, in order).
        """

    def new_failures(self) -> list[PersistError]:
        """Failures not yet returned (on rank 0 only: one report per checkpoint, not one per rank)."""
        fresh = super().new_failures()
        return fresh if self.rank == 0 else []

    def _join_workers(self) -> None:
        self._writer.join()
        self._uploader.join()
        self.stager.close()  # the staging buffers go with the workers

    def _idle(self) -> bool:
        return not (self._to_write or self._busy_writing or self._written or self._busy_uploading)

    # ------------------------------------------------------------- writing
    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._to_write and not self._closed:
                    self._cond.wait()
                if not self._to_write:
                    return
                job = self._to_write.pop(0)
                self._busy_writing = job
            try:
                if self._broken is not None:
                    raise RuntimeError(
                        "the sharded upload group is broken (a rank is gone)"
                    ) from self._broken
                if not job.ready:
                    self._write(job)
                written = True
            except BaseException as err:  # noqa: BLE001 - reported, never raised in a worker
                written = False
                self._fail(job, err)
            with self._cond:
                self._busy_writing = None
                job.staged = {}
                if written:
                    self._written.append(job)
                self._cond.notify_all()

    def _write(self, job: ShardedJob) -> None:
        """Write this rank's shards (and rank 0's meta.pt) to scratch; raises on every rank if any failed.

        Every step is collective or followed by an agreement, so a failure on one rank (a full
        scratch disk) fails the checkpoint on all of them instead of leaving the others waiting
        in a collective the failed rank never enters.
        """
        import torch.distributed.checkpoint as dcp

        started = time.perf_counter()
        self._agree_on_write(job, "prepare its scratch folder", self._prepare_folder)
        # DCP shares a rank's write error with every rank (CheckpointException on all).
        dcp.save(
            job.staged,
            storage_writer=dcp.FileSystemWriter(job.local_dir, sync_files=True),
            process_group=self._write_group,
        )
        self._agree_on_write(job, f"write {META_FILE}", self._write_meta)
        job.write_s = time.perf_counter() - started
        job.metrics["write_s"] = round(job.write_s, 6)

    @staticmethod
    def _prepare_folder(job: ShardedJob) -> None:
        shutil.rmtree(job.local_dir, ignore_errors=True)
        job.local_dir.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def _write_meta(job: ShardedJob) -> None:
        if job.meta is not None:
            (job.local_dir / META_FILE).write_bytes(job.meta)

    def _agree_on_write(self, job: ShardedJob, what: str, action: Any) -> None:
        """Run ``action`` here, then learn from every rank whether theirs worked (one all-reduce)."""
        error: BaseException | None = None
        try:
            action(job)
        except Exception as err:  # noqa: BLE001 - shared with the other ranks first
            error = err
        failed = torch.tensor([0 if error is None else 1])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self._write_group)
        if error is not None:
            raise OSError(f"rank {self.rank} could not {what} in {job.local_dir}: {error}") from error
        if failed.item():
            raise CheckpointError(f"another rank could not {what} for step {job.step}")

    # ----------------------------------------------------------- uploading
    def _upload_loop(self) -> None:
        while True:
            with self._cond:
                while not self._written and not (self._closed and self._idle()):
                    self._cond.wait()
                if not self._written:
                    return
            try:
                self._upload_next()
            except Exception as err:  # noqa: BLE001 - a collective failed: a peer died or timed out
                self._abandon(err)
                return

    def _upload_next(self) -> None:
        """Agree on the checkpoint to upload, upload this rank's files, commit on rank 0."""
        if self.rank == 0:
            with self._cond:
                newest = max(self._written, key=lambda job: job.step)
            chosen, ready = newest.step, newest.ready
            begin_error = self._begin(chosen)
            decision = broadcast_object([chosen, begin_error, ready], self._upload_group)
        else:
            decision = broadcast_object([None, None, None], self._upload_group)
        step, begin_error, ready = decision
        job = self._take_written(step)
        started = time.perf_counter()
        names, list_error = self._names_to_upload(job, ready)
        report: tuple[str, Any]
        if job is None:  # every rank writes the same checkpoints, so this is a bug: fail it on all
            report = ("failed", f"rank {self.rank} has no written checkpoint of step {step} ({self._node()})")
        elif begin_error is not None:
            report = ("failed", begin_error)
        elif list_error is not None:
            report = ("failed", list_error)
        else:
            try:
                report = ("ok", self.store.upload_files(step, job.local_dir, names))
            except Exception as err:  # noqa: BLE001 - reported to rank 0, which decides for all
                report = ("failed", f"rank {self.rank}: {type(err).__name__}: {err} ({self._node()})")
        upload_s = time.perf_counter() - started
        reports: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(report, reports, dst=0, group=self._upload_group)
        outcome = self._commit(step, job, reports, upload_s) if self.rank == 0 else None
        outcome = broadcast_object([outcome], self._upload_group)[0]
        if job is not None:
            self._settle(job, outcome, upload_s)

    def _names_to_upload(self, job: ShardedJob | None, ready: bool) -> tuple[list[str], str | None]:
        """This rank's files of the checkpoint, and why it could not list them (None when it could).

        A rank's scratch folder is its own. A framework's folder (``ready``) may be node-local or
        shared: after one all-gather of the listings, a name goes to the lowest rank that lists it,
        so a file every node sees is uploaded once.
        """
        names: list[str] = []
        error: str | None = None
        try:
            if job is not None and job.lists_folder:
                names = local_payload_names(job.local_dir)
        except Exception as err:  # noqa: BLE001 - reported to rank 0 with the upload reports
            where = f"rank {self.rank} could not list {job.local_dir}"
            error = f"{where}: {type(err).__name__}: {err} ({self._node()})"
        if not ready:
            return names, error
        listings: list[Any] = [None] * self.world_size
        dist.all_gather_object(listings, names, group=self._upload_group)
        claimed = set().union(*(listing or [] for listing in listings[: self.rank]))
        return [name for name in names if name not in claimed], error

    @staticmethod
    def _node() -> str:
        """Where this rank runs, for an error: torchrun's node rank and the host name."""
        node = os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK"))
        return f"{f'node {node}, ' if node is not None else ''}host {socket.gethostname()}"

    def _abandon(self, err: BaseException) -> None:
        """The upload group is broken (a rank is gone): nothing more can commit; fail what is left."""
        log.error(
            "spot_callbacks: rank %d lost its peers while persisting sharded checkpoints (%s: %s); "
            "nothing uncommitted will commit, the newest committed checkpoint stands",
            self.rank, type(err).__name__, err,
        )  # fmt: skip
        with self._cond:
            self._broken = err
            jobs = [job for job in (self._busy_uploading, *self._written) if job is not None]
        for job in jobs:
            _discard_local(job)
            self._fail(job, err)
        with self._cond:  # only now idle: a waiter sees the failures
            self._busy_uploading, self._written = None, []
            self._cond.notify_all()

    def _begin(self, step: int) -> str | None:
        try:
            self.store.clear_stale_step(step)
            return None
        except Exception as err:  # noqa: BLE001
            return f"rank 0: {type(err).__name__}: {err}"

    def _take_written(self, step: int) -> ShardedJob | None:
        """Wait for this rank's write of ``step`` (a collective: it ends on every rank); drop older ones."""
        with self._cond:
            while not any(job.step == step for job in self._written) and (
                self._busy_writing is not None or self._to_write
            ):
                self._cond.wait()
            job = next((j for j in self._written if j.step == step), None)
            for older in [j for j in self._written if j.step < step]:
                log.info(
                    "spot_callbacks: dropping sharded checkpoint of step %d before upload: step %d is newer",
                    older.step, step,
                )  # fmt: skip
                self._written.remove(older)
                self._outcomes[older.step] = "dropped"
                _discard_local(older)
            if job is not None:
                self._written.remove(job)
                self._busy_uploading = job
            return job

    def _commit(
        self, step: int, job: ShardedJob | None, reports: list[Any] | None, upload_s: float
    ) -> tuple[str, Any]:
        """Rank 0: commit only when every rank's files are durable; name each rank's failure otherwise."""
        assert reports is not None
        failed = [detail for status, detail in reports if status != "ok"]
        if failed or job is None:
            return ("failed", "; ".join(failed) or f"rank 0 has no written checkpoint of step {step}")
        if not any(rank_files for _, rank_files in reports):
            return ("failed", f"no rank has files for step {step} (listed {job.local_dir} on each node)")
        files: dict[str, FileDigest] = {}
        for rank, (_, rank_files) in enumerate(reports):
            for name, digest in rank_files.items():
                if name in files:
                    return ("failed", f"ranks wrote the same file {name!r} (rank {rank} and another)")
                files[name] = digest
        metrics = {**job.metrics, "upload_s": round(upload_s, 6)}
        extra = dict(job.extra)
        if not job.ready:
            extra["sharded"] = {"world_size": self.world_size, "format": "torch.distributed.checkpoint"}
        manifest = new_manifest(
            job.step,
            files,
            reason=job.reason,
            framework=job.framework,
            epoch=job.epoch,
            metrics=metrics,
            extra=extra,
        )
        try:
            info = self.store.commit(manifest)
        except Exception as err:  # noqa: BLE001
            return ("failed", f"rank 0: {type(err).__name__}: {err}")
        log.info(
            "spot_callbacks: committed %s (%s, %d ranks, %.1f MB in %.2fs)",
            info.url, job.reason, self.world_size, info.size_bytes / 1e6, upload_s,
        )  # fmt: skip
        settle_commit(self.store, info, self.keep_last, job.deadline)
        return ("committed", info)

    def _settle(self, job: ShardedJob, outcome: tuple[str, Any], upload_s: float) -> None:
        status, detail = outcome
        if not job.ready:
            _discard_local(job)
        elif status == "committed":
            self._keep_local(job)
        # A framework's folder that failed stays, as the Persister leaves it: the local copy is kept.
        if status != "committed":  # recorded before the job stops being busy: a waiter then sees it
            self._fail(job, CheckpointError(str(detail)))
        with self._cond:
            self._busy_uploading = None
            if status == "committed":
                info: CheckpointInfo = detail
                queued_s = time.monotonic() - job.submitted_at - job.write_s - upload_s
                self.records.append(
                    PersistRecord(info, job.write_s, upload_s, info.size_bytes, max(queued_s, 0.0))
                )
                if self.last_committed is None or info.step >= self.last_committed.step:
                    self.last_committed = info
                self._outcomes[job.step] = "committed"
            self._cond.notify_all()

    def _keep_local(self, job: ShardedJob) -> None:
        """A committed folder of the framework's that is ours: keep it, drop the one kept before."""
        if not job.owns_local_dir:
            return
        previous, self._local_committed = self._local_committed, job.local_dir
        if previous is not None and previous != job.local_dir:
            shutil.rmtree(previous, ignore_errors=True)

    def _fail(self, job: ShardedJob, err: BaseException) -> None:
        kept = job.local_dir if job.ready and job.lists_folder else None
        error = PersistError(job.step, self.store.step_url(job.step), err, kept)
        error.__cause__ = err
        if self.rank == 0:
            log.error("spot_callbacks: %s", error)
        with self._cond:
            self.failures.append(error)
            self._outcomes[job.step] = "failed"
            self._cond.notify_all()


def _discard_local(job: ShardedJob) -> None:
    if job.owns_local_dir:
        shutil.rmtree(job.local_dir, ignore_errors=True)


def _tensor_bytes(state: Any) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return _tensor_bytes(state.to_local())
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(value) for value in state)
    return 0
