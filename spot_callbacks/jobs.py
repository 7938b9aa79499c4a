"""Which persister a save goes through, and the single-writer jobs the engine hands it.

Three kinds of save, one persister each, chosen by the save the engine is asked for (a run that
mixes kinds is refused, since each kind commits its own way):

- :data:`SINGLE_WRITER`: the writer rank persists a staged state (``state.ckpt``) or a folder
  the framework wrote (:class:`~spot_callbacks.persist.Persister`);
- :data:`SHARDED`: every rank persists its own DCP shards
  (:class:`~spot_callbacks.persist.sharded.ShardedPersister`);
- :data:`FOLDERS_ACROSS_NODES`: each node's local main process uploads its copy of a framework
  folder, rank 0 commits (``NodeFolderPersister``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spot_callbacks.persist import Persister, PersistJob
from spot_callbacks.persist.folders import NodeFolderPersister
from spot_callbacks.persist.sharded import ShardedPersister
from spot_callbacks.staging import STATE_FILE, StagedState, write_state
from spot_callbacks.store import CheckpointStore, step_dirname
from spot_callbacks.store.checksums import FileDigest


@dataclass(frozen=True)
class PersisterKind:
    """One kind of save and the persister that makes it durable.

    Example:
        >>> SHARDED.mixing_error(SINGLE_WRITER)
        'this run saves sharded checkpoints (save_sharded_state); it cannot mix in single-file ones'
    """

    name: str
    saved_by: str
    make: Callable[[CheckpointStore, Path, int], Any]

    def mixing_error(self, wanted: PersisterKind) -> str:
        return (
            f"this run saves {self.name} checkpoints ({self.saved_by}); it cannot mix in {wanted.name} ones"
        )


SINGLE_WRITER = PersisterKind(
    "single-file",
    "save_state",
    lambda store, scratch_root, keep_last: Persister(store, keep_last=keep_last, scratch_root=scratch_root),
)
SHARDED = PersisterKind(
    "sharded",
    "save_sharded_state",
    lambda store, scratch_root, keep_last: ShardedPersister(store, scratch_root, keep_last=keep_last),
)
FOLDERS_ACROSS_NODES = PersisterKind(
    "multi-node folder",
    "save_folder across nodes",
    lambda store, scratch_root, keep_last: NodeFolderPersister(store, keep_last=keep_last),
)


def state_file_job(
    step: int,
    reason: str,
    framework: str,
    local_dir: Path,
    staged: StagedState,
    *,
    epoch: int | None,
    metrics: dict[str, Any],
    extra: dict[str, Any],
    deadline: float | None,
) -> PersistJob:
    """The job that writes a staged state as ``state.ckpt`` into ``local_dir`` in the background."""

    def write(folder: Path) -> dict[str, FileDigest]:
        write_started = time.perf_counter()
        digests = {STATE_FILE: write_state(staged, folder / STATE_FILE)}
        metrics["write_s"] = round(time.perf_counter() - write_started, 6)  # before the manifest
        return digests

    return PersistJob(
        step=step,
        reason=reason,
        framework=framework,
        local_dir=local_dir / step_dirname(step),
        epoch=epoch,
        write=write,
        on_written=staged.release,
        metrics=metrics,
        extra=extra,
        deadline=deadline,
    )


def folder_job(
    step: int,
    reason: str,
    framework: str,
    folder: Path,
    *,
    owns_folder: bool,
    epoch: int | None,
    metrics: dict[str, Any],
    extra: dict[str, Any],
    deadline: float | None,
) -> PersistJob:
    """The job that persists a folder the framework already wrote (``owns_folder``: keep only the newest)."""
    return PersistJob(
        step=step,
        reason=reason,
        framework=framework,
        local_dir=Path(folder),
        epoch=epoch,
        owns_local_dir=owns_folder,
        metrics=metrics,
        extra=extra,
        deadline=deadline,
    )
