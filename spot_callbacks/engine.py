"""`SpotEngine`: the core both adapters call. Orchestration only: each rule lives in its own module.

An adapter translates framework hooks into these calls:

- :meth:`SpotEngine.start` / :meth:`SpotEngine.stop` around training (notice sources, workers);
- :meth:`SpotEngine.step_boundary` at each optimizer-step boundary: one
  :class:`~spot_callbacks.trigger.rules.StepAction` for all ranks (rules in ``trigger/rules.py``);
- :meth:`SpotEngine.save_state` (a state to snapshot), :meth:`SpotEngine.save_sharded_state`
  (every rank's shards, FSDP) or :meth:`SpotEngine.save_folder` (a folder the framework wrote)
  when a checkpoint is due;
- :meth:`SpotEngine.finish_emergency` after an emergency checkpoint (``preemption/emergency.py``),
  :meth:`SpotEngine.finish` at the end;
- :meth:`SpotEngine.pull_latest` before resuming (``resume.py``).

The pieces: ``trigger/`` (when), ``staging.py`` (the snapshot), ``persist/`` (to the store),
``resume.py`` (back from it), ``accounting/`` (what it cost, how stale, which region).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, cast

import spot_callbacks.settings as settings
from spot_callbacks._dist import (
    agree_at_step,
    barrier,
    is_writer,
    local_rank,
    rank,
)
from spot_callbacks.accounting.attempts import AttemptLog
from spot_callbacks.accounting.clock import RunAccounts
from spot_callbacks.accounting.region import RegionCheck
from spot_callbacks.accounting.watch import PersistWatch
from spot_callbacks.config import SpotConfig
from spot_callbacks.errors import PersistError, RunLockedError, StoreUnavailableError
from spot_callbacks.log import set_verbose, show_info_lines
from spot_callbacks.persist import PersistRecord
from spot_callbacks.persist.scratch_folders import claim_scratch_root, drop_unused_scratch_root
from spot_callbacks.persist.tracking import workers_woken_after
from spot_callbacks.preemption import Notice, PreemptionWatcher, exit_guard
from spot_callbacks.preemption.emergency import EXIT_MARGIN_S, Emergency, time_left_s, warn_if_grace_too_short
from spot_callbacks.preemption.startup import exit_on_notice
from spot_callbacks.resume import ResumeInfo, move_aside_uncommitted, pull_latest, say_new_lineage
from spot_callbacks.run_lease import RunLease
from spot_callbacks.saving import CheckpointWriter
from spot_callbacks.staging import StagingArea
from spot_callbacks.store import CheckpointStore, step_dirname
from spot_callbacks.store.checksums import FileDigest
from spot_callbacks.store.layout import STATE_FILE
from spot_callbacks.store.preflight import preflight_enabled, probe_listings
from spot_callbacks.store.runlock import RELEASE_TIMEOUT_S
from spot_callbacks.trigger import CheckpointTrigger, rules

log = logging.getLogger("spot_callbacks")

# Even past a deadline a local lock is deleted in far less; an object store that slow leaves it to go stale.
RELEASE_FLOOR_S = 0.5
ATTEMPT_CLOSE_TIMEOUT_S = 5.0  # the attempt record's last write, before the lock's release

__all__ = ["EXIT_MARGIN_S", "STATE_FILE", "ResumeInfo", "SpotEngine"]


class SpotEngine:
    """The protocol core: trigger, snapshot, persist, commit, retention, resume.

    Args:
        config: the user's :class:`SpotConfig`.
        framework: recorded in every manifest (``"lightning"``, ``"hf"``, ...).

    Example:
        >>> import torch, tempfile
        >>> engine = SpotEngine(SpotConfig(dirpath=tempfile.mkdtemp(), interval=None, preemption=[]), "demo")
        >>> engine.start()
        >>> _ = engine.save_state(step=10, epoch=0, state={"w": torch.ones(2)}, reason="steps")
        >>> engine.finish()
        >>> engine.store.latest().step
        10
    """

    def __init__(self, config: SpotConfig, framework: str) -> None:
        show_info_lines()
        settings.check_all()  # a bad SPOT_* value fails here, before the first step
        self.config = config
        self.framework = framework
        # SpotConfig.__post_init__ turned a JSON string or file name into the dict.
        options = cast("dict[str, Any] | None", config.storage_options)
        self.store = CheckpointStore(config.dirpath, storage_options=options)
        # Its clients are built while the user builds the model and the Trainer, ahead of the resume.
        self.store.warm_data_plane()
        self.scratch_root = claim_scratch_root(self.store.url, config.scratch_dir)  # and sweep
        self.trigger = CheckpointTrigger(
            config.interval_seconds, config.every_n_steps, auto=config.interval_is_auto,
            interruptions_per_hour=config.interruptions_per_hour,
        )  # fmt: skip
        self.watcher = PreemptionWatcher.from_setting(config.preemption)
        self.emergency = Emergency(self.watcher)
        self.accounts = RunAccounts()  # the lineage's ledger goes into every manifest
        self.saves = CheckpointWriter(
            self.store,
            self.scratch_root,
            config.keep_last,
            framework,
            self.accounts,
            self.emergency,
            self.trigger,
        )
        self.lease = RunLease(self.store)
        # This process's record in the store, from its start: what `report` counts billed time from.
        self.attempt = AttemptLog(self.store)
        self.running = False  # between start() and finish()/stop(): the run holds its lock and workers
        self._first_boundary = True
        self.resumed: ResumeInfo | None = None
        self._resume_recorded = False
        # The staleness alarm and region check, fed at each step; its advice on "auto" asks the trigger.
        self.watch = PersistWatch(self.store, self.trigger.auto_choice)

    # ----------------------------------------------------------- ranks
    @property
    def is_writer(self) -> bool:
        """The rank that writes single-file checkpoints and manifests (rank 0)."""
        return is_writer()

    def barrier(self) -> None:
        barrier()

    @property
    def last_saved_step(self) -> int | None:
        return self.saves.last_saved_step

    @property
    def last_stall_s(self) -> float | None:
        return self.saves.last_stall_s

    @property
    def staging(self) -> StagingArea:
        return self.saves.staging

    # ------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Install notice sources and start the interval clock; call once training is about to run."""
        # Set first: a start that fails half-way (after the lock) is undone by stop() like any exit.
        self.running = True
        set_verbose(self.config.verbose)
        self._claim_scratch()
        # The interval counts training time, not the set-up before it (model build, a long pull).
        self.trigger.mark_checkpoint()
        self.accounts.start_clock()
        try:
            with exit_on_notice(self.watcher.sources, "waiting for the store and the run lock"):
                # The record's first write once the preflight's probe is in (a process killed from then on
                # is billed); its thread once the preflight proved the store (nothing of ours races it).
                self.lease.acquire(on_store_writable=self._first_record, on_store_ready=self._begin_attempt)
        except (RunLockedError, StoreUnavailableError):
            self.attempt.discard()  # not a process of the run in this dirpath (or none could be kept)
            drop_unused_scratch_root(self.scratch_root)  # a start that never ran leaves no folder
            raise
        except SystemExit:
            self.attempt.close("preempted")
            raise
        if not self.lease.pending:
            self._lock_taken()
        self.watcher.clear()  # a notice acted on in an earlier fit() in this process is spent
        self.watcher.start()
        warn_if_grace_too_short(self.watcher.sources)
        self.watch.start(self.is_writer)

    def _lock_taken(self) -> None:
        """The lock is settled (at start, or later by the watch that went on while training ran)."""
        if self.lease.refusal is not None:
            self.attempt.discard()  # not a process of the run in this dirpath
            return
        self.attempt.note(lock_wait_s=self.lease.lock_wait_s, lock_cause=self.lease.lock_cause())
        self.accounts.dead_run = self.lease.dead_run()  # a run that died uncommitted: an interruption

    def hold_for_writing(self) -> None:
        """Call before anything is written into the store: waits for a run lock still watched (a
        replacement trains while a dead run's lock goes stale) and raises :class:`RunLockedError` if
        it is another live run's (see ``run_lease.py``)."""
        if self.lease.pending:
            try:
                self.lease.hold_for_writing()
            finally:
                self._lock_taken()
        elif self.lease.refusal is not None:
            raise self.lease.refusal

    def _claim_scratch(self) -> None:
        if not self.scratch_root.is_dir():  # an earlier start that failed removed it
            claim_scratch_root(self.store.url, self.config.scratch_dir)

    def stop(self) -> None:
        """An exception ends training: stop the notice sources and the workers, release the run lock."""
        self.running = False
        self.watcher.stop()
        self.saves.stop_persister()
        self._release(self.emergency.active_notice(), finished=False)

    def abandon(self, error: BaseException | None) -> None:
        """Training unwound without :meth:`finish` (``error``: what ended it; ``None``: it returned):
        let the uploads in flight commit, then :meth:`stop` (a no-op unless running). Called around the
        framework's entry point (``run_lease.release_on_unwind``): no exit path leaves the lock held."""
        if not self.running:
            return
        try:
            # A second Ctrl-C means now; a lost lock means the store is another run's.
            if not isinstance(error, KeyboardInterrupt) and not self.lease.lost:
                self.wait_for_commit()
        finally:
            self.stop()

    def _release(self, notice: Notice | None, finished: bool) -> None:
        """Close this process's attempt record (preempted, finished or stopped) and release the run
        lock within what is left before the deadline; a preempted exit is armed to end with 143 by
        then, whatever a worker is still doing (``preemption/exit_guard.py``)."""
        left = max(time_left_s(notice, RELEASE_TIMEOUT_S) or 0.0, RELEASE_FLOOR_S)
        exit_guard.arm_for(notice, self.config.on_preemption == "stop", self.watcher.interrupted_twice)
        noticed = notice is not None or self.watcher.notice is not None
        end = "preempted" if noticed else "finished" if finished else "stopped"
        self.attempt.close(end, min(left / 2, ATTEMPT_CLOSE_TIMEOUT_S))
        self.lease.release(left)

    def _note_checkpoint(self, step: int) -> None:
        if self.is_writer:
            self.attempt.checkpoint_taken(step)

    def _first_record(self) -> None:
        """Write this process's attempt record once, now (the writer's), in the caller's thread."""
        if self.is_writer:
            self.attempt.write_now()

    def _begin_attempt(self) -> None:
        """Keep this process's attempt record from now (the writer's; idempotent)."""
        if self.is_writer:
            self.attempt.begin()

    # ---------------------------------------------- what adapters ask of the parts (the one door)
    @property
    def pending_notice(self) -> Notice | None:
        """The first notice since training started (signals received until now included), or None."""
        return self.watcher.notice

    def watches(self, source: str) -> bool:
        """Whether ``source`` (a name of ``preemption.NOTICE_SOURCES``, e.g. ``"SIGTERM"``) is watched."""
        return source in self.watcher.sources

    def reassert_signal_handlers(self) -> None:
        """Put this run's signal handlers back in front of one a framework installed over them."""
        self.watcher.reassert()

    def spans_nodes(self) -> bool:
        """The ranks are on more than one machine (each node pulls and stages its own copy)."""
        return self.saves.spans_nodes()

    def save_folders_from_every_rank(self, every_rank: bool) -> None:
        """A framework's checkpoint folder holds files of every rank (FSDP shards), not rank 0's only."""
        self.saves.folders_span_ranks = every_rank

    def adopt_local_copy(self, folder: Path) -> None:
        """A folder resumed from, written outside the engine, is cleaned up like the run's own."""
        self.saves.adopt_local_copy(folder)

    @property
    def region_check(self) -> RegionCheck | None:
        return self.watch.region_check

    # -------------------------------------------------------- deciding
    def step_boundary(self, step: int, extra_notice: Notice | None = None) -> rules.StepAction:
        """At an optimizer-step boundary: report the failed persists, then :meth:`decide`."""
        for failure in self.new_failures():
            log.error("spot_callbacks: %s", rules.failure_line(failure))
        return self.decide(step, extra_notice)

    def decide(self, step: int, extra_notice: Notice | None = None) -> rules.StepAction:
        """One action for every rank at an optimizer-step boundary (collective when distributed).

        A notice seen by any rank is a preemption for all, with the earliest deadline any rank
        knows; an early hint (AWS rebalance recommendation) is a normal checkpoint now.
        """
        if extra_notice is not None:
            self.watcher.report(extra_notice)
        self.accounts.time_step(persisting=self.saves.persisting)
        if self.lease.poll():  # the lock watched while training ran is settled: ours, or refused
            self._lock_taken()
        writer = self.is_writer
        if writer:
            if self._first_boundary:
                self.attempt.note(lineage=self.accounts.lineage["id"])
            self.attempt.step(step)
            self.watch.observe(
                self.saves.records_view(), self.saves.persister, self.trigger.interval_s, self.resumed
            )
        if self._first_boundary and writer and self.resumed is None:
            say_new_lineage(self.store, step)  # a fresh run in an old dirpath: which lineage `latest` follows
        self._first_boundary = False
        local = self.trigger.due(step)
        interval, steps, notice, hint, lease_lost = agree_at_step(
            local == "interval",
            local == "steps",
            self.watcher.notice,
            self.watcher.take_hint(),
            self.lease.lost,
        )
        if lease_lost:
            self.saves.refuse(f"this run lost the run lock of {self.store.url} to another run")
            raise self.lease.lost_error(step, self.last_saved_step)
        if notice is not None:
            self.watcher.report(notice)  # a rank that saw nothing adopts it
            self.emergency.agree(notice)
        action = rules.decide(
            step, last_saved_step=self.last_saved_step, notice=notice, hint=hint, interval_due=interval,
            steps_due=steps,
        )  # fmt: skip
        if action.warning is not None:
            log.warning("spot_callbacks: %s", action.warning)
        return action

    def needs_checkpoint(self, step: int) -> bool:
        """False for a step already checkpointed (or resumed from): never twice."""
        return rules.needs_checkpoint(step, self.last_saved_step)

    def end_reason(self, step: int) -> str | None:
        """``"end"`` if training ending at ``step`` still needs its last checkpoint."""
        return rules.end_reason(step, self.last_saved_step)

    def on_exception(
        self, error_name: str, *, late_signal: bool, preempted: bool, between_batches: bool, step: int
    ) -> rules.ExceptionAction:
        """What an exception out of training asks for (logged here); see :func:`rules.on_exception`."""
        action = rules.on_exception(
            error_name, late_signal=late_signal, preempted=preempted, between_batches=between_batches,
            step=step, last_saved_step=self.last_saved_step,
        )  # fmt: skip
        if self.saves.refused_reason is not None:  # a lost lock: the store is another run's now
            action = dataclasses.replace(action, save=False, warning=None)
        if action.warning is not None:
            log.warning("spot_callbacks: %s", action.warning)
        return action

    # ---------------------------------------------------------- saving
    def save_state(
        self, step: int, epoch: int | None, state: Any, reason: str, extra: dict[str, Any] | None = None
    ) -> float:
        """Snapshot ``state`` and persist it in the background (see :meth:`CheckpointWriter.save_state`)."""
        self.hold_for_writing()
        result = self.saves.save_state(step, epoch, state, reason, extra)
        self._note_checkpoint(step)  # the snapshot is taken: training goes on from here
        return result

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
        """Every rank persists its shards (see :meth:`CheckpointWriter.save_sharded_state`)."""
        self.hold_for_writing()
        result = self.saves.save_sharded_state(
            step, epoch, state, reason, meta, extra, layouts, rank_meta, cut, after_release
        )
        self._note_checkpoint(step)  # the snapshot is taken: training goes on from here
        return result

    def prepare_sharded(self) -> None:
        """Make the sharded persister ahead of the first checkpoint (see :meth:`CheckpointWriter.prepare_sharded`)."""
        self.saves.prepare_sharded()

    def prepare_rank_files(self) -> None:
        """Make the every-rank folder persister ahead of the first checkpoint (see
        :meth:`CheckpointWriter.prepare_rank_files`)."""
        self.saves.prepare_rank_files()

    def prepare_state_file(self) -> None:
        """Make the writer's state-file persister ahead of the first checkpoint (see
        :meth:`CheckpointWriter.prepare_state_file`)."""
        self.saves.prepare_state_file()

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
        """Persist a folder the framework wrote, or one ``write`` writes in the background (see
        :meth:`CheckpointWriter.save_folder`)."""
        self.hold_for_writing()
        result = self.saves.save_folder(
            step, epoch, folder, reason, stall_s, owns_folder, extra, write, on_written
        )
        self._note_checkpoint(step)  # the snapshot is taken: training goes on from here
        return result

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
        """Every rank writes its own files of one folder (see :meth:`CheckpointWriter.save_rank_files`)."""
        self.hold_for_writing()
        result = self.saves.save_rank_files(
            step, epoch, folder, reason, write, stall_s=stall_s, owns_folder=owns_folder, extra=extra,
            on_written=on_written,
        )  # fmt: skip
        self._note_checkpoint(step)  # the snapshot is taken: training goes on from here
        return result

    def new_failures(self) -> list[PersistError]:
        return self.saves.new_failures()

    def new_records(self) -> list[PersistRecord]:
        """Commits not yet returned by this method, those made while :meth:`finish` waited included."""
        return self.saves.new_records()

    # ------------------------------------------------------- committing
    def wait_for_commit(self, notice: Notice | None = None, timeout: float | None = None) -> bool:
        """Block until every submitted checkpoint committed and all ranks know it; False if the wait ran out.

        In an emergency (``notice``, or the one agreed at the last :meth:`decide`) only the newest
        checkpoint is waited for, ahead of older uploads, until the deadline less a margin to exit
        (``preemption/emergency.py``); once it committed and training is to stop, the cloud is told (Azure).
        """
        notice = notice or self.emergency.active_notice()
        committed = self.saves.wait_for_commit(notice, self.emergency.wait_limit(notice, timeout))
        if notice is not None and committed and self.config.on_preemption == "stop":
            self.watcher.acknowledge()
        return committed

    def finish_emergency(self, notice: Notice | None) -> rules.AfterEmergency:
        """After the emergency checkpoint was taken: wait for its commit, then stop or continue.

        On ``continue`` the notice is spent (the next one is a new emergency).
        """
        self.wait_for_commit(notice)
        after = rules.after_emergency(self.config.on_preemption, notice or self.emergency.active_notice())
        if after is rules.AfterEmergency.CONTINUE:
            self.watcher.clear()
        return after

    def finish(self, timeout: float | None = None) -> None:
        """Wait for every upload, stop the workers, release the run lock (see :meth:`CheckpointWriter.close`).

        Notices are handled until the last commit settles: one then stops the run as preempted
        (``SystemExit(143)``). Raises when the newest state is not durable (:func:`rules.end_verdict`).
        """
        self.hold_for_writing()
        failures = self.saves.close(timeout)
        self.running = False
        self.watcher.stop()
        lost = agree_at_step(False, False, None, None, self.lease.lost)[4]  # lost after the last step
        self._release(self.emergency.active_notice(), finished=True)
        self.barrier()
        if lost:
            raise self.lease.lost_error(None, self.last_saved_step)
        error = self.saves.end_verdict(failures)
        if self.config.on_preemption == "stop":
            self.emergency.exit_if_noticed_at_exit()
        if error is not None:
            raise error

    def writers_woken_at_end(self) -> AbstractContextManager[None]:
        """A block whose checkpoint saves wake the background writers when it ends: an adapter puts
        its save and the logging of its metrics in one, so the writer's first Python does not hold
        the GIL inside the training loop's blocked window (a wait for a checkpoint in the block wakes
        them at once)."""
        return workers_woken_after()

    def persist_lag_s(self) -> float:
        """Seconds since the newest commit of this run (or since training started): ``spot/persist_lag_s``."""
        return self.watch.staleness.lag_s()

    def train_seconds(self) -> float:
        """Seconds of training in this run's lineage: the checkpoint resumed from's, plus this run's so far."""
        return self.accounts.train_seconds()

    def cost_summary(self) -> str:
        """The run's checkpoint costs on one screen; the adapters log it at the end of training."""
        return self.accounts.summary(self.store.url, self.saves.all_records(), self.trigger.describe())

    def log_cost_summary(self) -> None:
        """Log :meth:`cost_summary` on rank 0, after a run that committed a checkpoint (not after a failed
        start, a second Ctrl-C or a run with nothing committed: ``spot-callbacks report`` gives it on request);
        after a notice that stops the run, then the line that says what happens next (:meth:`next_step_line`)."""
        if not self.is_writer:
            return
        if self.watcher.interrupted_twice or not self.saves.all_records():
            log.debug(
                "spot_callbacks: no cost summary: %s",
                "stopped at once" if self.watcher.interrupted_twice else "nothing committed",
            )
        else:
            log.info("%s", self.cost_summary())
        line = self.next_step_line()
        if line is not None:
            log.warning("spot_callbacks: %s", line)
            exit_guard.say_at_exit(line)

    def next_step_line(self) -> str | None:
        """After a notice that stops the run: which step the resume point is (and whether the newest
        checkpoint committed or was abandoned), and what to do; None when no notice stopped it."""
        notice = self.emergency.active_notice()
        if (
            notice is None
            or rules.after_emergency(self.config.on_preemption, notice) is not rules.AfterEmergency.STOP
        ):
            return None
        committed = [record.info.step for record in self.saves.all_records()]
        resumed = self.resumed.info.step if self.resumed is not None else None
        newest = max([*committed, *([resumed] if resumed is not None else [])], default=None)
        taken = self.last_saved_step
        head = f"stopped for the {notice.source} notice"
        if taken is not None and taken != newest and taken != resumed:
            head += f"; the checkpoint of step {taken} did not commit in time and was abandoned"
        if newest is None:
            return f"{head}; nothing is committed in {self.store.url}: rerunning the same command starts from scratch"
        return (
            f"{head}; the resume point is step {newest}, committed in {self.store.url}: rerun the same "
            "command to continue from it"
        )

    # --------------------------------------------------------- resuming
    def pull_latest(self, dest: Callable[[int], Path] | None = None, check: Any = None) -> Path | None:
        """Resolve the newest committed checkpoint, pull it once per node, return its local folder
        (``check``: the framework's loadability check, see :func:`resume.pull_newest_valid`).

        Every rank gets the same answer (rank 0 decides); ``None`` when nothing is committed.
        ``dest(step)`` names the local folder (default: ``step-N`` in scratch); a folder that
        already holds exactly this checkpoint is not downloaded again.
        """
        in_scratch = lambda step: self.scratch_root / step_dirname(step)  # noqa: E731
        self._claim_scratch()
        try:
            with exit_on_notice(self.watcher.sources, "pulling the checkpoint to resume from"):
                taken = None
                if not self.running and preflight_enabled():
                    # Before the start (HF's latest()): the preflight's bounds and one-line diagnosis,
                    # not a listing's retries ending in the backend's own error 25 s later; its
                    # listings are the resume's (one round trip, not a probe's and then the resume's).
                    taken = probe_listings(self.store, objects=rank() == 0)  # rank 0 picks the checkpoint
                resumed = pull_latest(
                    self.store, dest or in_scratch, rank(), local_rank(), check, self._own_lineage(), taken
                )
        except SystemExit:
            self.attempt.close("preempted")
            raise
        except Exception:
            if not self.running:  # a refused store before the start: no scratch folder stays behind
                drop_unused_scratch_root(self.scratch_root)
            raise
        if resumed is None:
            return None
        self.resumed = resumed
        self.accounts.continue_lineage(resumed.info)
        self.attempt.note(resumed_from=resumed.info.step, lineage=self.accounts.lineage["id"])
        self.saves.resumed_from(resumed.info.step, resumed.local_dir)  # not rewritten; older copies go
        self._resume_recorded = False
        return resumed.local_dir

    def _own_lineage(self) -> str | None:
        """This run's lineage once it committed or resumed (``None`` before): a resume while it runs
        follows it, whatever another lineage wrote into ``dirpath`` since (store/commit.py)."""
        if self.resumed is None and not self.saves.all_records():
            return None
        lineage_id = self.accounts.lineage.get("id")
        return lineage_id if isinstance(lineage_id, str) else None

    def move_aside_uncommitted(
        self, local_checkpoints: Iterable[tuple[int, Path]], aside: Callable[[Path], Path]
    ) -> None:
        """After a resume: local checkpoint folders newer than it are moved aside (once per node; collective)."""
        if self.resumed is not None and local_rank() == 0:
            move_aside_uncommitted(local_checkpoints, self.resumed.info.step, aside)
        self.barrier()

    # ------------------------------------------------------------ state
    def state_dict(self, at_checkpoint: bool = False) -> dict[str, Any]:
        """The state to resume with. ``at_checkpoint``: it is stored in the checkpoint being taken
        now, so a run resumed from it starts its interval clock at zero (not one interval late)."""
        return {
            "trigger": {**self.trigger.state_dict(), **({"elapsed_s": 0.0} if at_checkpoint else {})},
            "ledger": self.accounts.ledger.to_json(),
            "train_s": round(self.train_seconds(), 3),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the clock and the ledger: of this resume (recorded once), else of ``state`` (checked)."""
        state, trigger = _untrusted_state(state)
        if trigger is not None:
            self.trigger.load_state_dict(trigger)
        resumed = self.resumed
        if resumed is not None and not self._resume_recorded:
            self._resume_recorded = True
            self.accounts.record_resume(resumed.info, resumed.pull_s, resumed.pulled_at, self.is_writer)
        elif not self.accounts.load(state):
            return
        self.trigger.observe_interruptions(*self.accounts.interruption_history())


def _untrusted_state(state: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A checkpoint's engine state (from a store) and its trigger part: what is not a mapping is
    ignored with a warning; each value inside is checked where it is read (trigger, accounts)."""
    if not isinstance(state, dict):
        log.warning("spot_callbacks: ignoring the checkpoint's spot_callbacks state: a %s, not a mapping",
                    type(state).__name__)  # fmt: skip
        return {}, None
    trigger = state.get("trigger")
    if trigger is not None and not isinstance(trigger, dict):
        log.warning("spot_callbacks: ignoring the checkpoint's interval clock: a %s, not a mapping",
                    type(trigger).__name__)  # fmt: skip
        trigger = None
    return state, trigger
