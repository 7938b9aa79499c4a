"""`SpotCheckpoint`: the Lightning adapter. It translates Lightning hooks into `SpotEngine` calls."""

from __future__ import annotations

import logging
import os
import time
import types
import warnings
from typing import Any, Literal, Union

import torch.distributed as dist

from spot_callbacks._compat import lightning as compat
from spot_callbacks.config import SpotConfig
from spot_callbacks.engine import STATE_FILE, SpotEngine
from spot_callbacks.errors import CheckpointError
from spot_callbacks.notices import PREEMPTED_EXIT_CODE, Notice, signal_grace_s
from spot_callbacks.staging import capture_rng_state, restore_rng_state
from spot_callbacks.store.layout import DCP_METADATA_FILE
from spot_callbacks.trigger.collectives import distributed_ready, gather_from_ranks

log = logging.getLogger("spot_callbacks")

STATE_FORMAT = 1


def _mine(per_rank: list[Any]) -> Any:
    rank = dist.get_rank() if distributed_ready() else 0
    if len(per_rank) != (dist.get_world_size() if distributed_ready() else 1):
        log.warning(
            "spot_callbacks: the checkpoint was written by %d processes and this run has %d; "
            "RNG streams are reused round-robin, so the resume is not bit-identical",
            len(per_rank), dist.get_world_size() if distributed_ready() else 1,
        )  # fmt: skip
    return per_rank[rank % len(per_rank)]


def build_spot_checkpoint(pl: types.ModuleType) -> type:
    """The SpotCheckpoint class for a Lightning package (``lightning.pytorch`` or ``pytorch_lightning``)."""
    from_pkg = __import__(
        f"{pl.__name__}.trainer.connectors.checkpoint_connector", fromlist=["_CheckpointConnector"]
    )
    exceptions = __import__(f"{pl.__name__}.utilities.exceptions", fromlist=["SIGTERMException"])
    states = __import__(f"{pl.__name__}.trainer.states", fromlist=["TrainerFn"])
    SIGTERMException = exceptions.SIGTERMException  # noqa: N806

    class SpotCheckpoint(pl.callbacks.Checkpoint):
        """Time-interval checkpoints for spot instances, persisted in the background and committed atomically.

        Add it to the Trainer and resume with ``fit(ckpt_path="latest")``: a fresh machine with an
        empty disk pulls the newest committed checkpoint of ``dirpath`` and continues exactly
        where it stopped (mid-epoch included). SIGTERM (and the configured notices) trigger an
        emergency checkpoint; the process then exits with code 143. A ``Checkpoint`` subclass: it
        replaces Lightning's default ``ModelCheckpoint`` unless you add one yourself.

        Args: the fields of :class:`spot_callbacks.SpotConfig` (see its docstring).

        Raises:
            ConfigError: a bad argument; the message names it and the accepted values.
            PersistError: at the end of ``fit``, if a checkpoint could not be made durable.

        Example:
            >>> import tempfile
            >>> import lightning.pytorch as pl
            >>> from lightning.pytorch.demos.boring_classes import BoringModel
            >>> ckpt = SpotCheckpoint(dirpath=tempfile.mkdtemp(), interval="30min", preemption=[])
            >>> trainer = pl.Trainer(callbacks=[ckpt], max_steps=4, logger=False, enable_progress_bar=False,
            ...                      enable_model_summary=False)
            >>> trainer.fit(BoringModel(), ckpt_path="latest")
            >>> ckpt.store.latest().step, ckpt.store.latest().reason
            (4, 'end')
        """

        _spot_checkpoint = True

        def __init__(
            self,
            dirpath: str,
            interval: Union[float, str, None] = "30min",  # noqa: UP007 - jsonargparse reads these hints
            every_n_steps: Union[int, None] = None,  # noqa: UP007
            keep_last: int = 3,
            scratch_dir: Union[str, None] = None,  # noqa: UP007
            storage_options: Union[dict, None] = None,  # noqa: UP007
            preemption: Union[str, list[str]] = "auto",  # noqa: UP007
            on_preemption: Literal["stop", "continue"] = "stop",
            interruptions_per_hour: Union[float, None] = None,  # noqa: UP007
        ) -> None:
            super().__init__()
            self.config = SpotConfig(
                dirpath=dirpath, interval=interval, every_n_steps=every_n_steps, keep_last=keep_last,
                scratch_dir=scratch_dir, storage_options=storage_options, preemption=preemption,
                on_preemption=on_preemption, interruptions_per_hour=interruptions_per_hour,
            )  # fmt: skip
            self.engine = SpotEngine(self.config, framework="lightning")
            self.preempted = False
            self._trainer: Any = None
            self._epoch_start_rng: dict[str, Any] | None = None
            self._epoch_iterator_exists = False
            self._batches_done_in_epoch = 0
            self._resume_state: dict[str, Any] | None = None
            self._saving = False

        @classmethod
        def from_yaml(cls, path: str | os.PathLike[str]) -> SpotCheckpoint:
            """Build from a YAML file whose keys are the SpotConfig fields."""
            return cls(**SpotConfig.from_yaml(path).to_dict())

        @property
        def store(self):  # noqa: ANN201 - CheckpointStore
            return self.engine.store

        @property
        def state_key(self) -> str:
            # Not keyed by dirpath: a run whose checkpoints were copied to another bucket (or that
            # moved from file:// to s3://) must still find its position, clock and ledger.
            return self._generate_state_key()

        # ---------------------------------------------------------- setup
        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if stage != "fit":
                return
            self._trainer = trainer
            compat.install_latest_resolution(trainer, self._resolve_latest)
            self.engine.start()

        def _resolve_latest(self) -> str | None:
            local_dir = self.engine.pull_latest()
            if local_dir is None:
                return None
            # We put plain loaders back at their mid-epoch position ourselves (on_train_start).
            warnings.filterwarnings(
                "ignore", message="You're resuming from a checkpoint that ended before the epoch"
            )
            if (local_dir / DCP_METADATA_FILE).is_file():  # sharded: the strategy loads it through DCP
                if not compat.saves_sharded(self._trainer):
                    raise CheckpointError(
                        f"{self.engine.resumed.info.url} is a sharded (FSDP) checkpoint and "
                        f"{type(self._trainer.strategy).__name__} cannot load it; resume with "
                        "ModelParallelStrategy or FSDPStrategy(state_dict_type='sharded'), which reshard "
                        "it onto any number of processes"
                    )
                return os.fspath(local_dir)
            return os.fspath(local_dir / STATE_FILE)

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            # The first epoch's iterator is made in FitLoop.setup_data, after this hook.
            self._epoch_start_rng = capture_rng_state()

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            # Lightning's SIGTERM handler (installed just before this hook) runs a broadcast inside
            # the handler, which deadlocks DDP when the signal reaches a rank other than 0. Ours
            # only records the notice; all ranks then agree at the next step boundary.
            self.engine.watcher.reassert()
            self._epoch_iterator_exists = True
            if self._resume_state is not None:
                self._restore_position(trainer, self._resume_state)
                self._resume_state = None
                self._log(trainer, self._resume_metrics())

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            if not self._epoch_iterator_exists:  # later epochs: the iterator is made after this hook
                self._epoch_start_rng = capture_rng_state()
            self._epoch_iterator_exists = False
            self._batches_done_in_epoch = 0

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            self._epoch_iterator_exists = False

        # ------------------------------------------------------ stepping
        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            self._batches_done_in_epoch = batch_idx + 1
            at_step_boundary = (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or (
                batch_idx + 1 == trainer.num_training_batches
            )
            if not at_step_boundary:
                return
            for failure in self.engine.new_failures():
                log.error(
                    "spot_callbacks: %s; training continues, the last committed checkpoint stands", failure
                )
            self._step_boundary(trainer)

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            # A notice that arrives during validation inside an epoch is handled before Lightning
            # raises SIGTERMException at the end of the batch.
            fitting = trainer.state.fn == states.TrainerFn.FITTING and not trainer.sanity_checking
            if fitting and (trainer.received_sigterm or self.engine.watcher.notice is not None):
                self._step_boundary(trainer)

        def _step_boundary(self, trainer: Any) -> None:
            step = trainer.global_step
            notice = None
            if getattr(trainer, "received_sigterm", False) and self.engine.watcher.notice is None:
                notice = Notice("SIGTERM", time.time() + signal_grace_s(), "Lightning signal connector")
            decision = self.engine.decide(step, notice)
            if decision.reason == "preemption":
                self._emergency(trainer, decision.notice)
            elif decision.save:
                self._save(trainer, decision.reason)

        def _save(self, trainer: Any, reason: str) -> None:
            step, epoch = trainer.global_step, trainer.current_epoch
            self._saving = True
            try:
                if compat.saves_sharded(trainer):  # FSDP: every rank persists its own shards
                    sharded, meta = compat.dump_sharded_checkpoint(trainer)
                    self._saving = False
                    self.engine.save_sharded_state(step, epoch, sharded, reason, meta=meta)
                else:
                    checkpoint = compat.dump_checkpoint(trainer)
                    self._saving = False
                    self.engine.save_state(step, epoch, checkpoint, reason)
            finally:
                self._saving = False
            self._log(
                trainer,
                {"spot/stall_s": self.engine.last_stall_s, "spot/persist_lag_s": self.engine.persist_lag_s()},
            )

        def _emergency(self, trainer: Any, notice: Notice | None) -> None:
            if self.engine.last_saved_step != trainer.global_step:
                self._save(trainer, "preemption")
            self.engine.wait_for_commit(notice)
            self._log_persist_records(trainer)
            if self.config.on_preemption == "stop":
                self.preempted = True
                # Every rank stops the same way: Lightning raises SIGTERMException after this batch.
                compat.set_received_sigterm(trainer, True)
                trainer.should_stop = True
            else:
                self.engine.watcher.clear()
                compat.set_received_sigterm(trainer, False)

        # ----------------------------------------------------------- ending
        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if self.engine.last_saved_step != trainer.global_step:
                self._save(trainer, "end")
            self.engine.finish()
            self._log_persist_records(trainer)
            self.engine.log_cost_summary()

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            try:
                if isinstance(exception, SIGTERMException):
                    if not self.preempted:
                        log.warning(
                            "spot_callbacks: SIGTERM arrived after the last step boundary; the newest committed "
                            "checkpoint (step %s) is the resume point", self.engine.last_saved_step,
                        )  # fmt: skip
                    self.preempted = True
                    exception.code = PREEMPTED_EXIT_CODE
                elif trainer.state.fn == states.TrainerFn.FITTING and self._between_batches(trainer):
                    # Behind the step it resumed from, the resume itself failed: the model is not that run's.
                    last = self.engine.last_saved_step
                    if last is None or trainer.global_step > last:
                        self._save(trainer, "exception")
                else:
                    log.warning(
                        "spot_callbacks: %s inside a training step; no checkpoint of a half-done step is taken",
                        type(exception).__name__,
                    )
                self.engine.wait_for_commit()
                # on_train_end never runs after an exception (a preemption included): summarise here.
                self.engine.log_cost_summary()
            finally:
                self.engine.stop()

        def _between_batches(self, trainer: Any) -> bool:
            progress = trainer.fit_loop.epoch_loop.batch_progress.current
            return progress.ready == progress.completed

        # ---------------------------------------------------------- state
        def state_dict(self) -> dict[str, Any]:
            return {
                "format": STATE_FORMAT,
                # Inside our own save the clock restarts with this checkpoint; in anyone else's it runs on.
                "engine": self.engine.state_dict(at_checkpoint=self._saving),
                "rng": gather_from_ranks(capture_rng_state()),
                "epoch_start_rng": gather_from_ranks(self._epoch_start_rng),
                "batches_done_in_epoch": self._batches_done_in_epoch,
                "seed_environment": compat.seed_environment(),
            }

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.engine.load_state_dict(state_dict.get("engine", {}))
            compat.restore_seed_environment(state_dict.get("seed_environment", {}))
            self._resume_state = state_dict

        def _restore_position(self, trainer: Any, state: dict[str, Any]) -> None:
            current = _mine(state["rng"])
            if compat.loaders_are_stateful(trainer):  # Lightning restored their position itself
                restore_rng_state(current)
                return
            batches_done = state.get("batches_done_in_epoch", 0)
            if isinstance(batches_done, bool) or not isinstance(batches_done, int) or batches_done < 0:
                log.warning(
                    "spot_callbacks: ignoring batches_done_in_epoch=%r from the checkpoint", batches_done
                )
                batches_done = trainer.num_training_batches  # resume at the next epoch boundary
            epoch_start = _mine(state["epoch_start_rng"])
            if batches_done >= trainer.num_training_batches or epoch_start is None:
                # Saved after an epoch's last batch: Lightning runs the next epoch on the iterator
                # it made at restore time. Remake it from the RNG the uninterrupted run had there.
                restore_rng_state(current)
                positioned = compat.restore_epoch_position(trainer, 0)
                compat.mark_epoch_started(trainer)
                self._epoch_start_rng = current
            else:
                # Mid-epoch: replay the epoch's shuffle from its start, skip what was trained on.
                restore_rng_state(epoch_start)
                positioned = compat.restore_epoch_position(trainer, batches_done)
                self._epoch_start_rng = epoch_start
                self._batches_done_in_epoch = batches_done
                restore_rng_state(current)
            if not positioned:
                restore_rng_state(current)
                log.warning(
                    "spot_callbacks: the train loader has no length and no state_dict(); the epoch restarts "
                    "from its first batch. Give it state_dict()/load_state_dict() for an exact resume"
                )

        # -------------------------------------------------------- metrics
        def _resume_metrics(self) -> dict[str, float]:
            resumed = self.engine.resumed
            return {"spot/resume_s": resumed.pull_s} if resumed else {}

        def _log_persist_records(self, trainer: Any) -> None:
            for record in self.engine.new_records():
                self._log(trainer, {"spot/persist_s": record.persist_s, "spot/persist_MBps": record.mb_per_s})

        def _log(self, trainer: Any, metrics: dict[str, float | None]) -> None:
            values = {key: float(value) for key, value in metrics.items() if value is not None}
            if values and trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.log_metrics(values, step=trainer.global_step)

    compat.install_last_alias(
        from_pkg._CheckpointConnector,
        lambda cb: getattr(cb, "_spot_checkpoint", False),
        states.TrainerFn.FITTING,
    )
    SpotCheckpoint.__module__ = __name__
    SpotCheckpoint.__qualname__ = "SpotCheckpoint"
    # The docstring's example must build the Trainer of the same package as the callback.
    SpotCheckpoint.__doc__ = SpotCheckpoint.__doc__.replace("lightning.pytorch", pl.__name__)
    return SpotCheckpoint


import lightning.pytorch as _pl  # noqa: E402

SpotCheckpoint = build_spot_checkpoint(_pl)

__all__ = ["SpotCheckpoint"]
