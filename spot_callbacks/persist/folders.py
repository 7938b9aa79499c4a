"""Framework folders written on several nodes (HF's ``checkpoint-N`` in a node-local ``output_dir``).

Nothing is written here: the framework has written the folder on every node already, each rank
its own files into its node's copy (``rng_state_{rank}.pth``). Each node's local main process
lists its copy and uploads its files in one round (:mod:`spot_callbacks.persist.rank_group`); a
name more than one node lists (a file on a shared filesystem every node sees) goes to the lowest
rank that lists it, so it is uploaded once. Rank 0 commits once every node's files are durable; a
node that cannot list or upload its copy is named, and nothing commits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spot_callbacks.persist.rank_group import RankGroupPersister
from spot_callbacks.persist.scratch import NewestCommittedFolder
from spot_callbacks.persist.tracking import CheckpointJob
from spot_callbacks.store import CheckpointStore


@dataclass
class FolderJob(CheckpointJob):
    """One framework folder on its way to the store (the same job on every rank; listed by one per node).

    Example:
        >>> FolderJob(step=9, reason="steps", framework="hf", local_dir=Path("/out/checkpoint-9")).lists_folder
        True
    """

    lists_folder: bool = True  # this rank uploads files of local_dir (each node's local main process)


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
        >>> store = CheckpointStore("memory://doc-folders/run")
        >>> persister = NodeFolderPersister(store)
        >>> persister.submit(persister.job(3, "steps", "hf", folder, lists_folder=True, owns_folder=False))
        >>> persister.wait_for_step(3, timeout=60), sorted(store.latest().files)
        (True, ['rng_state_0.pth'])
        >>> persister.close()
        True
        >>> dist.destroy_process_group()
    """

    def __init__(self, store: CheckpointStore, keep_last: int = 3) -> None:
        super().__init__(store, keep_last)
        self._kept = NewestCommittedFolder()
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
    ) -> FolderJob:
        """The job of a folder already written, on every rank; ``lists_folder`` on one process per node.

        ``owns_folder``: the folder is the run's to delete; only the newest committed one is kept,
        as :class:`~spot_callbacks.persist.Persister` does.
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
        )

    def adopt_local_copy(self, folder: Path) -> None:
        """``folder`` (this node's own copy of a committed checkpoint, e.g. pulled at resume) is deleted
        like this persister's own once a newer checkpoint it owns commits."""
        with self._cond:
            self._kept.adopt(folder)

    # ------------------------------------------------------ round hooks
    def _enqueue(self, job: FolderJob) -> None:
        self._mark_ready(job)  # the framework wrote it already

    def _names_to_upload(self, job: FolderJob | None) -> tuple[list[str], str | None]:
        """This node's names of the folder, less those a lower rank lists too (one all-gather, every rank)."""
        names, error = self._list_own_files(job) if job is not None and job.lists_folder else ([], None)
        listings = self._uploads.all_gather(names)
        claimed = set().union(*listings[: self.rank])
        return [name for name in names if name not in claimed], error

    def _after_round(self, job: FolderJob, committed: bool) -> None:
        # A folder that failed stays, as the Persister leaves it: the error names the local copy.
        if committed and job.owns_local_dir:
            self._kept.keep(job.local_dir)

    def _kept_after_failure(self, job: FolderJob) -> Path | None:
        return job.local_dir if job.lists_folder else None
