"""`SpotCheckpointCallback`: the Hugging Face Trainer adapter. It translates Trainer events into `SpotEngine` calls."""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from spot_callbacks.config import SpotConfig
from spot_callbacks.engine import SpotEngine
from spot_callbacks.notices import PREEMPTED_EXIT_CODE, Notice
from spot_callbacks.store import CheckpointStore
from spot_callbacks.trigger.collectives import gather_from_ranks

log = logging.getLogger("spot_callbacks")

# Where on_init_end moves local checkpoint-N folders newer than the newest committed checkpoint,
# so that train(resume_from_checkpoint=True) cannot pick a half-written one (HF issues 35525, 35782).
UNCOMMITTED_PREFIX = ".spot-uncommitted-"
JIT_INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"


@dataclass(frozen=True)
class _SaveRequest:
    step: int
    reason: str
    notice: Notice | None = None


class SpotCheckpointCallback(transformers.TrainerCallback):
    """Time-interval checkpoints for spot instances, uploaded in the background and committed atomically.

    The Trainer writes ``checkpoint-N`` into ``output_dir`` as usual (the callback only tells it
    when); the callback uploads that folder to ``dirpath`` off the training loop and commits it
    with a manifest written last. ``latest()`` brings the newest committed checkpoint back, on a
    fresh machine included. SIGTERM (and the configured notices) trigger an emergency checkpoint at
    the next step boundary; training then stops, ``preempted`` is True, and the launcher should
    exit with :data:`PREEMPTED_EXIT_CODE` (143) after ``train()`` returns. The Trainer offers no way
    to end the process earlier that still runs its own shutdown, so that choice is left to the script.

    Args: the fields of :class:`spot_callbacks.SpotConfig` (see its docstring).

    Raises:
        ConfigError: a bad argument; the message names it and the accepted values.
        PersistError: at the end of ``train()``, if a checkpoint could not be made durable.

    Example:
        >>> import tempfile
        >>> ckpt = SpotCheckpointCallback(dirpath=tempfile.mkdtemp(), interval="1h", preemption=[])
        >>> ckpt.latest() is None  # nothing committed yet: train from scratch
        True

        With a Trainer::

            ckpt = SpotCheckpointCallback(dirpath="gs://bucket/runs/exp1", interval="1h")
            trainer = transformers.Trainer(model=model, args=args, train_dataset=ds, callbacks=[ckpt])
            trainer.train(resume_from_checkpoint=ckpt.latest())
            sys.exit(PREEMPTED_EXIT_CODE if ckpt.preempted else 0)
    """

    def __init__(
        self,
        dirpath: str,
        interval: Union[float, str, None] = "30min",  # noqa: UP007 - HfArgumentParser/jsonargparse read these
        every_n_steps: Union[int, None] = None,  # noqa: UP007
        keep_last: int = 3,
        scratch_dir: Union[str, None] = None,  # noqa: UP007
        storage_options: Union[dict, None] = None,  # noqa: UP007
        preemption: Union[str, list[str]] = "auto",  # noqa: UP007
        on_preemption: Literal["stop", "continue"] = "stop",
        interruptions_per_hour: Union[float, None] = None,  # noqa: UP007
    ) -> None:
        self.config = SpotConfig(
            dirpath=dirpath, interval=interval, every_n_steps=every_n_steps, keep_last=keep_last,
            scratch_dir=scratch_dir, storage_options=storage_options, preemption=preemption,
            on_preemption=on_preemption, interruptions_per_hour=interruptions_per_hour,
        )  # fmt: skip
        self.engine = SpotEngine(self.config, framework="hf")
        self.preempted = False
        self._args: Any = None
        self._materialised: Path | None = None  # pulled by on_init_end, valid until training starts
        self._resolved_at_init = False
        self._request: _SaveRequest | None = None  # a save asked of the Trainer, not yet seen in on_save
        self._carry: _SaveRequest | None = None  # a requested save the Trainer dropped: ask again
        self._save_started_at: float | None = None
        self._metrics: dict[str, float] = {}

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> SpotCheckpointCallback:
        """Build from a YAML file whose keys are the SpotConfig fields."""
        return cls(**SpotConfig.from_yaml(path).to_dict())

    @property
    def store(self) -> CheckpointStore:
        return self.engine.store

    # ------------------------------------------------------------ resuming
    def latest(self) -> str | None:
        """The local folder of the newest committed checkpoint, or ``None`` when nothing is committed.

        Pulled (and verified) into ``args.output_dir/checkpoint-N`` once the Trainer exists, else
        into scratch; a local folder that already holds exactly that checkpoint is reused. Pass it
        to ``train(resume_from_checkpoint=...)``. With several processes, call it on every rank.
        """
        if self._resolved_at_init and (self._materialised is None or self._materialised.is_dir()):
            return os.fspath(self._materialised) if self._materialised is not None else None
        local_dir = self.engine.pull_latest(self._checkpoint_dir if self._args is not None else None)
        return os.fspath(local_dir) if local_dir is not None else None

    def _checkpoint_dir(self, step: int) -> Path:
        return Path(self._args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Materialise now, so that train(resume_from_checkpoint=True) finds it in output_dir too.
        self._args = args
        self._materialised = self.engine.pull_latest(self._checkpoint_dir)
        self._resolved_at_init = True
        if self._materialised is not None and self.engine.local_rank == 0:
            self._move_aside_uncommitted(Path(args.output_dir), self.engine.resumed.info.step)
        self.engine.barrier()

    def _move_aside_uncommitted(self, output_dir: Path, committed_step: int) -> None:
        for folder in sorted(output_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*")):
            suffix = folder.name[len(PREFIX_CHECKPOINT_DIR) + 1 :]
            if folder.is_dir() and suffix.isdigit() and int(suffix) > committed_step:
                target = output_dir / f"{UNCOMMITTED_PREFIX}{folder.name}"
                if target.exists():
                    target = output_dir / f"{UNCOMMITTED_PREFIX}{folder.name}-{time.time_ns()}"
                folder.rename(target)
                log.warning(
                    "spot_callbacks: %s is newer than the newest committed checkpoint (step %d) and was never "
                    "committed (it may be incomplete); moved it to %s so it cannot be resumed from",
                    folder, committed_step, target,
                )  # fmt: skip

    # ------------------------------------------------------------- training
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._args = args
        self._materialised, self._resolved_at_init = None, False
        self._request = self._carry = None
        self.preempted = False
        self._bypass_jit_sigterm(args)
        self.engine.start()
        resumed = self.engine.resumed
        if resumed is not None and state.global_step == resumed.info.step and state.global_step > 0:
            self.engine.load_state_dict(resumed.info.extra.get("engine", {}))
            self._metrics["spot/resume_s"] = resumed.pull_s
        if args.save_only_model:
            log.warning(
                "spot_callbacks: save_only_model=True: checkpoints hold no optimizer, scheduler or RNG state, "
                "so a resume from them is not exact"
            )

    def _bypass_jit_sigterm(self, args: Any) -> None:
        # enable_jit_checkpoint installs a SIGTERM handler that saves locally, without rank agreement,
        # ~3 s later. When we watch SIGTERM too, our handler must not chain to it, or the same step is
        # saved twice; ours runs the same Trainer save, persisted and agreed by every rank.
        if not getattr(args, "enable_jit_checkpoint", False) or "SIGTERM" not in self.engine.watcher.sources:
            return
        try:
            from transformers.trainer_jit_checkpoint import CheckpointManager
        except ImportError:  # a transformers without enable_jit_checkpoint
            return
        manager = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
        if isinstance(manager, CheckpointManager):
            original = getattr(manager, "_original_sigterm_handler", None)
            signal.signal(signal.SIGTERM, original if original is not None else signal.SIG_DFL)
            log.info(
                "spot_callbacks: enable_jit_checkpoint is on; SpotCheckpointCallback handles SIGTERM "
                "(one save, persisted to %s) and the Trainer's JIT handler stays idle",
                self.store.url,
            )

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._check_dropped(args, state)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for failure in self.engine.new_failures():
            log.error("spot_callbacks: %s; training continues, the last committed checkpoint stands", failure)
        step = state.global_step
        decision = self.engine.decide(step)
        carry, self._carry = self._carry, None
        request = None
        if decision.reason == "preemption":
            if self.engine.last_saved_step == step:  # this step is saved already: only wait and stop
                self._after_emergency(control, decision.notice)
            else:
                request = _SaveRequest(step, "preemption", decision.notice)
        elif decision.save:
            request = _SaveRequest(step, decision.reason)
        elif carry is not None:
            request = _SaveRequest(step, carry.reason, carry.notice)
        elif step >= state.max_steps and self.engine.last_saved_step != step:
            request = _SaveRequest(step, "end")
        if request is not None:
            self._request = request
            control.should_save = True
        if control.should_save:
            self._save_started_at = time.perf_counter()

    # Logging and evaluation run between on_step_end and the save: the stall starts after them.
    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any
    ) -> None:
        if self._save_started_at is not None:
            self._save_started_at = time.perf_counter()
        for record in self.engine.new_records():
            self._metrics["spot/persist_s"] = record.persist_s
            self._metrics["spot/persist_MBps"] = record.mb_per_s
        if logs is None or not self._metrics:
            return
        # Report_to integrations run before user callbacks and have already sent `logs`; the
        # progress printer and state.log_history (trainer_state.json) still see these values.
        logs.update(self._metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(self._metrics)
        self._metrics = {}

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._save_started_at is not None:
            self._save_started_at = time.perf_counter()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        stall_s = time.perf_counter() - self._save_started_at if self._save_started_at is not None else 0.0
        self._save_started_at = None
        request, self._request = self._request, None
        if request is not None and request.step != step:
            request = None
        if self.engine.last_saved_step == step:
            log.info("spot_callbacks: step %d is already checkpointed; not uploading it again", step)
        else:
            # The Trainer's own saves (save_strategy) are persisted too.
            reason = request.reason if request is not None else "steps"
            folder = self._checkpoint_dir(step)
            self.engine.save_folder(
                step,
                math.floor(state.epoch or 0),
                folder,
                reason,
                stall_s=stall_s,
                # With save_strategy="no" nothing rotates checkpoint-N folders: the persister keeps
                # only the newest committed one (with its manifest, so a restart skips the download).
                owns_folder=_save_strategy(args) == "no",
                extra={"engine": self.engine.state_dict(at_checkpoint=True)},
            )
            self._metrics["spot/stall_s"] = stall_s
            self._metrics["spot/persist_lag_s"] = self.engine.persist_lag_s()
        if request is not None and request.reason == "preemption":
            self._after_emergency(control, request.notice)

    def _after_emergency(self, control: Any, notice: Notice | None) -> None:
        self.engine.wait_for_commit(notice)
        if self.config.on_preemption == "stop":
            self.preempted = True
            control.should_training_stop = True
        else:
            self.engine.watcher.clear()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._check_dropped(args, state):
            # The epoch-end save point comes next, at the same step: ask there.
            self._request, self._carry = self._carry, None
            control.should_save = True
        elif control.should_save and self.engine.last_saved_step == state.global_step:
            # save_strategy="epoch" on a step we just saved: the folder exists, do not rewrite it.
            control.should_save = False
        if control.should_save:
            self._save_started_at = time.perf_counter()

    def _check_dropped(self, args: Any, state: Any) -> bool:
        """A save we asked for that never reached on_save: save_strategy="best" overwrites should_save."""
        request, self._request = self._request, None
        if request is None:
            return False
        log.warning(
            "spot_callbacks: the checkpoint requested at step %d (%s) was not saved by the Trainer "
            "(save_strategy=%r replaces the request when the evaluation finds no new best metric); "
            "saving at the next save point instead",
            request.step, request.reason, _save_strategy(args),
        )  # fmt: skip
        self._carry = _SaveRequest(state.global_step, request.reason, request.notice)
        return True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save_started_at = None
        if self._request is not None:
            log.warning(
                "spot_callbacks: the checkpoint requested at step %d (%s) was not saved by the Trainer; "
                "the newest committed checkpoint is the resume point", self._request.step, self._request.reason,
            )  # fmt: skip
            self._request = self._carry = None
        self._persist_jit_checkpoint(args, state)
        self.engine.finish()
        for record in self.engine.new_records():
            self._metrics["spot/persist_s"] = record.persist_s
            self._metrics["spot/persist_MBps"] = record.mb_per_s
        self.engine.log_cost_summary()

    def _persist_jit_checkpoint(self, args: Any, state: Any) -> None:
        # enable_jit_checkpoint without SIGTERM among our notice sources: the Trainer saved on SIGTERM
        # without calling on_save. Upload that checkpoint so it survives the machine.
        if not getattr(args, "enable_jit_checkpoint", False) or "SIGTERM" in self.engine.watcher.sources:
            return
        step = state.global_step
        folder = self._checkpoint_dir(step)
        if step >= state.max_steps or self.engine.last_saved_step == step:
            return
        # Every rank gets here together; with node-local output dirs each node sees its own copy,
        # and the checkpoint is whole only if every node's is (else one node would wait forever).
        if all(gather_from_ranks(folder.is_dir() and not (folder / JIT_INCOMPLETE_MARKER).exists())):
            log.warning("spot_callbacks: persisting the Trainer's JIT checkpoint %s", folder)
            self.engine.save_folder(
                step, math.floor(state.epoch or 0), folder, "preemption",
                extra={"engine": self.engine.state_dict(at_checkpoint=True)},
            )  # fmt: skip
            self.engine.wait_for_commit()
            self.preempted = True


def _save_strategy(args: Any) -> str:
    strategy = getattr(args, "save_strategy", "no")
    return str(getattr(strategy, "value", strategy))


__all__ = ["PREEMPTED_EXIT_CODE", "SpotCheckpointCallback"]
