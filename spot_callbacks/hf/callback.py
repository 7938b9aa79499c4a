"""`SpotCheckpointCallback`: the Hugging Face Trainer adapter. It translates Trainer events into `SpotEngine` calls."""

from __future__ import annotations

import functools
import math
import os
import time
from pathlib import Path
from typing import Any, Literal, Union

import transformers

import spot_callbacks.hf._compat as compat
import spot_callbacks.hf.saves as hf_saves
import spot_callbacks.settings as settings
from spot_callbacks.config import SpotConfig, checked_arguments
from spot_callbacks.engine import SpotEngine
from spot_callbacks.hf.checkpoint import STAGED, TRAINER, StagedSaves
from spot_callbacks.hf.loadable import check_loadable
from spot_callbacks.hf.metrics import SpotMetrics
from spot_callbacks.hf.saves import SaveRequest
from spot_callbacks.log import log
from spot_callbacks.preemption import TERMINATION, Notice
from spot_callbacks.store import CheckpointStore
from spot_callbacks.training_horizon import (
    Horizon,
    learning_rate_change,
    limit_changes,
    warn_if_horizon_changed,
)
from spot_callbacks.trigger.rules import AfterEmergency, after_emergency

# Local checkpoint-N newer than the newest commit go here: resume_from_checkpoint=True must not pick one.
UNCOMMITTED_PREFIX = ".spot-uncommitted-"


class SpotCheckpointCallback(transformers.TrainerCallback):
    """Time-interval checkpoints for spot instances, uploaded in the background and committed atomically.

    A checkpoint costs the loop a RAM snapshot; a background writer makes the Trainer's own
    ``checkpoint-N`` from it (or the Trainer writes it: ``SPOT_HF_SAVE=trainer``, or where a snapshot
    cannot be exact), uploads it to ``dirpath`` and commits it. ``latest()`` brings the newest
    committed one back, on a fresh machine too. SIGTERM (and the configured notices) trigger an
    emergency checkpoint at the next step boundary; training then stops, ``preempted`` is True,
    and the launcher should exit with :data:`PREEMPTED_EXIT_CODE` (143) after ``train()`` returns.

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

    _spot_never_restored_from_checkpoints = True  # compat.NEVER_RESTORED_MARK: the user's object only

    @checked_arguments("SpotCheckpointCallback")
    def __init__(
        self,
        dirpath: str,
        interval: Union[float, str, None] = "30min",  # noqa: UP007 - HfArgumentParser/jsonargparse read these
        every_n_steps: Union[int, None] = None,  # noqa: UP007
        keep_last: int = 3,
        scratch_dir: Union[str, None] = None,  # noqa: UP007
        storage_options: Union[dict, str, None] = None,  # noqa: UP007
        preemption: Union[str, list[str]] = "auto",  # noqa: UP007
        on_preemption: Literal["stop", "continue"] = "stop",
        interruptions_per_hour: Union[float, None] = None,  # noqa: UP007
        verbose: bool = False,
    ) -> None:
        self.config = SpotConfig(
            dirpath=dirpath, interval=interval, every_n_steps=every_n_steps, keep_last=keep_last,
            scratch_dir=scratch_dir, storage_options=storage_options, preemption=preemption,
            on_preemption=on_preemption, interruptions_per_hour=interruptions_per_hour, verbose=verbose,
        )  # fmt: skip
        self.engine = SpotEngine(self.config, framework="hf")
        compat.never_rebuild_from_checkpoints()  # trainer_state.json is untrusted
        compat.release_runs_when_train_unwinds()  # an exception in any hook releases the run lock
        self.preempted = False
        self._args: Any = None
        self._materialised: Path | None = None  # pulled by on_init_end, valid until training starts
        self._resolved_at_init = False
        self._saves = hf_saves.RequestedSaves()
        self._staged = StagedSaves()
        self._save_started_at: float | None = None
        self._metrics = SpotMetrics()

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> SpotCheckpointCallback:
        """Build from a YAML file whose keys are the SpotConfig fields."""
        return cls(**SpotConfig.from_yaml(path).to_dict())

    @property
    def store(self) -> CheckpointStore:
        return self.engine.store

    def latest(self) -> str | None:
        """The local folder of the newest committed checkpoint, or ``None`` when nothing is committed.

        Pulled (and verified) into ``args.output_dir/checkpoint-N`` once the Trainer exists, else
        into scratch; a local folder that already holds exactly that checkpoint is reused. Pass it
        to ``train(resume_from_checkpoint=...)``. With several processes, call it on every rank.
        """
        if self._resolved_at_init and (self._materialised is None or self._materialised.is_dir()):
            return os.fspath(self._materialised) if self._materialised is not None else None
        dest = self._checkpoint_dir if self._args is not None else None
        local_dir = self.engine.pull_latest(dest, check=check_loadable)  # unloadable is damage: fall back
        return os.fspath(local_dir) if local_dir is not None else None

    def _checkpoint_dir(self, step: int) -> Path:
        return compat.checkpoint_dir(self._args.output_dir, step)

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Materialise now, so that train(resume_from_checkpoint=True) finds it in output_dir too.
        self._args = args
        compat.place_ahead_of_integrations(compat.running_trainer(), self)
        self._materialised = self.engine.pull_latest(self._checkpoint_dir, check=check_loadable)
        self._resolved_at_init = True
        self.engine.move_aside_uncommitted(  # only when resuming; a barrier on every rank
            compat.local_checkpoints(args.output_dir),
            lambda folder: folder.with_name(f"{UNCOMMITTED_PREFIX}{folder.name}"),
        )

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._args = args
        self._materialised, self._resolved_at_init = None, False
        self._saves.clear()
        self.preempted = False
        compat.check_trainer_spans_the_process_group(args)
        if compat.jit_checkpoint_enabled(args) and self.engine.watches(TERMINATION):
            compat.bypass_jit_sigterm_handler(self.store.url)
        self.engine.start()
        compat.place_ahead_of_integrations(trainer := compat.running_trainer(), self)
        warn_if_sharding_ignored(trainer, args)
        self._staged.start(trainer, args, self.engine.spans_nodes())
        self.engine.save_folders_from_every_rank(self._staged.every_rank)  # FSDP: every rank's shards
        self._metrics.attach(trainer)
        resumed = self.engine.resumed
        self._position = hf_saves.data_position(args, kwargs, resumed, state.global_step)
        if resumed is not None and state.global_step == resumed.info.step and state.global_step > 0:
            self.engine.load_state_dict(resumed.info.extra.get("engine", {}))
            self._warn_if_horizon_changed(args, state, resumed.info.extra, kwargs.get("lr_scheduler"))
            self._metrics.add({"spot/resume_s": resumed.pull_s})
            if self._staged.owns_folders and resumed.local_dir.parent == Path(args.output_dir):
                self.engine.adopt_local_copy(resumed.local_dir)  # cleaned up like the run's own

    def _warn_if_horizon_changed(
        self, args: Any, state: Any, checkpoint_extra: dict[str, Any], scheduler: Any
    ) -> None:
        # HF resumes a finished run with a larger max_steps itself; what changes is said once.
        step = state.global_step
        saved = Horizon.from_dict(checkpoint_extra.get("horizon"))  # None in older checkpoints
        changes = limit_changes(saved, compat.horizon(args), step, state.epoch or 0, "num_train_epochs")
        if (rates := compat.rebuilt_schedule_rates(scheduler)) is not None:
            changes += learning_rate_change(rates[0], rates[1], rates[2], step)
        warn_if_horizon_changed(step, changes)  # rank 0 says it for all

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The integrations' on_train_begin has run (it opens their writers): log what is pending.
        self._metrics.add_records(self.engine.new_records())
        self._metrics.flush()
        self._submit_staged(control)
        if self._saves.pending is not None:  # rare: the save strategy is only read for its warning
            self._saves.check_dropped(state.global_step, compat.save_strategy(args))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        action = self.engine.step_boundary(step)
        dropped = self._saves.take_dropped()
        request = None
        if action.emergency and not action.save:  # this step is saved already: only wait and stop
            self._after_emergency(control, action.notice)
        elif (asked := action if action.save else dropped) is not None:
            assert asked.reason is not None  # a save always carries its reason
            request = SaveRequest(step, asked.reason, asked.notice)
        elif step >= state.max_steps and (reason := self.engine.end_reason(step)) is not None:
            request = SaveRequest(step, reason)
        if request is not None and self._staged.applies(control.should_save, control.should_evaluate):
            self._staged.stage(request, math.floor(state.epoch or 0), self.engine.staging)
            self._save_started_at = time.perf_counter()  # the stall if the Trainer saves it after all
            stops = after_emergency(self.config.on_preemption, request.notice) is AfterEmergency.STOP
            control.should_training_stop |= request.reason == "preemption" and stops  # (waited at submit)
        elif request is not None:
            self._saves.ask(request)
            control.should_save = True
        else:  # the optimizer state exists now: the staging buffers (and persister) are made off the loop
            self._staged.prepare(self.engine)
        if control.should_save:
            self._save_started_at = time.perf_counter()

    # Logging and evaluation run between on_step_end and the save: the stall starts after them.
    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any
    ) -> None:
        if self._metrics.logging:  # our own row
            return
        self._save_started_at = time.perf_counter() if self._save_started_at is not None else None
        self._metrics.merge_into(logs, state)
        if not (control.should_evaluate or control.should_save):  # else on_evaluate / on_save decide
            self._submit_staged(control)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save_started_at = time.perf_counter() if self._save_started_at is not None else None
        if (dropped := self._staged.drop()) is not None:  # it ran after the snapshot: the Trainer saves
            self._saves.ask(dropped.request)
            control.should_save = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        stall_s = time.perf_counter() - self._save_started_at if self._save_started_at is not None else 0.0
        self._save_started_at = None
        request = self._saves.saved(state.global_step)  # None: one of the Trainer's own saves, persisted too
        if request is None and (dropped := self._staged.drop(state.global_step)) is not None:  # a callback's
            request, stall_s = dropped.request, stall_s + dropped.blocked_s
        reason = request.reason if request is not None else "steps"
        persisted = self._persist(state, reason, stall_s, owns_folder=self._staged.owns_folders)
        self._after_checkpoint(control, request, stall_s if persisted else None)

    def _submit_staged(self, control: Any) -> None:
        if self._staged.pending is not None:
            self._save_started_at = None
            with self.engine.writers_woken_at_end():  # the metrics row logged before the writer's Python
                request, stall_s = self._staged.submit(self.engine, self._extra(STAGED))
                self._log_checkpoint(stall_s)
            self._stop_if_emergency(control, request)

    def _extra(self, save_path: str) -> dict[str, Any]:
        state = self.engine.state_dict(at_checkpoint=True)
        return {
            "engine": state,
            "hf_save": save_path,
            "data_position": getattr(self, "_position", None),
            "horizon": compat.horizon(self._args).to_dict(),
        }

    def _after_checkpoint(self, control: Any, request: SaveRequest | None, stall_s: float | None) -> None:
        self._log_checkpoint(stall_s)
        self._stop_if_emergency(control, request)

    def _stop_if_emergency(self, control: Any, request: SaveRequest | None) -> None:
        if request is not None and request.reason == "preemption":
            self._after_emergency(control, request.notice)

    def _log_checkpoint(self, stall_s: float | None) -> None:
        if stall_s is not None:  # persisted
            self._metrics.add({"spot/stall_s": stall_s, "spot/persist_lag_s": self.engine.persist_lag_s()})
            self._metrics.flush()

    def _persist(self, state: Any, reason: str, stall_s: float = 0.0, owns_folder: bool = False) -> bool:
        step, epoch = state.global_step, math.floor(state.epoch or 0)
        folder = self._checkpoint_dir(step)
        return self.engine.save_folder(
            step, epoch, folder, reason, stall_s, owns_folder, self._extra(TRAINER)
        )

    def _after_emergency(self, control: Any, notice: Notice | None) -> None:
        if self.engine.finish_emergency(notice) is AfterEmergency.STOP:
            self.preempted = True
            control.should_training_stop = True

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._submit_staged(control)
        if self._saves.check_dropped(state.global_step, compat.save_strategy(args)):
            # The epoch-end save point comes next, at the same step: ask there.
            dropped = self._saves.take_dropped()
            assert dropped is not None  # check_dropped() just kept it
            self._saves.ask(dropped)
            control.should_save = True
        elif control.should_save and not self.engine.needs_checkpoint(state.global_step):
            # save_strategy="epoch" on a step we just saved: the folder exists, do not rewrite it.
            control.should_save = False
        if control.should_save:
            self._save_started_at = time.perf_counter()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._submit_staged(control)
        self._save_started_at = None
        self._saves.give_up()
        jit = functools.partial(self._persist, state, "preemption")
        self.preempted |= hf_saves.persist_jit_checkpoint(self.engine, args, state, jit)
        self.preempted |= hf_saves.finish_after_last_commit(self.engine)
        self._metrics.add_records(self.engine.new_records())
        self._metrics.flush()  # ahead of the integrations' on_train_end: their writers are still open
        self.engine.log_cost_summary()


def warn_if_sharding_ignored(trainer: Any, args: Any) -> str | None:
    """Warn (rank 0, before the first step) when the TrainingArguments ask for FSDP or DeepSpeed and
    accelerate did not enable it, so the run trains unsharded: say why and what is checkpointed
    instead. Returns the warning, or ``None`` when what was asked is what runs."""
    if trainer is None:
        return None
    asked = [
        name
        for name, wanted, enabled in (
            ("FSDP", bool(getattr(args, "fsdp", None)), getattr(trainer, "is_fsdp_enabled", False)),
            (
                "DeepSpeed",
                bool(getattr(args, "deepspeed", None)),
                getattr(trainer, "is_deepspeed_enabled", False),
            ),
        )
        if wanted and not enabled
    ]
    if not asked:
        return None
    import torch.distributed as dist

    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    device = str(getattr(args, "device", "cpu"))
    why = [f"device {device}"] if not device.startswith("cuda") else []
    if world_size == 1 and settings.environment_variable("WORLD_SIZE") is None:
        why.append("no distributed launcher (torchrun / accelerate launch)")
    how = f"DDP across {world_size} processes" if world_size > 1 else "in one process"
    line = (
        f"spot_callbacks: TrainingArguments ask for {' and '.join(asked)} but accelerate did not enable it "
        f"({', '.join(why) or 'see accelerate env'}): the Trainer trains {how}, unsharded, and each checkpoint "
        "holds that full state (no shards); launch with torchrun or accelerate launch on GPUs to shard"
    )
    if getattr(args, "process_index", 0) == 0:
        log.warning("%s", line)
    return line


__all__ = ["SpotCheckpointCallback"]
