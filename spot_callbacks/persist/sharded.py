"""Sharded checkpoints (FSDP, DTensor state) through ``torch.distributed.checkpoint``, every rank persisting its own.

No rank ever holds the whole state. At a checkpoint every rank copies *its* shards into reused
host buffers, and training goes on: the engine's saves stage the local shards in the run's
:class:`~spot_callbacks.staging.StagingArea` (:func:`~spot_callbacks.persist.shards.local_shards`;
the writer wraps the buffers back into DTensors and ``dcp.save`` writes from them in place);
:meth:`ShardedPersister.stage` uses DCP's :class:`~torch.distributed.checkpoint.staging.DefaultStager`
(pinned memory and a side stream on CUDA). In the background, on CPU (gloo) process groups of
their own so a slow upload never stalls a training collective, the ranks then:

1. write the staged shards with ``dcp.save`` into a rank-private scratch folder (one
   ``__{rank}_0.distcp`` each; rank 0 also writes DCP's ``.metadata`` and the non-tensor
   ``meta.pt``), which frees the staging buffers for the next checkpoint;
2. upload them in one round (:mod:`spot_callbacks.persist.rank_group`): the newest written
   checkpoint wins, every rank uploads its own files into the same ``step-N/`` folder, and rank 0
   writes the manifest listing every rank's files only when all of them are durable.

The folder is an ordinary DCP checkpoint (plus ``meta.pt``, the layout Lightning's
``ModelParallelStrategy`` reads), so a resume loads it through DCP, which reshards onto any world size.
"""

from __future__ import annotations

import io
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spot_callbacks._dist import gather_states_to_first
from spot_callbacks.persist.dcp_digests import digesting_writer, written_digests
from spot_callbacks.persist.rank_group import RankGroup, RankGroupPersister
from spot_callbacks.persist.scratch import discard_folder, discard_leftover_step_folders
from spot_callbacks.persist.shards import as_global
from spot_callbacks.persist.tracking import CheckpointJob
from spot_callbacks.store import CheckpointStore, step_dirname
from spot_callbacks.store.checksums import FileDigest
from spot_callbacks.store.layout import SHARDED_META_FILE
from spot_callbacks.store.transfer import write_local_atomically

META_FILE = SHARDED_META_FILE  # the non-tensor rest of the checkpoint (Lightning's _METADATA_FILENAME)


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
    Nothing in the folder runs code: it must first pass :func:`~spot_callbacks.persist.dcp_safety.check_dcp_folder`
    (else :class:`~spot_callbacks.errors.CorruptCheckpointError`), DCP's ``.metadata`` is then read with
    an allowlist of DCP's classes, byte items and ``meta.pt`` with ``weights_only=True``.

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

    # Here, not at the top: torch.distributed.checkpoint is imported only where a sharded checkpoint is.
    from spot_callbacks.persist.dcp_safety import SafeFileSystemReader, SafeLoadPlanner, check_dcp_folder

    folder = Path(folder)
    check_dcp_folder(folder)  # the clear error; the reader and planner below refuse the same on their own
    dcp.load(
        state,
        storage_reader=SafeFileSystemReader(folder),
        planner=SafeLoadPlanner(),
        no_dist=not dist.is_initialized(),
    )
    meta_path = folder / META_FILE
    return torch.load(meta_path, weights_only=True) if meta_path.is_file() else {}


@dataclass
class ShardedJob(CheckpointJob):
    """One sharded checkpoint on its way to the store (the same job on every rank).

    Example:
        >>> ShardedJob(step=7, reason="steps", framework="demo", local_dir=Path("/scratch/step-7")).meta is None
        True
    """

    staged: dict[str, Any] = field(default_factory=dict)  # this rank's shards, in the stager's buffers
    meta: bytes | None = None  # rank 0: the serialized non-tensor rest, written as meta.pt
    # Staged as local shards (the engine's StagingArea): their layouts, to write them as DTensors again.
    layouts: dict[tuple[Any, ...], Any] | None = None
    before_write: Callable[[], None] | None = None  # e.g. wait for device-to-host copies
    # What DCP writes, made from the staged state by the writer (on the writers' group) before the layouts
    # apply: FSDP1's flat shards cut into the state dicts' chunks (persist/fsdp1_flat.py).
    cut: Callable[[dict[str, Any], Any], dict[str, Any]] | None = None
    # The digests of the files dcp.save wrote, hashed as it wrote them (the upload reuses them).
    digests: dict[str, FileDigest] = field(default_factory=dict)
    on_written: Callable[[], None] | None = (
        None  # after the write, whether it worked or not: free the buffers
    )
    # This rank's values for meta.pt, by their path in it: rank 0 puts every rank's, in rank order, there.
    rank_meta: dict[tuple[Any, ...], Any] | None = None


def with_rank_values(meta: bytes, gathered: list[dict[tuple[Any, ...], Any]]) -> bytes:
    """``meta`` (:func:`serialize_meta`'s bytes) with, at each path of the ranks' ``rank_meta``, the list
    of every rank's value there, in rank order (missing dicts on the way are made).

    Example:
        >>> meta = with_rank_values(serialize_meta({"cb": {"n": 1}}), [{("cb", "rng"): 0}, {("cb", "rng"): 1}])
        >>> torch.load(io.BytesIO(meta), weights_only=True)
        {'cb': {'n': 1, 'rng': [0, 1]}}
    """
    state = torch.load(io.BytesIO(meta), weights_only=True)  # what a resume loads it with
    for path in gathered[0]:
        where = state
        for key in path[:-1]:
            where = where.setdefault(key, {})
        where[path[-1]] = [values[path] for values in gathered]
    return serialize_meta(state)


def serialize_meta(meta: dict[str, Any]) -> bytes:
    """The non-tensor rest of a checkpoint as ``torch.save`` bytes (taken on the training thread: a snapshot).

    Example:
        >>> torch.load(io.BytesIO(serialize_meta({"epoch": 2})), weights_only=True)
        {'epoch': 2}
    """
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    return buffer.getvalue()


class ShardedPersister(RankGroupPersister[ShardedJob]):
    """Makes sharded checkpoints durable with every rank uploading its own files; rank 0 commits.

    Create it on every rank at the same point (it makes two gloo process groups, a collective);
    call :meth:`submit` on every rank with the same steps in the same order.

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

    noun = "sharded checkpoint"

    def __init__(self, store: CheckpointStore, scratch_root: Path, keep_last: int = 3) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # The writer and the uploader issue collectives at the same time: each needs a group of its own.
        self._writes = RankGroup()
        super().__init__(store, keep_last)
        self.scratch = Path(scratch_root) / "shards" / f"rank-{self.rank}"
        discard_leftover_step_folders(self.scratch)  # every commit or failure discards its own folder
        cuda = torch.cuda.is_available()
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=cuda,
            )
        )
        # torch.save's first call in a process imports its config (~4 ms, 10 on a loaded box): paid here,
        # where the persister is made ahead of the first checkpoint, not by that checkpoint's meta.pt.
        serialize_meta({"warm-up": torch.zeros(1)})
        self._writer = threading.Thread(target=self._write_loop, name="spot-shard-writer", daemon=True)
        self._writer.start()
        self._uploader.start()

    # ------------------------------------------------------------------ API
    def stage(self, state: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """Copy this rank's shards of ``state`` into the reused host buffers; return them and their bytes.

        Waits first for the previous checkpoint's local write, whose buffers the staging reuses.
        """
        self.wait_written()
        staged = self.stager.stage(state)  # BlockingAsyncStager: the dict, never a Future
        assert isinstance(staged, dict)
        return staged, _tensor_bytes(staged)

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
        layouts: dict[tuple[Any, ...], Any] | None = None,
        before_write: Callable[[], None] | None = None,
        on_written: Callable[[], None] | None = None,
        rank_meta: dict[tuple[Any, ...], Any] | None = None,
        cut: Callable[[dict[str, Any], Any], dict[str, Any]] | None = None,
    ) -> ShardedJob:
        """The job of one checkpoint on this rank (``meta`` is serialized now, on rank 0 only).

        ``staged`` holds DTensors (:meth:`stage`), or local shards with their ``layouts``
        (:func:`~spot_callbacks.persist.shards.local_shards`, staged by the caller): the writer
        calls ``before_write``, writes them as DTensors again, then calls ``on_written``.
        ``rank_meta``: this rank's values for ``meta``, by their path in it (every rank gives the
        same paths, or every rank none); the writers gather them onto rank 0 beside the write, off
        the loop, and its ``meta.pt`` holds at each path the list of every rank's value in rank
        order (what an all-gather in the loop would have put there). The values must not change
        after the call (fresh RNG states, numbers). ``cut(staged, group)``: what to write instead of
        ``staged``, made by the writer on the writers' gloo group (collective: every rank's job has one).
        """
        return ShardedJob(
            step=step,
            reason=reason,
            framework=framework,
            local_dir=self.scratch / step_dirname(step),
            epoch=epoch,
            metrics=dict(metrics or {}),
            extra=dict(extra or {}),
            deadline=deadline,
            staged=staged,
            meta=serialize_meta(meta) if meta is not None and self.rank == 0 else None,
            layouts=layouts,
            before_write=before_write,
            on_written=on_written,
            rank_meta=rank_meta,
            cut=cut,
        )

    def wait_written(self, timeout: float | None = None) -> bool:
        """Block until every queued checkpoint is written to scratch (the staging buffers are free)."""
        return self._wait_until(lambda: not self._not_written(), timeout)

    # ------------------------------------------------------ round hooks
    def _enqueue(self, job: ShardedJob) -> None:
        self._to_write.append(job)

    def _manifest_extra(self) -> dict[str, Any]:
        return {"sharded": {"world_size": self.world_size, "format": "torch.distributed.checkpoint"}}

    def _written_digests(self, job: ShardedJob) -> dict[str, FileDigest]:
        return job.digests

    def _after_round(self, job: ShardedJob, committed: bool) -> None:
        discard_folder(job.local_dir, job.owns_local_dir)  # the store has it, or it failed: scratch goes

    def _kept_after_failure(self, job: ShardedJob) -> Path | None:
        return None

    def _join_workers(self) -> None:
        self._writer.join()
        super()._join_workers()
        self.stager.close()  # the staging buffers go with the workers

    def worker_threads(self) -> list[threading.Thread]:
        return [self._writer, *super().worker_threads()]

    # ------------------------------------------------------------- writing
    def _write_loop(self) -> None:
        while (job := self._start_writing()) is not None:
            try:
                if self._broken is not None:
                    raise RuntimeError(
                        "the sharded upload group is broken (a rank is gone)"
                    ) from self._broken
                self._write(job)
                written = True
            except BaseException as err:  # noqa: BLE001 - reported, never raised in a worker
                written = False
                self._fail(job, err)
            finally:
                job.staged = {}  # before on_written: a staged tree it frees (adopted copies) is freed then
                if job.on_written is not None:
                    job.on_written()
            with self._cond:
                self._busy_writing = None
                if written:
                    self._mark_ready(job)
                self._cond.notify_all()

    def _write(self, job: ShardedJob) -> None:
        """Write this rank's shards (and rank 0's meta.pt) to scratch; raises on every rank if any failed.

        Every step is collective or agreed on, so a failure on one rank (a full scratch disk)
        fails the checkpoint on all of them instead of leaving the others waiting in a
        collective the failed rank never enters.
        """
        import torch.distributed.checkpoint as dcp

        started = time.perf_counter()
        self._writes.agree(
            lambda: self._prepare_folder(job), "prepare its scratch folder", job.local_dir, job.step
        )
        if job.before_write is not None:
            job.before_write()
        staged = job.staged if job.cut is None else job.cut(job.staged, self._writes.group)
        staged = staged if job.layouts is None else as_global(staged, job.layouts)
        # DCP shares a rank's write error with every rank (CheckpointException on all). It writes
        # each tensor from the staged buffer itself (torch.save of a whole storage): no second copy.
        # Each file is hashed as DCP writes it: the upload reads it once (dcp_digests).
        storage_writer = digesting_writer(job.local_dir, sync_files=True)
        dcp.save(staged, storage_writer=storage_writer, process_group=self._writes.group)
        job.digests = written_digests(storage_writer)
        # After dcp.save, whose failure raised on every rank: every rank gets to this collective.
        gathered = (
            gather_states_to_first(job.rank_meta, self._writes.group) if job.rank_meta is not None else None
        )
        self._writes.agree(
            lambda: self._write_meta(job, gathered), f"write {META_FILE}", job.local_dir, job.step
        )
        job.write_s = time.perf_counter() - started
        job.metrics["write_s"] = round(job.write_s, 6)

    @staticmethod
    def _prepare_folder(job: ShardedJob) -> None:
        shutil.rmtree(job.local_dir, ignore_errors=True)
        job.local_dir.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def _write_meta(job: ShardedJob, gathered: list[Any] | None) -> None:
        if job.meta is not None:
            meta = job.meta if gathered is None else with_rank_values(job.meta, gathered)
            write_local_atomically(job.local_dir / META_FILE, meta)


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
