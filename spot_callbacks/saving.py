"""How a checkpoint is taken: snapshot, hand it to the persister of its kind, account for it.

The engine's saves (``SpotEngine.saves``, a :class:`CheckpointWriter`): every save an adapter asks
for goes through it. It picks the persister from the layout of the step folder the save writes
(``store/layout.py``'s :class:`~spot_callbacks.store.layout.StepLayout` says who writes its
files; :data:`PERSISTERS` maps that to :data:`SINGLE_WRITER`, :data:`SHARDED` or
:data:`FOLDERS_ACROSS_NODES`; a run that mixes them is refused, since each commits its own way),
builds each persist job's ``metrics``, ``extra`` (the ledger, the preemption record) and
``deadline`` once for every kind of save, remembers the last step saved (the "never twice" rule
reads it) and the commits and failures it reported.

- :data:`SINGLE_WRITER`: the writer rank persists a staged state (``STATE_FILE``, :func:`state_file_job`)
  or a folder the framework wrote (:func:`folder_job`) (:class:`~spot_callbacks.persist.Persister`);
- :data:`SHARDED`: every rank persists its own DCP shards
  (:class:`~spot_callbacks.persist.sharded.ShardedPersister`);
- :data:`FOLDERS_ACROSS_NODES`: each node's local main process uploads its copy of a framework
  folder (or every rank its own files), rank 0 commits (``NodeFolderPersister``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from spot_callbacks._dist import (
    barrier,
    broadcast_object,
    gather_from_ranks,
    is_writer,
    local_rank,
)
from spot_callbacks.accounting.clock import RunAccounts
from spot_callbacks.errors import PersistError
from spot_callbacks.persist import CheckpointPersister, Persister, PersistJob, PersistRecord
from spot_callbacks.persist.folders import NodeFolderPersister
from spot_callbacks.persist.pipeline import SLOW_UPLOAD_FIX_AUTO
from spot_callbacks.persist.scratch import discard_copies_older_than
from spot_callbacks.persist.sharded import ShardedPersister
from spot_callbacks.persist.shards import local_shards
from spot_callbacks.preemption import Notice
from spot_callbacks.preemption.emergency import Emergency
from spot_callbacks.staging import StagedState, StagingArea, write_state
from spot_callbacks.store import CheckpointStore, step_dirname
from spot_callbacks.store.checksums import FileDigest
from spot_callbacks.store.layout import (
    EVERY_RANK,
    FOLDER_LAYOUT,
    ONE_WRITER,
    RANK_FOLDER_LAYOUT,
    RANK_SHARDS,
    SHARDED_LAYOUT,
    STATE_FILE,
    STATE_LAYOUT,
    StepLayout,
)
from spot_callbacks.trigger import CheckpointTrigger, rules

log = logging.getLogger("spot_callbacks")
P = TypeVar("P", bound=CheckpointPersister)


@dataclass(frozen=True)
class PersisterKind(Generic[P]):
    """One kind of save and the persister that makes it durable (``make(store, scratch_root, keep_last)``).

    Example:
        >>> SHARDED.mixing_error(SINGLE_WRITER)
        'this run saves sharded checkpoints (save_sharded_state); it cannot mix in single-file ones'
    """

    name: str
    saved_by: str
    make: Callable[[CheckpointStore, Path, int], P]

    def mixing_error(self, wanted: PersisterKind) -> str:
        return (
            f"this run saves {self.name} checkpoints ({self.saved_by}); it cannot mix in {wanted.name} ones"
        )


def _single_writer(store: CheckpointStore, scratch_root: Path, keep_last: int) -> Persister:
    return Persister(store, keep_last=keep_last, scratch_root=scratch_root)


def _sharded(store: CheckpointStore, scratch_root: Path, keep_last: int) -> ShardedPersister:
    return ShardedPersister(store, scratch_root, keep_last=keep_last)


def _folders_across_nodes(store: CheckpointStore, scratch_root: Path, keep_last: int) -> NodeFolderPersister:
    return NodeFolderPersister(store, keep_last=keep_last)  # each node's folders are the framework's


# Three persisters, one per writer of a step folder: the layout of what is saved (store/layout.py's
# StepLayout.written_by) picks it. A run that mixes them is refused, since each commits its own way.
SINGLE_WRITER = PersisterKind("single-file", "save_state", _single_writer)
SHARDED = PersisterKind("sharded", "save_sharded_state", _sharded)
FOLDERS_ACROSS_NODES = PersisterKind("multi-node folder", "save_folder across nodes", _folders_across_nodes)
PERSISTERS: dict[str, PersisterKind[Any]] = {
    ONE_WRITER: SINGLE_WRITER,
    RANK_SHARDS: SHARDED,
    EVERY_RANK: FOLDERS_ACROSS_NODES,
}


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
    """The job that writes a staged state as ``STATE_FILE`` into ``local_dir`` in the background."""

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


class CheckpointWriter:
    """Takes the run's checkpoints and keeps its persister (one kind per run, made by the first save).

    Example:
        >>> import tempfile, torch
        >>> from spot_callbacks.preemption import PreemptionWatcher
        >>> store = CheckpointStore(tempfile.mkdtemp())
        >>> writer = CheckpointWriter(store, Path(tempfile.mkdtemp()), 3, "demo", RunAccounts(),
        ...                           Emergency(PreemptionWatcher([])), CheckpointTrigger(None, None))
        >>> _ = writer.save_state(3, 0, {"w": torch.ones(2)}, "steps")
        >>> writer.close(None), store.latest().step, writer.last_saved_step
        ([], 3, 3)
    """

    def __init__(
        self,
        store: CheckpointStore,
        scratch_root: Path,
        keep_last: int,
        framework: str,
        accounts: RunAccounts,
        emergency: Emergency,
        trigger: CheckpointTrigger,
    ) -> None:
        self.store = store
        self.scratch_root = scratch_root
        self.keep_last = keep_last
        self.framework = framework
        self.accounts = accounts
        self.emergency = emergency
        self.trigger = trigger
        self.staging = StagingArea()
        self.persister: CheckpointPersister | None = None  # made by the first save, of one kind
        self.persister_kind: PersisterKind[Any] | None = None
        self._spans_nodes: bool | None = None  # several nodes (local main processes); see spans_nodes()
        # The run's folders hold files of every rank even on one node (FSDP shards): set by the adapter.
        self.folders_span_ranks = False
        self.last_saved_step: int | None = None
        self.last_stall_s: float | None = None
        self._reported_records = 0
        self.refused_reason: str | None = None  # set once: every later save is refused (see refuse())
        self._earlier_records: list[PersistRecord] = []  # of the persisters close() closed
        self._adopted_copy: Path | None = None  # see adopt_local_copy()

    def spans_nodes(self) -> bool:
        """True when the run has more than one node (local main process); one all-gather, then cached.

        Collective on its first call: every rank calls it at the same point.
        """
        if self._spans_nodes is None:
            self._spans_nodes = sum(gather_from_ranks(local_rank() == 0)) > 1
        return self._spans_nodes

    def refuse(self, reason: str) -> None:
        """Take no more checkpoints into this store (every rank calls it at the same step)."""
        if self.refused_reason is None:
            self.refused_reason = reason
            log.error(
                "spot_callbacks: %s: no more checkpoints are written there; training stops at the end of this step",
                reason,
            )

    def _refused(self, step: int) -> bool:
        if self.refused_reason is not None:
            log.warning("spot_callbacks: not checkpointing step %d: %s", step, self.refused_reason)
        return self.refused_reason is not None

    def resumed_from(self, step: int, folder: Path) -> None:
        """The run resumed from the committed ``step``, pulled into ``folder`` (every rank): a run resumed
        at its very end must not rewrite it, and older copies in scratch go, on every node."""
        self.last_saved_step = step
        if local_rank() == 0 and Path(folder).parent == self.scratch_root:
            discard_copies_older_than(self.scratch_root, step)

    def adopt_local_copy(self, folder: Path) -> None:
        """The local copy of the checkpoint this run resumed from is the run's: it goes, as the run's
        own copies go, once a newer checkpoint whose folder the run owns commits (every rank)."""
        self._adopted_copy = Path(folder)

    def persister_for(self, layout: StepLayout) -> Any:
        """The persister of a step folder of ``layout`` (its writer's, :data:`PERSISTERS`); made on first
        use (for the multi-rank ones: on every rank at once)."""
        kind = PERSISTERS[layout.written_by]
        if self.persister is None:
            persister = kind.make(self.store, self.scratch_root, self.keep_last)
            self.persister, self.persister_kind = persister, kind
            if isinstance(persister, Persister) and self.trigger.auto:
                persister.slow_upload_fix = SLOW_UPLOAD_FIX_AUTO
            adopt = getattr(persister, "adopt_local_copy", None)
            if self._adopted_copy is not None and adopt is not None and local_rank() == 0:
                adopt(self._adopted_copy)
            self._adopted_copy = None
            return persister
        if self.persister_kind is not kind:
            assert self.persister_kind is not None  # set with the persister
            raise RuntimeError(self.persister_kind.mixing_error(kind))
        return self.persister  # made by this kind

    def prepare_sharded(self) -> None:
        """Make the sharded persister now, before the first checkpoint, which then does not pay for its
        process groups. Collective: every rank calls it at the same step boundary (or none does)."""
        if self.refused_reason is None:
            self.persister_for(SHARDED_LAYOUT)

    def prepare_rank_files(self) -> None:
        """Make the persister every rank writes its own files through (:meth:`save_rank_files`', and
        :meth:`save_folder`'s where folders span ranks or nodes) now, before the first checkpoint, which
        then does not pay for its gloo groups. Collective: every rank calls it at the same step boundary
        (or none does), after the resume (the persister adopts the local copy resumed from)."""
        if self.refused_reason is None:
            self.persister_for(RANK_FOLDER_LAYOUT)

    def prepare_state_file(self) -> None:
        """Make the writer's state-file persister (:meth:`save_state`'s) now, before the first checkpoint,
        which then does not start its threads in the loop. Not collective: the other ranks do nothing."""
        if self.refused_reason is None and is_writer():
            self.persister_for(STATE_LAYOUT)

    def save_state(
        self, step: int, epoch: int | None, state: Any, reason: str, extra: dict[str, Any] | None = None
    ) -> float:
        """Snapshot ``state`` (the training loop pays only this) and persist it in the background.

        Only the writer rank stages and uploads; call it on every rank all the same. Returns the
        seconds the caller was blocked.
        """
        started = time.perf_counter()
        if self._refused(step):
            return 0.0
        if is_writer():
            staged = self.staging.stage(state)
            terms = self._job_terms(reason, time.perf_counter() - started, extra, staged_bytes=staged.nbytes)
            job = state_file_job(
                step, reason, self.framework, self.scratch_root, staged, epoch=epoch, **terms
            )
            self.persister_for(STATE_LAYOUT).submit(job)
        return self._after_save(step, time.perf_counter() - started)

    def save_sharded_state(
        self,
        step: int,
        epoch: int | None,
        state: dict[str, Any],
        reason: str,
        meta: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        layouts: dict[tuple[Any, ...], Any] | None = None,
        rank_meta: dict[tuple[Any, ...], Any] | None = None,
        cut: Callable[[dict[str, Any], Any], dict[str, Any]] | None = None,
        after_release: Callable[[], None] | None = None,
    ) -> float:
        """Snapshot this rank's shards of ``state`` and persist them in the background, every rank in parallel.

        For state no rank holds whole (FSDP, DTensor): call it on every rank with the rank's
        sharded state dicts (``{"model": get_model_state_dict(model), "optim": ...}``); ``meta`` is
        the small non-tensor rest, written by rank 0 as ``meta.pt``. The checkpoint commits once
        every rank's files are durable (see sharded.py). ``layouts``: ``state`` holds local shards
        already (:func:`~spot_callbacks.persist.shards.local_shards`, as
        :class:`~spot_callbacks.persist.handles.ShardHandles` keeps them), of these layouts.
        ``rank_meta``: this rank's values for ``meta``, by their path in it, gathered onto rank 0 by the
        writers beside the write (off the loop): ``meta.pt`` holds at each path every rank's value in
        rank order (see :meth:`~spot_callbacks.persist.sharded.ShardedPersister.job`). ``cut``: what
        the writer writes instead of the staged state (see there); ``after_release``: called by the writer
        once the staging buffers are released (FSDP1's flat-shard buffers allocated then).
        Returns the seconds this rank was blocked.
        """
        started = time.perf_counter()
        if self._refused(step):
            return 0.0
        persister = self.persister_for(SHARDED_LAYOUT)
        # The local shards go through the run's staging buffers, as a single writer's state does.
        if layouts is None:
            layouts = {}
            state = local_shards(state, layouts)
        staged = self.staging.stage(state)
        try:
            terms = self._job_terms(reason, time.perf_counter() - started, extra, staged_bytes=staged.nbytes)
            persister.submit(
                persister.job(
                    step, reason, self.framework, staged.state, meta=meta, epoch=epoch, layouts=layouts,
                    before_write=staged.wait_copied, on_written=then_call(staged.release, after_release),
                    rank_meta=rank_meta, cut=cut, **terms,
                )
            )  # fmt: skip
        except BaseException:
            staged.release()  # no writer will: the next checkpoint must find the buffers free
            raise
        return self._after_save(step, time.perf_counter() - started)

    def save_folder(
        self,
        step: int,
        epoch: int | None,
        folder: Path,
        reason: str,
        stall_s: float = 0.0,
        owns_folder: bool = False,
        extra: dict[str, Any] | None = None,
        write: Callable[[Path], dict[str, FileDigest]] | None = None,
        on_written: Callable[[], None] | None = None,
    ) -> bool:
        """Persist a checkpoint folder the framework has already written (for example HF's ``checkpoint-N``).

        Call it on every rank: each rank may have written files into the folder (HF's
        ``rng_state_{rank}.pth``), so the writer submits only after every rank got here. On
        several nodes ``folder`` may be node-local: each node's local main process then uploads
        its copy's files and rank 0 commits once every node's are durable. A step already
        checkpointed is not persisted again: returns False.

        ``write`` (one node only): the folder is not written yet; the writer thread produces it
        with ``write(folder)``, then calls ``on_written`` (also called when nothing is persisted).
        With :attr:`folders_span_ranks` (FSDP shards: every rank's files, even on one node) the
        folder goes through the persister every rank takes part in, as on several nodes.
        """
        if write is not None and self.spans_nodes():
            raise ValueError("a folder written in the background is persisted on one node only")
        already_saved = not rules.needs_checkpoint(step, self.last_saved_step)
        if already_saved and write is None:
            log.info("spot_callbacks: step %d is already checkpointed; not uploading it again", step)
        if already_saved or self._refused(step):
            if on_written is not None:
                on_written()
            return False
        barrier()
        layout = RANK_FOLDER_LAYOUT if self.spans_nodes() or self.folders_span_ranks else FOLDER_LAYOUT
        if layout.written_by == EVERY_RANK:
            persister = self.persister_for(layout)
            terms = self._job_terms(reason, stall_s, extra)
            persister.submit(
                persister.job(
                    step, reason, self.framework, Path(folder), lists_folder=local_rank() == 0,
                    owns_folder=owns_folder, epoch=epoch, **terms,
                )
            )  # fmt: skip
        elif is_writer():
            terms = self._job_terms(reason, stall_s, extra)
            job = folder_job(
                step, reason, self.framework, folder, owns_folder=owns_folder, epoch=epoch, **terms
            )
            job.write, job.on_written = write, on_written
            self.persister_for(layout).submit(job)
        self._after_save(step, stall_s)
        return True

    def save_rank_files(
        self,
        step: int,
        epoch: int | None,
        folder: Path,
        reason: str,
        write: Callable[[Path, Any], Mapping[str, FileDigest | None]],
        *,
        stall_s: float = 0.0,
        owns_folder: bool = False,
        extra: dict[str, Any] | None = None,
        on_written: Callable[[], None] | None = None,
    ) -> bool:
        """Every rank writes its own files of ``folder`` in the background and uploads them; rank 0 commits.

        Call it on every rank with the same steps (``write`` is this rank's: ``write(folder, group)``
        runs on every rank's writer thread at once, may run collectives on the gloo ``group``, and
        returns the names it wrote under ``folder``, each with its digest where it was hashed as
        written, else ``None``; ``on_written`` follows it, also when nothing is persisted).
        ``folder`` may be node-local or shared. False: the step is checkpointed already.
        """
        if not rules.needs_checkpoint(step, self.last_saved_step) or self._refused(step):
            if on_written is not None:
                on_written()
            return False
        persister = self.persister_for(RANK_FOLDER_LAYOUT)
        terms = self._job_terms(reason, stall_s, extra)
        persister.submit(
            persister.job(
                step, reason, self.framework, Path(folder), lists_folder=local_rank() == 0,
                owns_folder=owns_folder, epoch=epoch, write=write, on_written=on_written, **terms,
            )
        )  # fmt: skip
        self._after_save(step, stall_s)
        return True

    def _job_terms(
        self, reason: str, stall_s: float, extra: dict[str, Any] | None, **measures: Any
    ) -> dict[str, Any]:
        """The ``metrics``, ``extra`` and ``deadline`` of a checkpoint's persist job, for every kind of save.

        The writer adds the checkpoint to the ledger first, so the ledger in ``extra`` counts it.
        """
        metrics = {}
        if is_writer():  # the ledger is the writer's: it goes into the manifest
            metrics = {**self.accounts.add_checkpoint(reason, stall_s, self.trigger.interval_s), **measures}
        return {
            "metrics": metrics,
            "extra": {
                **(extra or {}),
                "ledger": self.accounts.ledger.to_json(),
                "lineage": dict(self.accounts.lineage),
                **self.emergency.manifest_extra(reason),
            },
            "deadline": self.emergency.deadline(reason),
        }

    def _after_save(self, step: int, stall_s: float) -> float:
        self.last_saved_step = step
        self.last_stall_s = stall_s
        cost_s = self.accounts.checkpoint_taken(stall_s)
        self.trigger.observe_interruptions(*self.accounts.interruption_history())
        self.trigger.mark_checkpoint(cost_s=cost_s)
        return stall_s

    def new_failures(self) -> list[PersistError]:
        if self.persister is None:
            return []
        return self.persister.new_failures()

    def all_records(self) -> list[PersistRecord]:
        """Every commit of this writer so far, oldest first (a new list)."""
        current = self.persister.records if self.persister is not None else []
        return [*self._earlier_records, *current]

    def records_view(self) -> Sequence[PersistRecord]:
        """:meth:`all_records` without the copy where one persister made them all (each step boundary
        reads it: a long run's history is not copied every step). Read only; it may grow while read."""
        if self.persister is None:
            return self._earlier_records
        return self.persister.records if not self._earlier_records else self.all_records()

    def new_records(self) -> list[PersistRecord]:
        """Commits not yet returned by this method, those made while :meth:`finish` waited included."""
        current = self.persister.records if self.persister is not None else []
        if len(self._earlier_records) + len(current) == self._reported_records:
            return []  # nothing new: the usual step boundary
        records = self.all_records()[self._reported_records :]
        self._reported_records += len(records)
        return records

    @property
    def persisting(self) -> bool:
        """An upload is in flight (steps now feed the slowdown meter's "while persisting" side)."""
        return self.persister is not None and not self.persister.idle

    def wait_for_commit(self, notice: Notice | None, timeout: float | None) -> bool:
        """Block up to ``timeout`` until every submitted checkpoint committed (in an emergency only the
        newest: :meth:`Emergency.wait_for_checkpoint`); collective: every rank gets the same answer."""
        committed = True
        persister = self.persister  # the writer's, or every rank's when each persists its shards
        if persister is not None:
            step = self.last_saved_step
            if notice is not None and step is not None:
                committed = self.emergency.wait_for_checkpoint(persister, step, notice, timeout, is_writer())
            else:
                committed = persister.wait(timeout=timeout)
        barrier()
        return bool(broadcast_object(committed)) if notice is not None else committed

    def close(self, timeout: float | None) -> list[PersistError]:
        """Wait up to ``timeout`` for every upload (notices still handled: see
        :meth:`Emergency.wait_at_exit`) and stop the persister; return its failures.

        In an emergency only its checkpoint is waited for, up to the deadline: older uploads
        still in flight are not. A later fit() gets a fresh persister.
        """
        persister = self.persister
        if persister is None:
            return []
        step = self.last_saved_step
        if not self.emergency.agreed_at_a_step():  # a notice now (or meanwhile) comes at the exit
            self.emergency.wait_at_exit(persister, step, timeout, is_writer())
        else:
            limit = self.emergency.closing_timeout(persister, step) if timeout is None else timeout
            if not persister.wait(timeout=limit) and is_writer():
                # Only the emergency checkpoint's own bookkeeping may still run: say nothing then.
                older = [s for s in persister.unsettled_steps() if step is None or s < step]
                if older:
                    log.warning(
                        "spot_callbacks: not waiting for the upload of step%s %s still in flight at the preemption",
                        "s" if len(older) > 1 else "", ", ".join(map(str, older)),
                    )  # fmt: skip
        self.stop_persister()
        return persister.failures

    def stop_persister(self) -> None:
        """Stop the persister's workers (each ends after its work in progress); on every exit path."""
        persister = self.persister
        if persister is None:
            return
        persister.close(timeout=0)
        self._earlier_records.extend(persister.records)
        self.persister = self.persister_kind = None

    def end_verdict(self, failures: list[PersistError]) -> PersistError | None:
        """What the run's failed checkpoints mean at its end (:func:`rules.end_verdict`): the error to
        raise, if any; what was dropped is said on the writer."""
        newest = max((record.info.step for record in self.all_records()), default=None)
        verdict = rules.end_verdict(failures, newest)
        if verdict.line is not None and is_writer():
            log.warning("spot_callbacks: %s", verdict.line)
        return verdict.error


def then_call(first: Callable[[], None], second: Callable[[], None] | None) -> Callable[[], None]:
    """``first()``, then ``second()`` where given; an error of ``second`` is logged, never raised (it
    runs on a writer thread after the checkpoint's own work is done).

    Example:
        >>> calls = []; then_call(lambda: calls.append(1), lambda: calls.append(2))(); calls
        [1, 2]
    """
    if second is None:
        return first

    def both() -> None:
        first()
        try:
            second()
        except Exception as error:  # noqa: BLE001 - out of memory here: the next stage allocates, and says so
            log.debug("spot_callbacks: after releasing the staging buffers: %r", error)

    return both
