"""Framework folders whose files are spread over ranks or nodes (HF's ``checkpoint-N`` under FSDP, on several nodes).

Two kinds of job, the same round (:mod:`spot_callbacks.persist.rank_group`):

- *written already*: the framework wrote the folder on every node, each rank its own files into
  its node's copy (``rng_state_{rank}.pth``). Each node's local main process lists its copy and
  uploads its files; a name more than one node lists (a file on a shared filesystem every node
  sees) goes to the lowest rank that lists it, so it is uploaded once.
- *written here* (``write``): every rank's writer thread writes its own files of the folder from a
  staged snapshot (``write(folder, group)``, with a gloo :class:`RankGroup` of the writer's own for
  collectives such as ``dcp.save`` and for agreeing on local steps), names them (with the digests
  of those hashed as they were written), and uploads just those: every rank its own files, in
  parallel, wherever its node's folder is.

Rank 0 commits once every rank's files are durable; a rank that cannot write, list or upload its
files is named, and nothing commits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spot_callbacks.persist.rank_group import RankGroup, RankGroupPersister
from spot_callbacks.persist.scratch import NewestCommittedFolder
from spot_callbacks.persist.tracking import CheckpointJob
from spot_callbacks.store import CheckpointStore
from spot_callbacks.store.checksums import FileDigest


@dataclass
class FolderJob(CheckpointJob):
    """One framework folder on its way to the store (the same job on every rank; listed by one per node).

    Example:
        >>> FolderJob(step=9, reason="steps", framework="hf", local_dir=Path("/out/checkpoint-9")).lists_folder
        True
    """

    lists_folder: bool = True  # this rank uploads files of local_dir (each node's local main process)
    # Written here: this rank's writer makes its files of local_dir and returns them, each with its
    # digest where it was hashed as written (None: hashed as it uploads).
    write: Callable[[Path, RankGroup], Mapping[str, FileDigest | None]] | None = None
    on_written: Callable[[], None] | None = None  # after write, whether it worked or not
    names: list[str] | None = None  # what write returned: the files this rank uploads
    digests: dict[str, FileDigest] = field(default_factory=dict)  # of those, known from writing them


class NodeFolderPersister(RankGroupPersister[FolderJob]):
    """Makes a checkpoint folder written on several nodes durable: each node uploads its copy; rank 0 commits.

    Create it on every rank at the same point (it makes a gloo process group, a collective);
    call :meth:`submit` on every rank with the same steps in the same order, once every rank has
    written its files into the folder.

    Args:
        store: where checkpoints are committed.
        keep_last: committed checkpoints kept by retention after each commit (0 keeps all).

    Example (one process; under torchrun every rank runs the same):
        >>> import tempfile, torch.distributed as dist
        >>> dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
        >>> folder = Path(tempfile.mkdtemp()) / "checkpoint-3"; folder.mkdir()
        >>> _ = (folder / "rng_state_0.pth").write_bytes(b"rng")
        >>> _ = (folder / "trainer_state.json").write_text("{}")  # an HF checkpoint has one
        >>> store = CheckpointStore("memory://doc-folders/run")
        >>> persister = NodeFolderPersister(store)
        >>> try:
        ...     persister.submit(persister.job(3, "steps", "hf", folder, lists_folder=True, owns_folder=False))
        ...     print(persister.wait_for_step(3, timeout=60), sorted(store.latest().files))
        ... finally:
        ...     _ = persister.close()
        ...     dist.destroy_process_group()  # whatever happened: later doctests in this process start their own
        True ['rng_state_0.pth', 'trainer_state.json']
    """

    def __init__(self, store: CheckpointStore, keep_last: int = 3) -> None:
        # The writer and the uploader issue collectives at the same time: each needs a group of its own.
        self._writes = RankGroup()
        super().__init__(store, keep_last)
        self._kept = NewestCommittedFolder()
        self._writer = threading.Thread(target=self._write_loop, name="spot-folder-writer", daemon=True)
        self._writer.start()
        self._uploader.start()

    def job(
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
        write: Callable[[Path, RankGroup], Mapping[str, FileDigest | None]] | None = None,
        on_written: Callable[[], None] | None = None,
    ) -> FolderJob:
        """The job of a folder, on every rank; ``lists_folder`` on one process per node.

        Without ``write`` the folder is written already and the ``lists_folder`` ranks upload what
        they list. With it, every rank's writer thread calls ``write(folder, group)`` (every rank
        at once: it may run collectives on ``group``), then ``on_written``, and uploads the files
        ``write`` returned (the digests it gave are not computed again). ``owns_folder``: the
        folder is the run's to delete; only the newest committed one is kept, as
        :class:`~spot_callbacks.persist.Persister` does.
        """
        return FolderJob(
            step=step,
            reason=reason,
            framework=framework,
            local_dir=Path(folder),
            epoch=epoch,
            metrics=dict(metrics or {}),
            extra=dict(extra or {}),
            deadline=deadline,
            owns_local_dir=owns_folder and lists_folder,
            lists_folder=lists_folder,
            write=write,
            on_written=on_written,
        )

    def adopt_local_copy(self, folder: Path) -> None:
        """``folder`` (this node's own copy of a committed checkpoint, e.g. pulled at resume) is deleted
        like this persister's own once a newer checkpoint it owns commits."""
        with self._cond:
            self._kept.adopt(folder)

    def wait_written(self, timeout: float | None = None) -> bool:
        """Block until every queued folder is written (its staged snapshot is released)."""
        return self._wait_until(lambda: not self._not_written(), timeout)

    # ------------------------------------------------------ round hooks
    def _enqueue(self, job: FolderJob) -> None:
        if job.write is None:
            self._mark_ready(job)  # the framework wrote it already
        else:
            self._to_write.append(job)

    def _join_workers(self) -> None:
        self._writer.join()
        super()._join_workers()

    def worker_threads(self) -> list[threading.Thread]:
        return [self._writer, *super().worker_threads()]

    def _write_loop(self) -> None:
        while (job := self._start_writing()) is not None:
            started = time.perf_counter()
            try:
                if self._broken is not None:
                    raise RuntimeError("the upload group is broken (a rank is gone)") from self._broken
                written_files = job.write(job.local_dir, self._writes)
                job.names = list(written_files)
                job.digests = {name: digest for name, digest in written_files.items() if digest is not None}
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
                    job.metrics["write_s"] = round(job.write_s, 6)
                    self._mark_ready(job)
                self._cond.notify_all()

    def _names_to_upload(self, job: FolderJob | None) -> tuple[list[str], str | None]:
        """This rank's names of the folder, less those a lower rank lists too (one all-gather, every rank)."""
        if job is not None and job.names is not None:
            names, error = job.names, None  # written here: exactly what this rank wrote
        elif job is not None and job.lists_folder:
            names, error = self._list_own_files(job)
        else:
            names, error = [], None
        listings = self._uploads.all_gather(names)
        claimed = set().union(*listings[: self.rank])
        return [name for name in names if name not in claimed], error

    def _written_digests(self, job: FolderJob) -> dict[str, FileDigest]:
        return job.digests

    def _after_round(self, job: FolderJob, committed: bool) -> None:
        # A folder that failed stays, as the Persister leaves it: the error names the local copy.
        if committed and job.owns_local_dir:
            self._kept.keep(job.local_dir)

    def _kept_after_failure(self, job: FolderJob) -> Path | None:
        return job.local_dir if job.lists_folder and job.local_dir.is_dir() else None
