"""`SpotCheckpointCallback`: the Hugging Face Trainer adapter. It translates Trainer events into `SpotEngine` calls."""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Literal, Union

import transformers

from spot_callbacks._compat import transformers as compat
from spot_callbacks.config import SpotConfig
from spot_callbacks.engine import SpotEngine
from spot_callbacks.hf_saves import RequestedSaves, SaveRequest
from spot_callbacks.notices import PREEMPTED_EXIT_CODE, Notice
from spot_callbacks.store import CheckpointStore
from spot_callbacks.trigger.collectives import gather_from_ranks
from spot_callbacks.trigger.rules import AfterEmergency

log = logging.getLogger("spot_callbacks")

# Where on_init_end moves local checkpoint-N folders newer than the newest committed checkpoint,
# so that train(resume_from_checkpoint=True) cannot pick a half-written one (HF issues 35525, 35782).
UNCOMMITTED_PREFIX = ".spot-uncommitted-"


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
        self._saves = RequestedSaves()
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
        return compat.checkpoint_dir(self._args.output_dir, step)

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Materialise now, so that train(resume_from_checkpoint=True) finds it in output_dir too.
        self._args = args
        self._materialised = self.engine.pull_latest(self._checkpoint_dir)
        self._resolved_at_init = True
        if self._materialised is not None:
            self.engine.move_aside_uncommitted(
                compat.local_checkpoints(args.output_dir),
                lambda folder: folder.with_name(f"{UNCOMMITTED_PREFIX}{folder.name}"),
            )
        else:
            self.engine.barrier()

    # ------------------------------------------------------------- training
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._args = args
        self._materialised, self._resolved_at_init = None, False
        self._saves.clear()
        self.preempted = False
        if compat.jit_checkpoint_enabled(args) and "SIGTERM" in self.engine.watcher.sources:
            compat.bypass_jit_sigterm_handler(self.store.url)
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

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._saves.check_dropped(state.global_step, compat.save_strategy(args))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        action = self.engine.step_boundary(step)
        dropped = self._saves.take_dropped()
        request = None
        if action.emergency and not action.save:  # this step is saved already: only wait and stop
            self._after_emergency(control, action.notice)
        elif action.save:
            request = SaveRequest(step, action.reason, action.notice)
        elif dropped is not None:
            request = SaveRequest(step, dropped.reason, dropped.notice)
        elif step >= state.max_steps and (reason := self.engine.end_reason(step)) is not None:
            request = SaveRequest(step, reason)
        if request is not None:
            self._saves.ask(request)
            control.should_save = True
        if control.should_save:
            self._save_started_at = time.perf_counter()

    # Logging and evaluation run between on_step_end and the save: the stall starts after them.
    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any
    ) -> None:
        if self._save_started_at is not None:
            self._save_started_at = time.perf_counter()
        self._collect_persist_records()
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
        request = self._saves.saved(step)
        # The Trainer's own saves (save_strategy) are persisted too. With save_strategy="no" nothing
        # rotates checkpoint-N folders: the persister keeps only the newest committed one.
        reason = request.reason if request is not None else "steps"
        if self._persist(state, reason, stall_s, owns_folder=compat.save_strategy(args) == "no"):
            self._metrics["spot/stall_s"] = stall_s
            self._metrics["spot/persist_lag_s"] = self.engine.persist_lag_s()
        if request is not None and request.reason == "preemption":
            self._after_emergency(control, request.notice)

    def _persist(self, state: Any, reason: str, stall_s: float = 0.0, owns_folder: bool = False) -> bool:
        step = state.global_step
        return self.engine.save_folder(
            step, math.floor(state.epoch or 0), self._checkpoint_dir(step), reason, stall_s=stall_s,
            owns_folder=owns_folder, extra={"engine": self.engine.state_dict(at_checkpoint=True)},
        )  # fmt: skip

    def _after_emergency(self, control: Any, notice: Notice | None) -> None:
        if self.engine.finish_emergency(notice) is AfterEmergency.STOP:
            self.preempted = True
            control.should_training_stop = True

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._saves.check_dropped(state.global_step, compat.save_strategy(args)):
            # The epoch-end save point comes next, at the same step: ask there.
            self._saves.ask(self._saves.take_dropped())
            control.should_save = True
        elif control.should_save and not self.engine.needs_checkpoint(state.global_step):
            # save_strategy="epoch" on a step we just saved: the folder exists, do not rewrite it.
            control.should_save = False
        if control.should_save:
            self._save_started_at = time.perf_counter()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save_started_at = None
        self._saves.give_up()
        self._persist_jit_checkpoint(args, state)
        self.engine.finish()
        self._collect_persist_records()
        self.engine.log_cost_summary()

    def _collect_persist_records(self) -> None:
        for record in self.engine.new_records():
            self._metrics["spot/persist_s"] = record.persist_s
            self._metrics["spot/persist_MBps"] = record.mb_per_s

    def _persist_jit_checkpoint(self, args: Any, state: Any) -> None:
        # enable_jit_checkpoint without SIGTERM among our notice sources: the Trainer saved on SIGTERM
        # without calling on_save. Upload that checkpoint so it survives the machine.
        if not compat.jit_checkpoint_enabled(args) or "SIGTERM" in self.engine.watcher.sources:
            return
        step = state.global_step
        if step >= state.max_steps or not self.engine.needs_checkpoint(step):
            return
        folder = self._checkpoint_dir(step)
        # Every rank gets here together; with node-local output dirs each node sees its own copy,
        # and the checkpoint is whole only if every node's is (else one node would wait forever).
        if all(gather_from_ranks(compat.jit_checkpoint_complete(folder))):
            log.warning("spot_callbacks: persisting the Trainer's JIT checkpoint %s", folder)
            self._persist(state, "preemption")
            self.engine.wait_for_commit()
            self.preempted = True


__all__ = ["PREEMPTED_EXIT_CODE", "SpotCheckpointCallback"]
