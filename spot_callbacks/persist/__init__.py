"""How a step folder gets from scratch to the store: the persisters, each one job behind one protocol.

- :class:`Persister` (``pipeline.py``): one writer; a writer thread serializes, an uploader thread
  commits, the newest written checkpoint wins, an emergency goes first (``emergency.py``).
- :class:`~spot_callbacks.persist.sharded.ShardedPersister` (``sharded.py``): every rank writes its
  DCP shards and uploads them; rank 0 commits once all are durable.
- :class:`~spot_callbacks.persist.folders.NodeFolderPersister` (``folders.py``): a framework's
  folder written on several nodes; each node uploads its copy, rank 0 commits.

The two multi-rank ones share the round of ``rank_group.py``; all three keep their settled steps,
records and failures as ``tracking.py`` does, and take every step of the commit sequence (begin,
upload, commit, settle) through one :class:`~spot_callbacks.store.CommitWriter`. The engine calls them only through
:class:`CheckpointPersister` (and ``submit`` with the job the persister made), never by type; which
one a run gets follows from the layout of its step folders (who writes their files:
``store/layout.py``'s ``StepLayout``, mapped to a persister by ``saving.py``'s ``PERSISTERS``).
The multi-rank persisters import torch.distributed, so they are imported from their own modules.
"""

from __future__ import annotations

from typing import Protocol, TypeVar, runtime_checkable

from spot_callbacks.errors import PersistError
from spot_callbacks.persist.emergency import EmergencyPlan, plan_emergency
from spot_callbacks.persist.pipeline import Persister, PersistJob
from spot_callbacks.persist.scratch import default_scratch_root, folder_bytes, private_scratch_root
from spot_callbacks.persist.tracking import PersistRecord, StepTracker
from spot_callbacks.store.meter import TransferMeter

JobT_contra = TypeVar("JobT_contra", contravariant=True)


@runtime_checkable
class CheckpointPersister(Protocol[JobT_contra]):
    """What the engine may call on every persister, whichever job it does.

    ``submit`` takes the job of that persister (a :class:`PersistJob`, or what its ``job()`` made)
    and returns at once. ``expedite`` makes a submitted checkpoint an emergency one that must
    commit by ``deadline`` (epoch seconds): its commit skips retention and a late one is said.
    ``wait_for_step`` waits for one checkpoint to settle (True: it committed), ``wait`` for all;
    ``close`` finishes (up to ``timeout``) and stops the workers. ``new_failures`` returns each
    failure once; ``failures`` and ``records`` (:class:`PersistRecord`) keep them all.
    ``in_flight_step`` is the step uploading now, ``idle`` whether nothing is queued or moving,
    ``unsettled_steps`` the submitted steps not settled yet.

    Example:
        >>> from spot_callbacks.store import CheckpointStore
        >>> persister = Persister(CheckpointStore("memory://doc-protocol/run"))
        >>> isinstance(persister, CheckpointPersister), persister.idle, persister.close()
        (True, True, True)
    """

    failures: list[PersistError]
    records: list[PersistRecord]

    def submit(self, job: JobT_contra) -> None: ...

    def expedite(self, step: int, deadline: float) -> None: ...

    def wait_for_step(self, step: int, timeout: float | None = None) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...

    def upload_meter(self, step: int | None = None) -> TransferMeter | None: ...

    def unsettled_steps(self) -> list[int]: ...

    def close(self, timeout: float | None = None) -> bool: ...

    def new_failures(self) -> list[PersistError]: ...

    @property
    def in_flight_step(self) -> int | None: ...

    @property
    def idle(self) -> bool: ...


__all__ = [
    "CheckpointPersister",
    "EmergencyPlan",
    "PersistJob",
    "PersistRecord",
    "Persister",
    "StepTracker",
    "default_scratch_root",
    "folder_bytes",
    "plan_emergency",
    "private_scratch_root",
]
