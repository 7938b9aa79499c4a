"""`SpotEngine`: the shared core both adapters call; every checkpoint rule lives here.

An adapter translates framework hooks into these calls:

- :meth:`SpotEngine.start` / :meth:`SpotEngine.stop` around training (notice sources, workers);
- :meth:`SpotEngine.decide` at each optimizer-step boundary (one decision for all ranks);
- :meth:`SpotEngine.save_state` (a state to snapshot), :meth:`SpotEngine.save_sharded_state`
  (every rank's shards, FSDP) or :meth:`SpotEngine.save_folder` (a folder the framework wrote)
  when a checkpoint is due;
- :meth:`SpotEngine.wait_for_commit` in an emergency, :meth:`SpotEngine.finish` at the end;
- :meth:`SpotEngine.pull_latest` before resuming.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch.distributed as dist

from spot_callbacks.accounting.costs import RunLedger, SlowdownMeter, finite_number, ledger_after_resume
from spot_callbacks.accounting.region import RegionCheck
from spot_callbacks.accounting.report import RunHistory, format_rows, format_seconds, history_rows
from spot_callbacks.accounting.staleness import StalenessMonitor
from spot_callbacks.config import SpotConfig
from spot_callbacks.errors import CorruptCheckpointError, ManifestError, PersistError, RunLockedError
from spot_callbacks.log import show_info_lines
from spot_callbacks.notices import Notice, PreemptionWatcher
from spot_callbacks.persist import Persister, PersistJob, PersistRecord, default_scratch_root
from spot_callbacks.persist.sharded import ShardedPersister
from spot_callbacks.staging import StagingArea, write_state
from spot_callbacks.store import CheckpointInfo, CheckpointStore, step_dirname
from spot_callbacks.store.checksums import FileDigest
from spot_callbacks.store.runlock import RunLock
from spot_callbacks.trigger import CheckpointTrigger
from spot_callbacks.trigger.collectives import agree, broadcast_object, distributed_ready, gather_from_ranks

log = logging.getLogger("spot_callbacks")

STATE_FILE = "state.ckpt"
# Time kept back from a preemption deadline for the process to exit after the commit.
EXIT_MARGIN_S = 2.0


@dataclass(frozen=True)
class Decision:
    """What every rank does at this step boundary."""

    reason: str | None  # "interval", "steps", "preemption" or None
    notice: Notice | None = None

    @property
    def save(self) -> bool:
        return self.reason is not None


@dataclass(frozen=True)
class ResumeInfo:
    """Where a resume came from and what it cost."""

    info: CheckpointInfo
    local_dir: Path
    pull_s: float
    pulled_at: float = 0.0  # time.perf_counter() when the pull ended: the load is timed from here


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
        self.config = config
        self.framework = framework
        self.store = CheckpointStore(config.dirpath, storage_options=config.storage_options)
        self.scratch_root = default_scratch_root(self.store.url, config.scratch_dir)
        self.trigger = CheckpointTrigger(
            config.interval_seconds,
            config.every_n_steps,
            auto=config.interval_is_auto,
            interruptions_per_hour=config.interruptions_per_hour,
        )
        self.watcher = PreemptionWatcher.from_setting(config.preemption)
        self._emergency_notice: Notice | None = None  # the notice every rank agreed on
        self._emergency_committed: int | None = None  # its checkpoint's step, once committed
        self.staging = StagingArea()
        self._persister: Persister | ShardedPersister | None = None
        self._spans_nodes: bool | None = None  # several nodes (local main processes); see spans_nodes()
        self._lock: RunLock | None = None
        self.last_saved_step: int | None = None
        self.last_stall_s: float | None = None
        self.resumed: ResumeInfo | None = None
        self.preempted = False
        self._reported_records = 0
        self._earlier_records: list[PersistRecord] = []  # of the persisters finish() closed
        # Cost accounting (see costs.py): the lineage's ledger goes into every manifest.
        self.ledger = RunLedger()
        self.slowdown = SlowdownMeter()
        self._created_at = time.time()  # a resume's downtime ends when this run's callback exists
        self._train_base_s = 0.0
        self._train_started_at: float | None = None
        self._last_step_at: float | None = None
        self._resume_recorded = False
        self.staleness = StalenessMonitor(self.store.url)  # see staleness.py; fed at each step boundary
        self.region_check: RegionCheck | None = None  # see region.py; the writer's, from start()

    # ----------------------------------------------------------- ranks
    @property
    def rank(self) -> int:
        return dist.get_rank() if distributed_ready() else 0

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0")) if distributed_ready() else 0

    @property
    def is_writer(self) -> bool:
        """The rank that writes single-file checkpoints and manifests."""
        return self.rank == 0

    @property
    def persister(self) -> Persister:
        if self._persister is None:
            self._persister = Persister(self.store, keep_last=self.config.keep_last)
        if not isinstance(self._persister, Persister):
            raise RuntimeError(
                "this run saves sharded checkpoints (save_sharded_state); it cannot mix in single-file ones"
            )
        return self._persister

    @property
    def sharded_persister(self) -> ShardedPersister:
        """The persister of sharded checkpoints; made on first use, on every rank at the same step (collective)."""
        if self._persister is None:
            self._persister = ShardedPersister(self.store, self.scratch_root, keep_last=self.config.keep_last)
        if not isinstance(self._persister, ShardedPersister):
            raise RuntimeError(
                "this run saves single-file checkpoints (save_state); it cannot mix in sharded ones"
            )
        return self._persister

    def spans_nodes(self) -> bool:
        """True when the run has more than one node (local main process); one all-gather, then cached.

        Collective on its first call: every rank calls it at the same point.
        """
        if self._spans_nodes is None:
            self._spans_nodes = sum(gather_from_ranks(self.local_rank == 0)) > 1
        return self._spans_nodes

    def barrier(self) -> None:
        if distributed_ready():
            dist.barrier()

    # ------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Install notice sources and start the interval clock; call once training is about to run."""
        # The interval counts training time, not the set-up before it (model build, a long pull).
        self.trigger.mark_checkpoint()
        self._start_training_clock(self.ledger.train_s)
        self._acquire_lock()
        self.watcher.clear()  # a notice acted on in an earlier fit() in this process is spent
        self.watcher.start()
        self.staleness.start()
        if self.is_writer and self.region_check is None and RegionCheck.enabled():
            self.region_check = RegionCheck(self.store.fs, self.store.root, self.store.url)
            self.region_check.start()  # a daemon thread: start-up does not wait for it

    def stop(self) -> None:
        """Stop the notice sources and release the run lock (an exception ends training)."""
        self.watcher.stop()
        self._release_lock()

    def _acquire_lock(self) -> None:
        """The writer takes the run lock of ``dirpath`` (see runlock.py); every rank raises if it is held."""
        refusal = None
        if self.is_writer and self._lock is None:
            lock = RunLock(self.store)
            try:
                lock.acquire()
                self._lock = lock
            except RunLockedError as err:
                refusal = str(err)
            except Exception as err:  # noqa: BLE001 - storage trouble is the persister's to report
                log.warning(
                    "spot_callbacks: could not take the run lock of %s, training without it: %s: %s",
                    self.store.url, type(err).__name__, err,
                )  # fmt: skip
        refusal = broadcast_object(refusal)
        if refusal is not None:
            raise RunLockedError(refusal)

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # -------------------------------------------------------- deciding
    def decide(self, step: int, extra_notice: Notice | None = None) -> Decision:
        """One decision for every rank at an optimizer-step boundary (collective when distributed).

        A notice seen by any rank is a preemption for all, with the earliest deadline any rank
        knows; an early hint (AWS rebalance recommendation) is a normal checkpoint now.
        """
        if extra_notice is not None:
            self.watcher.report(extra_notice)
        self._time_step()
        self._watch_persisting()
        local = self.trigger.due(step)
        notice = self.watcher.notice
        hint = self.watcher.take_hint()
        # One flag for both: the rare step that has either pays for one gather to tell them apart.
        interval, steps, alerted = agree(
            local == "interval", local == "steps", notice is not None or hint is not None
        )
        if alerted:
            notice, hint = _agree_on_alerts(notice, hint)
            if notice is not None:
                self.watcher.report(notice)  # a rank that saw nothing adopts it
                self._emergency_notice = notice
                return Decision("preemption", notice)
        if step == self.last_saved_step:
            return Decision(None)
        if hint is not None:
            log.warning("spot_callbacks: checkpointing step %d now (reason 'interval'): %s", step, hint)
            return Decision("interval")
        if interval:
            return Decision("interval")
        if steps:
            return Decision("steps")
        return Decision(None)

    # ---------------------------------------------------------- saving
    def save_state(
        self,
        step: int,
        epoch: int | None,
        state: Any,
        reason: str,
        extra: dict[str, Any] | None = None,
    ) -> float:
        """Snapshot ``state`` (the training loop pays only this) and persist it in the background.

        Only the writer rank stages and uploads; call it on every rank all the same. Returns the
        seconds the caller was blocked.
        """
        started = time.perf_counter()
        if self.is_writer:
            staged = self.staging.stage(state)
            stall_s = time.perf_counter() - started
            local_dir = self.scratch_root / step_dirname(step)
            metrics = {**self._account(reason, stall_s), "staged_bytes": staged.nbytes}

            def write(
                folder: Path, staged: Any = staged, metrics: dict[str, Any] = metrics
            ) -> dict[str, FileDigest]:
                write_started = time.perf_counter()
                digests = {STATE_FILE: write_state(staged, folder / STATE_FILE)}
                metrics["write_s"] = round(time.perf_counter() - write_started, 6)  # before the manifest
                return digests

            self.persister.submit(
                PersistJob(
                    step=step,
                    reason=reason,
                    framework=self.framework,
                    local_dir=local_dir,
                    epoch=epoch,
                    write=write,
                    on_written=staged.release,
                    metrics=metrics,
                    extra={
                        **(extra or {}),
                        "ledger": self.ledger.to_json(),
                        **self._preemption_extra(reason),
                    },
                    deadline=self._commit_deadline(reason),
                )
            )
        stall_s = time.perf_counter() - started
        self._after_save(step, stall_s)
        return stall_s

    def save_sharded_state(
        self,
        step: int,
        epoch: int | None,
        state: dict[str, Any],
        reason: str,
        meta: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> float:
        """Snapshot this rank's shards of ``state`` and persist them in the background, every rank in parallel.

        For state no rank holds whole (FSDP, DTensor): call it on every rank with the rank's
        sharded state dicts (``{"model": get_model_state_dict(model), "optim": ...}``); ``meta`` is
        the small non-tensor rest, written by rank 0 as ``meta.pt``. The checkpoint commits once
        every rank's files are durable (see sharded.py). Returns the seconds this rank was blocked.
        """
        started = time.perf_counter()
        persister = self.sharded_persister
        staged, nbytes = persister.stage(state)
        stall_s = time.perf_counter() - started
        metrics = {**self._account(reason, stall_s), "staged_bytes": nbytes} if self.is_writer else {}
        persister.submit(
            persister.job(
                step,
                reason,
                self.framework,
                staged,
                meta=meta,
                epoch=epoch,
                metrics=metrics,
                extra={**(extra or {}), "ledger": self.ledger.to_json(), **self._preemption_extra(reason)},
                deadline=self._commit_deadline(reason),
            )
        )
        stall_s = time.perf_counter() - started
        self._after_save(step, stall_s)
        return stall_s

    def save_folder(
        self,
        step: int,
        epoch: int | None,
        folder: Path,
        reason: str,
        stall_s: float = 0.0,
        owns_folder: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Persist a checkpoint folder the framework has already written (for example HF's ``checkpoint-N``).

        Call it on every rank: each rank may have written files into the folder (HF's
        ``rng_state_{rank}.pth``), so the writer submits only after every rank got here. On
        several nodes ``folder`` may be node-local: each node's local main process then uploads
        its copy's files and rank 0 commits once every node's are durable (see sharded.py).
        """
        self.barrier()
        if self.spans_nodes():
            persister = self.sharded_persister
            persister.submit(
                persister.folder_job(
                    step,
                    reason,
                    self.framework,
                    Path(folder),
                    lists_folder=self.local_rank == 0,
                    owns_folder=owns_folder,
                    epoch=epoch,
                    metrics=self._account(reason, stall_s) if self.is_writer else {},
                    extra={
                        **(extra or {}),
                        "ledger": self.ledger.to_json(),
                        **self._preemption_extra(reason),
                    },
                    deadline=self._commit_deadline(reason),
                )
            )
        elif self.is_writer:
            self.persister.submit(
                PersistJob(
                    step=step,
                    reason=reason,
                    framework=self.framework,
                    local_dir=Path(folder),
                    epoch=epoch,
                    owns_local_dir=owns_folder,
                    metrics=self._account(reason, stall_s),
                    extra={
                        **(extra or {}),
                        "ledger": self.ledger.to_json(),
                        **self._preemption_extra(reason),
                    },
                    deadline=self._commit_deadline(reason),
                )
            )
        self._after_save(step, stall_s)

    def _active_notice(self) -> Notice | None:
        if self.watcher.notice is None:  # cleared: training went on after the emergency
            return None
        return self._emergency_notice or self.watcher.notice

    def _commit_deadline(self, reason: str) -> float | None:
        notice = self._active_notice() if reason == "preemption" else None
        if notice is None or notice.deadline is None:
            return None
        return notice.deadline - EXIT_MARGIN_S

    def _preemption_extra(self, reason: str) -> dict[str, Any]:
        notice = self._active_notice() if reason == "preemption" else None
        if notice is None:
            return {}
        return {
            "preemption": {
                "source": notice.source,
                "detail": notice.detail,
                "received": _utc(notice.received_at),
                "deadline": _utc(notice.deadline) if notice.deadline is not None else None,
            }
        }

    def _after_save(self, step: int, stall_s: float) -> None:
        self.last_saved_step = step
        self.last_stall_s = stall_s
        self.slowdown.checkpoint_taken()
        self.trigger.observe_interruptions(self.ledger.interruptions, self.ledger.billed_s / 3600.0)
        self.trigger.mark_checkpoint(cost_s=stall_s + self.slowdown.per_checkpoint_s())
        self._last_step_at = time.perf_counter()  # the next step's time must not include this stall

    # ----------------------------------------------------------- costs
    def _account(self, reason: str, stall_s: float) -> dict[str, Any]:
        """Add a checkpoint to the ledger; return what its manifest's ``metrics`` record (see costs.py)."""
        slowdown_s = self.slowdown.per_checkpoint_s()
        train_s = self.train_seconds()
        self.ledger = self.ledger.add_checkpoint(reason, stall_s, train_s, slowdown_s)
        return {
            "stall_s": round(stall_s, 6),
            "slowdown_s": round(slowdown_s, 6),
            "train_s": round(train_s, 3),
            "taken_at": round(time.time(), 3),
            "interval_s": self.trigger.interval_s,
        }

    def _start_training_clock(self, train_s: float) -> None:
        self._train_base_s = train_s
        self._train_started_at = time.monotonic()
        self._last_step_at = None

    def train_seconds(self) -> float:
        """Seconds of training in this run's lineage: the checkpoint resumed from's, plus this run's so far."""
        if self._train_started_at is None:
            return self.ledger.train_s
        return self._train_base_s + time.monotonic() - self._train_started_at

    def _time_step(self) -> None:
        now = time.perf_counter()
        if self._last_step_at is not None:
            persisting = self._persister is not None and not self._persister.idle
            self.slowdown.observe_step(now - self._last_step_at, persisting)
        self._last_step_at = now

    def _continue_ledger(self, state: dict[str, Any]) -> None:
        """On a resume: continue the ledger of the checkpoint resumed from, with this resume in it."""
        resumed = self.resumed
        if resumed is not None and not self._resume_recorded:
            self._resume_recorded = True
            info = resumed.info
            load_s = time.perf_counter() - resumed.pulled_at
            self.ledger = ledger_after_resume(info, self._created_at, resumed.pull_s, load_s)
            record = self.ledger.recent_resumes[-1]
            self._start_training_clock(self.ledger.train_s)
            lost = format_seconds(record.lost_work_s)
            lost = lost if record.lost_work_measured else f"<= {lost} (estimated: no emergency checkpoint)"
            (log.info if self.is_writer else log.debug)(
                "spot_callbacks: resumed from step %d (%s): pull %s, load %s%s",
                info.step, info.reason, format_seconds(record.pull_s), format_seconds(record.load_s),
                f", lost work {lost}, downtime {format_seconds(record.downtime_s)}" if record.interrupted else "",
            )  # fmt: skip
        else:
            ledger = RunLedger.from_json(state.get("ledger"))
            if ledger is None:
                return
            self.ledger = ledger
            self._start_training_clock(finite_number(state.get("train_s")) or ledger.train_s)
        self.trigger.observe_interruptions(self.ledger.interruptions, self.ledger.billed_s / 3600.0)

    def cost_summary(self) -> str:
        """The run's checkpoint costs on one screen; the adapters log it at the end of training."""
        records = self._all_records()
        history = RunHistory(
            self.store.url,
            self.ledger,
            tuple(record.info for record in records),
            at_hand="committed by this run",
        )
        rows = history_rows(history, records=records)
        interval = format_seconds(self.trigger.interval_s) if self.trigger.interval_s else "off"
        if self.trigger.auto:
            rate, _ = self.trigger.interruption_rate()
            interval += f" (auto, for {rate:.3g} interruptions/h)"
        rows.append(("interval", interval))
        return f"spot_callbacks: checkpoint costs of {self.store.url}\n{format_rows(rows)}"

    def log_cost_summary(self) -> None:
        """Log :meth:`cost_summary` on rank 0."""
        if self.rank == 0:
            log.info("%s", self.cost_summary())

    def wait_for_commit(self, notice: Notice | None = None, timeout: float | None = None) -> bool:
        """Block until every submitted checkpoint committed (writer) and all ranks know it.

        In an emergency (a ``notice``, or the one agreed at the last :meth:`decide`) only the newest
        checkpoint is waited for, it goes ahead of older uploads (see
        :func:`~spot_callbacks.persist.plan_emergency`), and the wait ends before the deadline (less
        a margin to exit). Logs how long the emergency took and how much time was left. Once it has
        committed and training is to stop, the cloud is told (Azure). Returns False if the wait ran out.
        """
        notice = notice or self._active_notice()
        if notice is not None and notice.deadline is not None:
            left = notice.seconds_left() - EXIT_MARGIN_S
            timeout = left if timeout is None else min(timeout, left)
        timeout = None if timeout is None else max(timeout, 0.0)
        finished = True
        if self._persister is not None:  # the writer, or every rank when each persists its shards
            started = time.perf_counter()
            step = self.last_saved_step
            if notice is not None and step is not None:
                if notice.deadline is not None:
                    self._persister.expedite(step, notice.deadline - EXIT_MARGIN_S)
                finished = self._persister.wait_for_step(step, timeout=timeout)
                if self._emergency_committed != step and self.is_writer:  # said once, by one rank
                    _log_emergency(step, notice, finished, time.perf_counter() - started)
                if finished:
                    self._emergency_committed = step
            else:
                finished = self._persister.wait(timeout=timeout)
        self.barrier()
        if notice is not None:
            finished = bool(broadcast_object(finished))
            if finished and self.config.on_preemption == "stop":
                self.watcher.acknowledge()
        return finished

    # --------------------------------------------------------- failures
    def new_failures(self) -> list[PersistError]:
        if self._persister is None:
            return []
        return self._persister.new_failures()

    def persist_lag_s(self) -> float:
        """Seconds since the newest commit of this run (or since training started): ``spot/persist_lag_s``."""
        return self.staleness.lag_s()

    def _watch_persisting(self) -> None:
        """Writer only: the staleness alarm (staleness.py) and, once known, the in-region warning (region.py)."""
        if not self.is_writer:
            return
        persister, records, resumed = self._persister, self._all_records(), self.resumed
        self.staleness.observe(
            records,
            persister.failures if persister is not None else [],
            persister.in_flight_step if persister is not None else None,
            self.trigger.interval_s,
        )
        if self.region_check is not None:
            size = records[-1].bytes if records else resumed.info.size_bytes if resumed else None
            pulled = (resumed.info.size_bytes, resumed.pull_s) if resumed is not None else None
            self.region_check.warn_once(size, pulled)

    def _all_records(self) -> list[PersistRecord]:
        current = self._persister.records if self._persister is not None else []
        return [*self._earlier_records, *current]

    def new_records(self) -> list[PersistRecord]:
        """Commits not yet returned by this method, those made while :meth:`finish` waited included."""
        records = self._all_records()[self._reported_records :]
        self._reported_records += len(records)
        return records

    def finish(self, timeout: float | None = None) -> None:
        """Wait for every upload, stop the workers, release the run lock; raise the first persist failure, if any."""
        self.watcher.stop()
        failures: list[PersistError] = []
        if self._persister is not None:
            notice = self._active_notice()
            if timeout is None and notice is not None and notice.deadline is not None:
                timeout = max(notice.seconds_left() - EXIT_MARGIN_S, 0.0)
                step = self.last_saved_step
                if step is not None and self._persister.wait_for_step(step, timeout=0):
                    timeout = 0.0  # what still uploads is older than the committed emergency checkpoint
            if not self._persister.close(timeout=timeout) and notice is not None:
                log.warning("spot_callbacks: not waiting for older uploads still in flight at the preemption")
            failures = self._persister.failures
            self._earlier_records.extend(self._persister.records)
            self._persister = None  # a later fit() gets a fresh one
        self._release_lock()  # after the last upload: until then this run still writes
        self.barrier()
        if failures:
            raise failures[-1]

    # --------------------------------------------------------- resuming
    def pull_latest(self, dest: Callable[[int], Path] | None = None) -> Path | None:
        """Resolve the newest committed checkpoint, pull it once per node, return its local folder.

        Every rank gets the same answer (rank 0 decides); ``None`` when nothing is committed.
        ``dest(step)`` names the local folder (default: ``step-N`` in scratch); a folder that
        already holds exactly this checkpoint is not downloaded again.
        """
        started = time.perf_counter()

        def folder_for(step: int) -> Path:
            return Path(dest(step)) if dest is not None else self.scratch_root / step_dirname(step)

        info = self._pull_newest_valid(folder_for) if self.rank == 0 else None
        info = broadcast_object(info)
        say = log.info if self.is_writer else log.debug  # once per run, not once per rank
        if info is None:
            say("spot_callbacks: no committed checkpoint in %s; starting from scratch", self.store.url)
            return None
        local_dir = folder_for(info.step)
        if self.local_rank == 0 and self.rank != 0:  # the other nodes pull what rank 0 chose
            self.store.pull(info.step, local_dir)
        self.barrier()
        self.resumed = ResumeInfo(
            info, local_dir, time.perf_counter() - started, pulled_at=time.perf_counter()
        )
        # That step is committed already: a run resumed at its very end must not rewrite it.
        self.last_saved_step = info.step
        self._resume_recorded = False
        say(
            "spot_callbacks: resuming from %s (step %d, %s) pulled in %.1fs",
            info.url, info.step, info.reason, self.resumed.pull_s,
        )  # fmt: skip
        return local_dir

    def _pull_newest_valid(self, folder_for: Callable[[int], Path]) -> CheckpointInfo | None:
        """Pull the newest checkpoint that downloads intact; a damaged one is skipped for the previous."""
        candidate = self.store.latest()
        while candidate is not None:
            try:
                self.store.pull(candidate.step, folder_for(candidate.step))
                return candidate
            except (CorruptCheckpointError, ManifestError) as err:
                log.warning(
                    "spot_callbacks: skipping %s: %s; trying the previous checkpoint", candidate.url, err
                )
                older = [info for info in self.store.committed() if info.step < candidate.step]
                candidate = self.store.newest_valid(older)
        return None

    # ------------------------------------------------------------ state
    def state_dict(self, at_checkpoint: bool = False) -> dict[str, Any]:
        """The state to resume with. ``at_checkpoint``: it is stored in the checkpoint being taken
        now, so a run resumed from it starts its interval clock at zero (not one interval late)."""
        trigger = self.trigger.state_dict()
        if at_checkpoint:
            trigger["elapsed_s"] = 0.0
        return {
            "trigger": trigger,
            "ledger": self.ledger.to_json(),
            "train_s": round(self.train_seconds(), 3),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "trigger" in state:
            self.trigger.load_state_dict(state["trigger"])
        self._continue_ledger(state)


def _agree_on_alerts(notice: Notice | None, hint: str | None) -> tuple[Notice | None, str | None]:
    """Every rank's notice and hint -> the same answer on all: the notice with the earliest deadline."""
    if not distributed_ready():
        return notice, hint
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (notice, hint))
    notices = [n for n, _ in gathered if n is not None]
    hints = [h for _, h in gathered if h is not None]
    if not notices:
        return None, hints[0] if hints else None
    with_deadline = [n for n in notices if n.deadline is not None]
    chosen = min(with_deadline, key=lambda n: n.deadline) if with_deadline else notices[0]
    return chosen, None


def _log_emergency(step: int, notice: Notice, committed: bool, waited_s: float) -> None:
    since_notice_s = time.time() - notice.received_at
    left = notice.seconds_left()
    if committed:
        log.warning(
            "spot_callbacks: emergency checkpoint committed in %.1fs (step %d, %.1fs after the %s notice)%s",
            waited_s, step, since_notice_s, notice.source,
            f", {left:.1f}s left before the deadline" if left is not None else "",
        )  # fmt: skip
    else:
        log.error(
            "spot_callbacks: the emergency checkpoint of step %d did not commit before the deadline "
            "(%.1fs after the %s notice%s); the newest committed checkpoint stays the resume point",
            step, since_notice_s, notice.source, f", {left:.1f}s left" if left is not None else "",
        )  # fmt: skip


def _utc(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, tz=timezone.utc).isoformat()
