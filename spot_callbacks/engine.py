"""`SpotEngine`: the shared core both adapters call; every checkpoint rule lives here.

An adapter translates framework hooks into these calls:

- :meth:`SpotEngine.start` / :meth:`SpotEngine.stop` around training (notice sources, workers);
- :meth:`SpotEngine.decide` at each optimizer-step boundary (one decision for all ranks);
- :meth:`SpotEngine.save_state` (a state to snapshot) or :meth:`SpotEngine.save_folder` (a folder
  the framework wrote) when a checkpoint is due;
- :meth:`SpotEngine.wait_for_commit` in an emergency, :meth:`SpotEngine.finish` at the end;
- :meth:`SpotEngine.pull_latest` before resuming.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from spot_callbacks.config import SpotConfig
from spot_callbacks.persist import Persister, PersistError, PersistJob, PersistRecord, default_scratch_root
from spot_callbacks.preemption import Notice, PreemptionWatcher, resolve_sources, signal_grace_s
from spot_callbacks.snapshot import StagingArea, write_state
from spot_callbacks.store import (
    CheckpointInfo,
    CheckpointStore,
    CorruptCheckpointError,
    ManifestError,
    step_dirname,
)
from spot_callbacks.trigger import CheckpointTrigger, agree, distributed_ready

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
        self.watcher = PreemptionWatcher(resolve_sources(config.preemption))
        self.staging = StagingArea()
        self._persister: Persister | None = None
        self.last_saved_step: int | None = None
        self.last_stall_s: float | None = None
        self.resumed: ResumeInfo | None = None
        self.preempted = False
        self._reported_records = 0

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
        return self._persister

    def barrier(self) -> None:
        if distributed_ready():
            dist.barrier()

    # ------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Install notice sources and start the interval clock; call once training is about to run."""
        # The interval counts training time, not the set-up before it (model build, a long pull).
        self.trigger.mark_checkpoint()
        self.watcher.start()

    def stop(self) -> None:
        self.watcher.stop()

    # -------------------------------------------------------- deciding
    def decide(self, step: int, extra_notice: Notice | None = None) -> Decision:
        """One decision for every rank at an optimizer-step boundary (collective when distributed)."""
        if extra_notice is not None:
            self.watcher.report(extra_notice)
        local = self.trigger.due(step)
        notice = self.watcher.notice
        interval, steps, noticed = agree(local == "interval", local == "steps", notice is not None)
        if noticed:
            # A notice seen only by another rank carries no deadline here: assume a signal's grace.
            return Decision(
                "preemption",
                notice or Notice("another rank", time.time() + signal_grace_s(), "seen by another rank"),
            )
        if step == self.last_saved_step:
            return Decision(None)
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
            self.persister.submit(
                PersistJob(
                    step=step,
                    reason=reason,
                    framework=self.framework,
                    local_dir=local_dir,
                    epoch=epoch,
                    write=lambda folder, staged=staged: {
                        STATE_FILE: write_state(staged, folder / STATE_FILE)
                    },
                    on_written=staged.release,
                    metrics={"stall_s": round(stall_s, 6), "staged_bytes": staged.nbytes},
                    extra=extra or {},
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
        ``rng_state_{rank}.pth``), so the writer submits only after every rank got here.
        """
        self.barrier()
        if self.is_writer:
            self.persister.submit(
                PersistJob(
                    step=step,
                    reason=reason,
                    framework=self.framework,
                    local_dir=Path(folder),
                    epoch=epoch,
                    owns_local_dir=owns_folder,
                    metrics={"stall_s": round(stall_s, 6)},
                    extra=extra or {},
                )
            )
        self._after_save(step, stall_s)

    def _after_save(self, step: int, stall_s: float) -> None:
        self.last_saved_step = step
        self.last_stall_s = stall_s
        self.trigger.mark_checkpoint(cost_s=stall_s)

    def wait_for_commit(self, notice: Notice | None = None, timeout: float | None = None) -> bool:
        """Block until every submitted checkpoint committed (writer) and all ranks know it.

        With a ``notice`` the wait ends before its deadline (less a margin to exit). Logs how much
        time was left at commit. Returns False if the wait ran out.
        """
        if notice is not None and notice.deadline is not None:
            left = notice.seconds_left() - EXIT_MARGIN_S
            timeout = left if timeout is None else min(timeout, left)
        finished = True
        if self.is_writer and self._persister is not None:
            started = time.perf_counter()
            finished = self._persister.wait(timeout=None if timeout is None else max(timeout, 0.0))
            waited = time.perf_counter() - started
            if notice is not None:
                left = notice.seconds_left()
                if finished:
                    log.warning(
                        "spot_callbacks: emergency checkpoint committed in %.1fs%s",
                        waited, f" with {left:.1f}s left before the deadline" if left is not None else "",
                    )  # fmt: skip
                else:
                    log.error("spot_callbacks: the emergency checkpoint did not commit before the deadline")
        self.barrier()
        return finished

    # --------------------------------------------------------- failures
    def new_failures(self) -> list[PersistError]:
        if self._persister is None:
            return []
        return self._persister.new_failures()

    def new_records(self) -> list[PersistRecord]:
        if self._persister is None:
            return []
        records = self._persister.records[self._reported_records :]
        self._reported_records += len(records)
        return records

    def finish(self, timeout: float | None = None) -> None:
        """Wait for every upload, stop the workers; raise the first persist failure, if any."""
        self.stop()
        failures: list[PersistError] = []
        if self._persister is not None:
            self._persister.close(timeout=timeout)
            failures = self._persister.failures
            self._persister = None  # a later fit() gets a fresh one
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
        info = _broadcast_object(info)
        if info is None:
            log.info("spot_callbacks: no committed checkpoint in %s; starting from scratch", self.store.url)
            return None
        local_dir = folder_for(info.step)
        if self.local_rank == 0 and self.rank != 0:  # the other nodes pull what rank 0 chose
            self.store.pull(info.step, local_dir)
        self.barrier()
        self.resumed = ResumeInfo(info, local_dir, time.perf_counter() - started)
        log.info(
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
                candidate = None
                for info in reversed(older):
                    try:
                        self.store.check_sizes(info)
                    except CorruptCheckpointError as size_error:
                        log.warning("spot_callbacks: skipping %s: %s", info.url, size_error)
                        continue
                    candidate = info
                    break
        return None

    # ------------------------------------------------------------ state
    def state_dict(self, at_checkpoint: bool = False) -> dict[str, Any]:
        """The state to resume with. ``at_checkpoint``: it is stored in the checkpoint being taken
        now, so a run resumed from it starts its interval clock at zero (not one interval late)."""
        trigger = self.trigger.state_dict()
        if at_checkpoint:
            trigger["elapsed_s"] = 0.0
        return {"trigger": trigger}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "trigger" in state:
            self.trigger.load_state_dict(state["trigger"])


def _broadcast_object(value: Any) -> Any:
    if not distributed_ready():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
