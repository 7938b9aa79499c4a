"""`SpotCheckpoint`: the Lightning adapter. It translates Lightning hooks into `SpotEngine` calls.

The hooks are one plain class body (:class:`_SpotCheckpointHooks`); :func:`spot_checkpoint_class`
joins it with the ``Checkpoint`` of a Lightning package (``lightning.pytorch`` here,
``pytorch_lightning`` in :mod:`spot_callbacks.pytorch_lightning`), whose Trainer accepts only its own.
"""

from __future__ import annotations

import os
import types
from typing import Any, Literal, Union, cast

import spot_callbacks.lightning._compat as compat
from spot_callbacks.config import SpotConfig, checked_arguments
from spot_callbacks.engine import STATE_FILE, SpotEngine
from spot_callbacks.persist.handles import ShardHandles
from spot_callbacks.preemption import PREEMPTED_EXIT_CODE
from spot_callbacks.store import CheckpointStore
from spot_callbacks.training_horizon import (
    Horizon,
    limit_changes,
    restored_scheduler_changes,
    warn_if_horizon_changed,
)
from spot_callbacks.trigger.rules import AfterEmergency, StepAction

STATE_FORMAT = 1

_DOC = """Time-interval checkpoints for spot instances, persisted in the background and committed atomically.

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


class _SpotCheckpointHooks:
    """The hooks of SpotCheckpoint, for any Lightning package (see :func:`spot_checkpoint_class`)."""

    _spot_checkpoint = True
    _sigterm_exception: type[BaseException]  # the package's SIGTERMException
    _fitting: Any  # the package's TrainerFn.FITTING

    @checked_arguments("SpotCheckpoint")
    def __init__(
        self,
        dirpath: str,
        interval: Union[float, str, None] = "30min",  # noqa: UP007 - jsonargparse reads these hints
        every_n_steps: Union[int, None] = None,  # noqa: UP007
        keep_last: int = 3,
        scratch_dir: Union[str, None] = None,  # noqa: UP007
        storage_options: Union[dict, str, None] = None,  # noqa: UP007
        preemption: Union[str, list[str]] = "auto",  # noqa: UP007
        on_preemption: Literal["stop", "continue"] = "stop",
        interruptions_per_hour: Union[float, None] = None,  # noqa: UP007
        verbose: bool = False,
    ) -> None:
        super().__init__()
        self.config = SpotConfig(
            dirpath=dirpath, interval=interval, every_n_steps=every_n_steps, keep_last=keep_last,
            scratch_dir=scratch_dir, storage_options=storage_options, preemption=preemption,
            on_preemption=on_preemption, interruptions_per_hour=interruptions_per_hour, verbose=verbose,
        )  # fmt: skip
        self.engine = SpotEngine(self.config, framework="lightning")
        self.preempted = False
        self._trainer: Any = None
        self._position = compat.LoopPosition()
        self._resume_state: dict[str, Any] | None = None
        self._saving = False
        # Inside a sharded save: this rank's RNG states for meta.pt, gathered by the writers (not in the loop).
        self._rank_rng: dict[str, Any] | None = None
        self._shard_handles = ShardHandles()
        self._staging_prepared = False

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> _SpotCheckpointHooks:
        """Build from a YAML file whose keys are the SpotConfig fields."""
        return cls(**SpotConfig.from_yaml(path).to_dict())

    @property
    def store(self) -> CheckpointStore:
        return self.engine.store

    @property
    def state_key(self) -> str:
        # Not keyed by dirpath: a run whose checkpoints were copied to another bucket (or that
        # moved from file:// to s3://) must still find its position, clock and ledger.
        # The hooks are mixed into Lightning's Callback (below), which defines _generate_state_key.
        return cast(Any, self)._generate_state_key()

    # ---------------------------------------------------------- setup
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer
        self._shard_handles = ShardHandles()  # this fit's sharded state dicts, kept across its checkpoints
        self._staging_prepared = False  # this fit's staging buffers were asked for (first step boundary)
        compat.install_latest_resolution(trainer, self._resolve_latest)
        compat.install_horizon_check(trainer, self._horizon_restored)
        self.engine.start()

    def _resolve_latest(self) -> str | None:
        if self.engine.pull_latest(check=compat.check_loadable) is None or self.engine.resumed is None:
            return None
        return compat.path_to_load(self._trainer, self.engine.resumed, STATE_FILE)

    def _horizon_restored(self, schedulers: list[tuple[str, dict[str, Any], Any]]) -> None:
        # Only our own checkpoints record the limits they were written under (older ones neither).
        saved = Horizon.from_dict((self._resume_state or {}).get("horizon"))
        trainer = self._trainer
        step = trainer.global_step
        changes = limit_changes(saved, compat.horizon(trainer), step, compat.epochs_done(trainer))
        changes += restored_scheduler_changes(schedulers)
        if trainer.is_global_zero:
            warn_if_horizon_changed(step, changes)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._position.fit_starts()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Lightning's SIGTERM handler (installed just before this hook) runs a broadcast inside
        # the handler, which deadlocks DDP when the signal reaches a rank other than 0. Ours
        # only records the notice; all ranks then agree at the next step boundary.
        self.engine.reassert_signal_handlers()
        self._position.train_starts()
        if self._resume_state is not None:
            self._position.restore(trainer, self._resume_state)
            self._resume_state = None
            compat.log_metrics(trainer, {"spot/resume_s": getattr(self.engine.resumed, "pull_s", None)})

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._position.epoch_starts()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._position.epoch_ends()

    # ------------------------------------------------------ stepping
    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._position.batch_ends(batch_idx)
        if compat.at_optimizer_step_boundary(trainer, batch_idx):
            self._step_boundary(trainer, report_failures=True)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        # A notice that arrives during validation inside an epoch is handled before Lightning
        # raises SIGTERMException at the end of the batch.
        fitting = trainer.state.fn == self._fitting and not trainer.sanity_checking
        if fitting and (trainer.received_sigterm or self.engine.pending_notice is not None):
            self._step_boundary(trainer, report_failures=False)

    def _step_boundary(self, trainer: Any, report_failures: bool) -> None:
        notice = compat.signal_connector_notice(trainer, self.engine.pending_notice)
        ask = self.engine.step_boundary if report_failures else self.engine.decide
        action = ask(trainer.global_step, notice)
        compat.log_persist_records(trainer, self.engine.new_records())  # commits since the last boundary
        if action.emergency:
            self._emergency(trainer, action)
        elif action.save:
            assert action.reason is not None  # a save always carries its reason
            self._save(trainer, action.reason)
        elif not self._staging_prepared and report_failures:
            # The optimizer state exists now: the staging buffers are allocated off the loop.
            self._staging_prepared = True
            state = compat.tensors_to_stage(trainer, self._shard_handles)
            if state is not None:
                self.engine.staging.prepare(state)
            # The persister's process groups or threads are made here, not at the first checkpoint.
            if compat.saves_sharded(trainer):
                self.engine.prepare_sharded()
            else:
                self.engine.prepare_state_file()

    def _save(self, trainer: Any, reason: str, fit_ended: bool = False) -> None:
        step, epoch = trainer.global_step, trainer.current_epoch
        self._saving = True  # the dump calls state_dict(): see there
        self._rank_rng = {} if compat.saves_sharded(trainer) else None
        try:
            dumped = compat.dump_for_save(trainer, self._shard_handles)
        finally:
            rank_rng, self._rank_rng, self._saving = self._rank_rng, None, False
        if fit_ended:  # a larger max_steps / max_epochs trains on from here
            epoch = compat.loops_as_fit_left_them(
                trainer, dumped.state if dumped.meta is None else dumped.meta
            )
        with self.engine.writers_woken_at_end():  # the metrics logged before the writer's first Python
            if dumped.meta is not None:  # FSDP: every rank persists its own shards
                # Every rank's RNG states reach rank 0's meta.pt through the writers' gather, off the loop.
                rank_meta = {
                    ("callbacks", self.state_key, key): value for key, value in (rank_rng or {}).items()
                }
                self.engine.save_sharded_state(
                    step, epoch, dumped.state, reason, meta=dumped.meta, layouts=dumped.layouts,
                    rank_meta=rank_meta or None, cut=dumped.cut, after_release=dumped.after_release,
                )  # fmt: skip
            else:
                self.engine.save_state(step, epoch, dumped.state, reason)
            lag_s = self.engine.persist_lag_s()
            compat.log_metrics(
                trainer, {"spot/stall_s": self.engine.last_stall_s, "spot/persist_lag_s": lag_s}
            )

    def _emergency(self, trainer: Any, action: StepAction) -> None:
        if action.save:
            assert action.reason is not None  # a save always carries its reason
            self._save(trainer, action.reason)
        after = self.engine.finish_emergency(action.notice)
        compat.log_persist_records(trainer, self.engine.new_records())
        stop = after is AfterEmergency.STOP
        # Every rank stops the same way: Lightning raises SIGTERMException after this batch.
        compat.set_received_sigterm(trainer, stop)
        if stop:
            self.preempted = trainer.should_stop = True

    # ----------------------------------------------------------- ending
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        reason = self.engine.end_reason(trainer.global_step)
        if reason is not None:
            self._save(trainer, reason, fit_ended=True)
        self.engine.finish()
        compat.log_persist_records(trainer, self.engine.new_records())
        self.engine.log_cost_summary()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        try:
            action = self.engine.on_exception(
                type(exception).__name__,
                late_signal=isinstance(exception, self._sigterm_exception),
                preempted=self.preempted,
                between_batches=trainer.state.fn == self._fitting and compat.between_batches(trainer),
                step=trainer.global_step,
            )
            if action.preempted:
                self.preempted = True
                exception.code = PREEMPTED_EXIT_CODE  # type: ignore[attr-defined]  # a SystemExit
            if action.save:
                self._save(trainer, "exception")
            self.engine.wait_for_commit()
            # on_train_end never runs after an exception (a preemption included): summarise here.
            self.engine.log_cost_summary()
        finally:
            self.engine.stop()

    # ---------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            # Inside our own save the clock restarts with this checkpoint; in anyone else's it runs on.
            "engine": self.engine.state_dict(at_checkpoint=self._saving),
            **self._position.state_dict(self._trainer, rank_rng=self._rank_rng),
            **({"horizon": compat.horizon(self._trainer).to_dict()} if self._trainer is not None else {}),
            "seed_environment": compat.seed_environment(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.load_state_dict(state_dict.get("engine", {}))
        compat.restore_seed_environment(state_dict.get("seed_environment", {}))
        self._resume_state = state_dict


def spot_checkpoint_class(pl: types.ModuleType, module: str = __name__) -> type:
    """The SpotCheckpoint class of a Lightning package: the hooks on that package's ``Checkpoint``."""
    internals = compat.package_internals(pl)
    namespace = {
        "__module__": module,
        "__qualname__": "SpotCheckpoint",
        # The docstring's example must build the Trainer of the same package as the callback.
        "__doc__": _DOC.replace("lightning.pytorch", pl.__name__),
        "_sigterm_exception": internals.sigterm_exception,
        "_fitting": internals.fitting,
    }
    spot_checkpoint = type("SpotCheckpoint", (_SpotCheckpointHooks, pl.callbacks.Checkpoint), namespace)
    compat.install_last_alias(
        internals.checkpoint_connector,
        lambda callback: getattr(callback, "_spot_checkpoint", False),
        internals.fitting,
    )
    compat.release_runs_when_fit_unwinds(
        pl.Trainer, lambda callback: getattr(callback, "_spot_checkpoint", False)
    )
    return spot_checkpoint
