"""Every private Lightning API spot_callbacks touches, in one place (checked on Lightning 2.2-2.6).

- ``_CheckpointConnector._parse_ckpt_path``: "last" is resolved by Lightning before any callback
  hook runs; with a SpotCheckpoint attached it becomes "latest" instead of a local search that
  loses remote protocols (Lightning issue 18261).
- ``_CheckpointConnector.resume_start``: the first place after ``setup`` (process group ready)
  where the path is used; "latest" becomes the pulled local file, or ``None`` (fresh start).
- ``_CheckpointConnector.dump_checkpoint``: the checkpoint dict ``Trainer.save_checkpoint`` would
  write, without writing it (the engine snapshots and persists it in the background); for sharded
  strategies, ``_save_distributed_checkpoint`` / ``_state_dict_type`` and the DCP key layout of
  their ``save_checkpoint`` (``state_dict`` / ``model``, ``optimizer_N``, the rest in ``meta.pt``).
- ``_CheckpointConnector.restore_lr_schedulers`` / ``restore_training_state`` / ``_loaded_checkpoint``:
  the schedulers' state as configured, before the checkpoint's is loaded over it (the horizon warning).
- ``_SignalConnector.received_sigterm``: set on every rank to stop them all the same way.
- ``PL_GLOBAL_SEED``: the seed of the DistributedSampler Lightning injects.
- ``fit_loop.epoch_progress``: normalised after a resume from an epoch's last batch.
- ``loops`` of a checkpoint dumped in ``on_train_end`` (the progress counters' keys), and
  ``epoch_loop._num_ready_batches_reached`` / ``_should_accumulate``: rewritten so a larger
  ``max_steps`` / ``max_epochs`` trains on (``fit`` closes the epoch it stops in).
- ``fit_loop._data_fetcher`` / ``CombinedLoader._iterator``: to put a plain (non-stateful)
  train loader back at its mid-epoch position.
- ``fit_loop.epoch_loop.batch_progress``: whether an exception came between batches.
- ``fit_loop.epoch_loop._batches_that_stepped``: the step Lightning's logger rows carry.
- ``Trainer.fit``: wrapped so that however it unwinds, our callbacks' runs are released (our
  ``on_exception`` is skipped when another callback's raises first).
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import re
import time
import types
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import spot_callbacks.settings as settings
from spot_callbacks._dist import gather_states_from_ranks, rank, world_size
from spot_callbacks.data_position import DataPosition, warn_if_changed
from spot_callbacks.errors import CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError
from spot_callbacks.persist.handles import ShardHandles
from spot_callbacks.persist.tracking import PersistRecord
from spot_callbacks.preemption import TERMINATION, Notice, signal_grace_s
from spot_callbacks.resume import ResumeInfo
from spot_callbacks.run_lease import release_on_unwind
from spot_callbacks.staging import (
    capture_rng_state,
    check_archive_bounds,
    restore_rng_state,
    rng_state_problem,
    unsafe_checkpoint_error,
)
from spot_callbacks.store import CheckpointInfo
from spot_callbacks.store.layout import DCP_METADATA_FILE, SHARDED_META_FILE, STATE_FILE
from spot_callbacks.training_horizon import Horizon

log = logging.getLogger("spot_callbacks")

LATEST = "latest"


@dataclass(frozen=True)
class PackageInternals:
    """What SpotCheckpoint needs of one Lightning package (``lightning.pytorch`` or ``pytorch_lightning``)."""

    sigterm_exception: type[BaseException]
    fitting: Any  # TrainerFn.FITTING
    checkpoint_connector: type  # _CheckpointConnector


def package_internals(pl: types.ModuleType) -> PackageInternals:
    def module(name: str) -> Any:
        return importlib.import_module(f"{pl.__name__}.{name}")

    return PackageInternals(
        module("utilities.exceptions").SIGTERMException,
        module("trainer.states").TrainerFn.FITTING,
        module("trainer.connectors.checkpoint_connector")._CheckpointConnector,
    )


def check_loadable(local_dir: Path, info: CheckpointInfo) -> None:
    """Raise :class:`CorruptCheckpointError` unless the pulled state file loads as a Lightning checkpoint.

    Its bytes matched the manifest, yet a truncated archive or another kind of file may have been
    committed: the resume then falls back to the previous checkpoint instead of crashing in
    Lightning. Memory-mapped, so no tensor is read; a pickle that safe loading refuses is left to
    the real load, which says so (:func:`unsafe_checkpoint_error`).
    """
    path = local_dir / STATE_FILE
    if (local_dir / DCP_METADATA_FILE).is_file():  # sharded: DCP checks its own metadata when loading it
        path = local_dir / SHARDED_META_FILE  # the non-tensor rest, our state among it
        if path.is_file():
            _check_sharded_meta(path, info)
        return
    if not path.is_file():
        return
    check_archive_bounds(path)  # a decompression bomb is damage, found before anything unpacks
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        return
    except Exception as err:  # noqa: BLE001 - any failure to read it is damage, never the user's code
        raise CorruptCheckpointError(
            f"{info.url}: {STATE_FILE} cannot be loaded: {type(err).__name__}: {err}"
        ) from err
    missing = [
        key
        for key in ("state_dict", "pytorch-lightning_version")
        if not isinstance(checkpoint, dict) or key not in checkpoint
    ]
    if missing:
        raise CorruptCheckpointError(
            f"{info.url}: {STATE_FILE} is not a Lightning checkpoint (no {', '.join(missing)})"
        )
    if (problem := spot_state_problem(checkpoint)) is not None:
        raise CorruptCheckpointError(f"{info.url}: {STATE_FILE} holds {problem}")


def _check_sharded_meta(path: Path, info: CheckpointInfo) -> None:
    check_archive_bounds(path)
    try:
        meta = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        return  # refused by the real load too, which says so
    except Exception as err:  # noqa: BLE001 - any failure to read it is damage
        raise CorruptCheckpointError(
            f"{info.url}: {SHARDED_META_FILE} cannot be loaded: {type(err).__name__}: {err}"
        ) from err
    if not isinstance(meta, dict):
        raise CorruptCheckpointError(
            f"{info.url}: {SHARDED_META_FILE} is a {type(meta).__name__}, not a mapping"
        )
    if (problem := spot_state_problem(meta)) is not None:
        raise CorruptCheckpointError(f"{info.url}: {SHARDED_META_FILE} holds {problem}")


# A resume applies one of these per rank; more entries than any run has processes are no run's.
MAX_RANK_STATES = 65536


def spot_state_problem(checkpoint: dict[str, Any]) -> str | None:
    """Why SpotCheckpoint's state in ``checkpoint`` (from a store) would crash the resume after
    Lightning loaded the weights, or ``None``: it must be a mapping, and its RNG states (one per
    rank, applied to the global generators) states the generators accept. Other values (the
    engine's clock and ledger, the batches done, the seed environment) are checked where they are
    used, and an odd one is ignored with a warning.

    Example:
        >>> spot_state_problem({"callbacks": {"SpotCheckpoint{}": {"rng": [], "epoch_start_rng": []}}})
        "SpotCheckpoint's state: rng is an empty list, not one RNG state per rank"
    """
    callbacks = checkpoint.get("callbacks")
    states = [
        state
        for key, state in (callbacks.items() if isinstance(callbacks, dict) else ())
        if isinstance(key, str) and key.startswith("SpotCheckpoint")
    ]
    for state in states:
        if not isinstance(state, dict):
            return f"SpotCheckpoint's state: a {type(state).__name__}, not a mapping"
        for key in ("rng", "epoch_start_rng"):
            per_rank = state.get(key)
            if not isinstance(per_rank, list) or not 0 < len(per_rank) <= MAX_RANK_STATES:
                what = "an empty list" if per_rank == [] else f"a {type(per_rank).__name__}"
                return f"SpotCheckpoint's state: {key} is {what}, not one RNG state per rank"
            for index, rng in enumerate(per_rank):
                if rng is None and key == "epoch_start_rng":
                    continue
                if (problem := rng_state_problem(rng)) is not None:
                    return f"SpotCheckpoint's state: {key}[{index}] is no RNG state ({problem})"
    return None


def path_to_load(trainer: Any, resumed: ResumeInfo, state_file: str) -> str:
    """What ``resume_start`` loads from a pulled checkpoint: the state file, or the folder of a sharded one."""
    local_dir, url = resumed.local_dir, resumed.info.url
    # We put plain loaders back at their mid-epoch position ourselves (restore_position).
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
    if not (local_dir / DCP_METADATA_FILE).is_file():
        return os.fspath(local_dir / state_file)
    if not saves_sharded(trainer):  # the strategy loads a sharded checkpoint through DCP
        raise CheckpointError(
            f"{url} is a sharded (FSDP) checkpoint and {type(trainer.strategy).__name__} cannot load it; "
            "resume with ModelParallelStrategy or FSDPStrategy(state_dict_type='sharded'), which reshard "
            "it onto any number of processes"
        )
    return os.fspath(local_dir)


def install_last_alias(connector_cls: Any, is_spot_callback: Callable[[Any], bool], fitting: Any) -> None:
    """Make ``fit(ckpt_path="last")`` mean "latest" when a SpotCheckpoint is attached (idempotent)."""
    if getattr(connector_cls, "_spot_last_alias", False):
        return
    original = connector_cls._parse_ckpt_path

    def _parse_ckpt_path(self: Any, state_fn: Any, ckpt_path: Any, *args: Any, **kwargs: Any) -> Any:
        if ckpt_path == "last" and state_fn == fitting and any(map(is_spot_callback, self.trainer.callbacks)):
            return LATEST
        return original(self, state_fn, ckpt_path, *args, **kwargs)

    connector_cls._parse_ckpt_path = _parse_ckpt_path
    connector_cls._spot_last_alias = True


def release_runs_when_fit_unwinds(trainer_cls: type, is_spot_callback: Callable[[Any], bool]) -> None:
    """Wrap ``trainer_cls.fit`` (idempotent): when it raises or returns, each SpotCheckpoint
    attached releases its run lock and workers (a no-op after a normal ``on_train_end``)."""
    release_on_unwind(
        trainer_cls,
        "fit",
        lambda trainer: [c for c in getattr(trainer, "callbacks", []) if is_spot_callback(c)],
    )


def install_latest_resolution(trainer: Any, resolve: Callable[[], str | None]) -> None:
    """Resolve ``ckpt_path="latest"`` on this trainer through ``resolve`` (a local file or None).

    What was pulled is loaded with ``weights_only=True`` unless ``fit(weights_only=False)`` asked
    otherwise (a store's bytes are data, not code), and a file that safe loading refuses, or whose
    tensors do not fit the model, fails with an error naming it and the way out.
    """
    connector = trainer._checkpoint_connector
    if getattr(connector, "_spot_resolves_latest", False):
        return
    original = connector.resume_start
    original_restore_model = connector.restore_model
    pulled: list[str] = []

    def resume_start(checkpoint_path: Any = None, *args: Any, **kwargs: Any) -> Any:
        pulled.clear()
        if checkpoint_path != LATEST:
            return original(checkpoint_path, *args, **kwargs)
        checkpoint_path = resolve()
        if checkpoint_path is None:
            return original(checkpoint_path, *args, **kwargs)
        pulled.append(os.fspath(checkpoint_path))
        if not args and kwargs.get("weights_only") is None:
            kwargs["weights_only"] = True  # also when TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set
        try:
            return original(checkpoint_path, *args, **kwargs)
        except pickle.UnpicklingError as err:
            allow = (
                "allow them with torch.serialization.add_safe_globals([...]) before fit(), or pass "
                "fit(..., weights_only=False) to unpickle it whole"
            )
            raise unsafe_checkpoint_error(checkpoint_path, err, allow) from None

    def restore_model() -> Any:
        try:
            return original_restore_model()
        except RuntimeError as err:
            if not pulled or "Error(s) in loading state_dict" not in str(err):
                raise
            raise IncompatibleCheckpointError(
                f"the newest committed checkpoint ({pulled[0]}) does not fit this model: {err}\n"
                "It was saved by a model with other parameters or shapes. Resume with the model that "
                "wrote it, or start this one afresh: a new dirpath, or fit() without ckpt_path='latest'"
            ) from err

    connector.resume_start = resume_start
    connector.restore_model = restore_model
    connector._spot_resolves_latest = True


def install_horizon_check(
    trainer: Any, restored: Callable[[list[tuple[str, dict[str, Any], Any]]], None]
) -> None:
    """Call ``restored`` once a checkpoint's training state is restored (before the first step,
    also when ``fit`` then stops at once) with each scheduler's class name, its ``state_dict`` as
    configured now, and the checkpoint's, which Lightning has loaded over it (idempotent)."""
    connector = trainer._checkpoint_connector
    if getattr(connector, "_spot_checks_horizon", False):
        return
    original_schedulers, original_training_state = (
        connector.restore_lr_schedulers,
        connector.restore_training_state,
    )
    schedulers: list[tuple[str, dict[str, Any], Any]] = []

    def restore_lr_schedulers() -> Any:
        saved = (connector._loaded_checkpoint or {}).get("lr_schedulers") or []
        schedulers[:] = [
            (type(config.scheduler).__name__, dict(config.scheduler.state_dict()), state)
            for config, state in zip(trainer.lr_scheduler_configs, saved, strict=False)
        ]
        return original_schedulers()

    def restore_training_state() -> Any:
        schedulers.clear()
        result = original_training_state()
        if connector._loaded_checkpoint:
            restored(list(schedulers))
        return result

    connector.restore_lr_schedulers = restore_lr_schedulers
    connector.restore_training_state = restore_training_state
    connector._spot_checks_horizon = True


def horizon(trainer: Any) -> Horizon:
    """The limits this trainer's ``fit`` runs to."""
    return Horizon.of(trainer.max_steps, trainer.max_epochs)


def epochs_done(trainer: Any) -> int:
    return int(trainer.fit_loop.epoch_progress.current.completed)


def signal_connector_notice(trainer: Any, known: Notice | None) -> Notice | None:
    """A SIGTERM that Lightning's own handler caught (``received_sigterm``) and no watcher saw."""
    if getattr(trainer, "received_sigterm", False) and known is None:
        return Notice(TERMINATION, time.time() + signal_grace_s(), "Lightning signal connector")
    return None


def set_received_sigterm(trainer: Any, value: bool) -> None:
    """``Trainer.received_sigterm`` is read-only; the loop raises SIGTERMException when it is set."""
    trainer._signal_connector.received_sigterm = value


def dump_checkpoint(trainer: Any) -> dict[str, Any]:
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


_LIGHTNING_STRATEGIES = ("ModelParallelStrategy", "FSDPStrategy", "DDPStrategy", "SingleDeviceStrategy")


def strategy_kind(strategy: Any) -> str:
    """Which of Lightning's strategies ``strategy`` is, a subclass included (its class name otherwise).

    Example:
        >>> class MyFSDP: ...
        >>> MyFSDP.__name__ = "FSDPStrategy"; strategy_kind(type("Tuned", (MyFSDP,), {})())
        'FSDPStrategy'
    """
    for cls in type(strategy).__mro__:
        if cls.__name__ in _LIGHTNING_STRATEGIES:
            return cls.__name__
    return type(strategy).__name__


def saves_sharded(trainer: Any) -> bool:
    """The strategy checkpoints sharded state: ModelParallelStrategy(save_distributed_checkpoint=True)
    or FSDPStrategy(state_dict_type="sharded")."""
    strategy = trainer.strategy
    kind = strategy_kind(strategy)
    if kind == "ModelParallelStrategy":
        return bool(getattr(strategy, "_save_distributed_checkpoint", False))
    return kind == "FSDPStrategy" and getattr(strategy, "_state_dict_type", None) == "sharded"


def dump_for_save(trainer: Any, handles: ShardHandles | None = None) -> DumpedCheckpoint:
    """The checkpoint to persist and, for a sharded strategy, its ``meta.pt`` part (``handles``: the run's)."""
    if saves_sharded(trainer):
        return dump_sharded_checkpoint(trainer, handles or ShardHandles())
    return DumpedCheckpoint(dump_checkpoint(trainer))


@dataclass
class DumpedCheckpoint:
    """A checkpoint as the strategy would save it: whole, or sharded with the small rest apart."""

    state: dict[str, Any]
    meta: dict[str, Any] | None = None  # sharded: what rank 0 writes as meta.pt
    layouts: dict[tuple[Any, ...], Any] | None = None  # sharded, as local shards: the DTensors' layouts
    # FSDPStrategy (FSDP1) with a flat-shard plan: the writer's cut of the staged flat shards, and what it
    # calls once it released the staging buffers (persist/fsdp1_flat.py).
    cut: Callable[[dict[str, Any], Any], dict[str, Any]] | None = None
    after_release: Callable[[], None] | None = None


def dump_sharded_checkpoint(trainer: Any, handles: ShardHandles) -> DumpedCheckpoint:
    """The checkpoint split as the strategy's own ``save_checkpoint`` splits it: the DCP part and ``meta.pt``.

    ModelParallelStrategy's state-dict methods offload every shard to the CPU (a copy on GPU); the
    engine stages the shards into reused pinned buffers itself, so they are taken here without the
    offload, as local shards (views), under the keys ``ModelParallelStrategy.load_checkpoint`` reads,
    through ``handles``, which keep them from one checkpoint to the next while they are live.
    """
    strategy = trainer.strategy
    kind = strategy_kind(strategy)
    if kind != "ModelParallelStrategy" and len(trainer.optimizers) != 1:  # FSDPStrategy: its own state dicts
        checkpoint = dump_checkpoint(trainer)
        state = {"model": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": o for i, o in enumerate(checkpoint.pop("optimizer_states", []))})
        return DumpedCheckpoint(state, checkpoint)
    checkpoint = _dump_without_state_dicts(trainer)
    if kind == "ModelParallelStrategy":
        state, layouts = _local_shards(trainer, handles)
        return DumpedCheckpoint(state, checkpoint, layouts)
    return _fsdp1_shards(trainer, handles, checkpoint)


def _dump_without_state_dicts(trainer: Any) -> dict[str, Any]:
    """``dump_checkpoint`` without the model's and optimizers' state dicts (taken apart, as local shards)."""
    strategy = trainer.strategy
    strategy.lightning_module_state_dict = dict  # instance attributes shadow the methods for this dump
    strategy.optimizer_state = lambda optimizer: {}
    try:
        checkpoint = dump_checkpoint(trainer)
    finally:
        del strategy.lightning_module_state_dict, strategy.optimizer_state
    checkpoint.pop("state_dict", None)
    checkpoint.pop("optimizer_states", None)
    return checkpoint


def _fsdp1_shards(trainer: Any, handles: ShardHandles, meta: dict[str, Any]) -> DumpedCheckpoint:
    """FSDPStrategy(state_dict_type="sharded") with one optimizer: FSDP1's sharded state dicts as the
    strategy takes them at the first checkpoint, its flat shards after, where the plan applies
    (:class:`~spot_callbacks.persist.fsdp1_flat.Fsdp1Checkpoints`, the HF FSDP1 path's too); the files
    are the strategy's own (``model``, ``optimizer_0``)."""
    strategy = trainer.strategy
    optimizer = trainer.optimizers[0]
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps it

    def take() -> dict[str, Any]:
        return {
            "model": type(strategy).lightning_module_state_dict(strategy),
            "optimizer": type(strategy).optimizer_state(strategy, optimizer),
        }

    def state_dicts() -> tuple[Any, Any, dict[tuple[Any, ...], Any]]:
        state, layouts = handles.local_state(strategy.model, {"optimizer": optimizer}, take, keep=False)
        return state["model"], state["optimizer"], layouts

    run = handles.fsdp1
    model_state, optimizer_state, layouts = run.take(strategy.model, optimizer, state_dicts)
    renamed = {
        ("optimizer_0", *path[1:]) if path[0] == "optimizer" else path: v for path, v in layouts.items()
    }
    state = {"model": model_state, "optimizer_0": optimizer_state}
    plan, built = run.flat, run.prepare
    cut = None
    if plan is not None:

        def cut(staged: dict[str, Any], group: Any) -> dict[str, Any]:
            model, optimizer_cut = plan.cut(staged["model"], staged["optimizer_0"], group)
            return {**staged, "model": model, "optimizer_0": optimizer_cut}

    after_release = built.allocate if built is not None else None
    return DumpedCheckpoint(state, meta, renamed, cut, after_release)


def _local_shards(trainer: Any, handles: ShardHandles) -> tuple[dict[str, Any], dict[tuple[Any, ...], Any]]:
    """ModelParallelStrategy's model and optimizer state dicts as local shards, through ``handles``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = trainer.strategy.model
    optimizers = {f"optimizer_{index}": optimizer for index, optimizer in enumerate(trainer.optimizers)}

    def take() -> dict[str, Any]:
        state: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
        state.update({name: get_optimizer_state_dict(model, o) for name, o in optimizers.items()})
        return state

    return handles.local_state(model, optimizers, take)


def tensors_to_stage(trainer: Any, handles: ShardHandles) -> dict[str, Any] | None:
    """The tensors :func:`dump_for_save` will hand the staging, under the same keys, without running
    the checkpoint hooks (for :meth:`~spot_callbacks.staging.StagingArea.prepare`); ``None`` for a
    strategy whose state dicts take a collective or a gather (FSDPStrategy, DeepSpeed), or on a
    rank that stages nothing."""
    strategy = trainer.strategy
    name = strategy_kind(strategy)
    if name == "ModelParallelStrategy":
        return _local_shards(trainer, handles)[0]
    if name not in ("SingleDeviceStrategy", "DDPStrategy") or not trainer.is_global_zero:
        return None
    return {
        "state_dict": strategy.lightning_module_state_dict(),
        "optimizer_states": [strategy.optimizer_state(optimizer) for optimizer in trainer.optimizers],
    }


def restore_epoch_position(trainer: Any, batches_done: int) -> bool:
    """Recreate the train iterator (the caller has set the epoch-start RNG) and skip ``batches_done``.

    Returns False when the loaders cannot be positioned this way (the caller warns).
    """
    fetch_loop = trainer.fit_loop
    fetcher = getattr(fetch_loop, "_data_fetcher", None)
    combined = getattr(fetch_loop, "_combined_loader", None)
    if fetcher is None or combined is None or getattr(fetcher, "length", None) is None:
        return False
    if batches_done:
        # Lightning sets the sampler epoch at the epoch's start (on_advance_start), which a
        # mid-epoch restart skips; the skipped batches must come from this epoch's shuffle.
        epoch = trainer.fit_loop.epoch_progress.current.processed
        for loader in combined.flattened:
            for sampler in (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
                set_epoch = getattr(sampler, "set_epoch", None)
                if set_epoch is not None:
                    set_epoch(epoch)
    iter(fetcher)  # a new iterator, drawing the same seeds as the interrupted run's did
    mode_iterator = getattr(combined, "_iterator", None)
    iterators = getattr(mode_iterator, "iterators", None)
    if not iterators:
        return False
    for iterator in iterators:
        for _ in range(batches_done):
            next(iterator)
    return True


def loops_as_fit_left_them(trainer: Any, checkpoint: dict[str, Any]) -> int:
    """Rewrite the loop state of a checkpoint dumped in ``on_train_end`` so that a resume with a
    larger ``max_steps`` / ``max_epochs`` trains on as the uninterrupted run would; returns the
    epoch it resumes in.

    Lightning closes the epoch when ``fit`` stops (``FitLoop.on_advance_end`` counts it completed),
    so the state as dumped resumes in a new epoch: after a stop mid-epoch, the rest of the epoch is
    counted as the next one (``current_epoch`` one ahead, ``max_epochs`` reached one epoch early);
    after an epoch's last batch, the next epoch starts with the old batch counters and runs one
    batch past the end. Mid-epoch, the state becomes that of a checkpoint taken in the last
    ``on_train_batch_end`` (what an emergency checkpoint holds, resumed exactly); at an epoch's end,
    that of the loop between two epochs (the next one's counters reset, as ``reset_on_run`` does).
    Unchanged when the loop is not closed as ``fit`` leaves it (a checkpoint from elsewhere).
    """
    fit_loop = checkpoint.get("loops", {}).get("fit_loop")
    epoch_loop = trainer.fit_loop.epoch_loop
    if not isinstance(fit_loop, dict):
        return int(trainer.current_epoch)
    epochs = fit_loop.get("epoch_progress", {})
    batches = fit_loop.get("epoch_loop.batch_progress", {})
    closed = all(
        len({counts.get(key) for key in ("ready", "started", "processed", "completed")}) == 1
        for counts in (epochs.get("current", {}), epochs.get("total", {}), batches.get("current", {}))
    )
    if not closed or not batches["current"]["completed"]:
        return int(trainer.current_epoch)
    if epoch_loop._num_ready_batches_reached():  # the epoch ran to its end
        for name in ("epoch_loop.batch_progress", "epoch_loop.scheduler_progress"):
            fit_loop[name]["current"] = dict.fromkeys(fit_loop[name]["current"], 0)
        fit_loop["epoch_loop.batch_progress"]["is_last_batch"] = False
        optimizer = fit_loop.get("epoch_loop.automatic_optimization.optim_progress", {}).get("optimizer", {})
        for progress in optimizer.values():
            progress["current"] = dict.fromkeys(progress["current"], 0)
        return int(epochs["current"]["completed"])
    for counts in (epochs["current"], epochs["total"]):
        counts["processed"] -= 1
        counts["completed"] -= 1
    for counts in (batches["current"], batches["total"]):
        counts["completed"] -= 1
    if not epoch_loop._should_accumulate():  # on restart, Lightning counts the step again
        fit_loop["epoch_loop.state_dict"]["_batches_that_stepped"] -= 1
    return int(epochs["current"]["completed"])


def mark_epoch_started(trainer: Any) -> None:
    """Resumed from a checkpoint taken after an epoch's last batch, Lightning runs the next epoch
    without counting it as started (no ``on_train_epoch_start``); a checkpoint taken in that epoch
    would then resume one batch off. Count it as an uninterrupted run does."""
    progress = trainer.fit_loop.epoch_progress.current
    # Restarted between two epochs (loops_as_fit_left_them), Lightning starts the next one itself.
    mid_epoch = getattr(trainer.fit_loop, "restarted_mid_epoch", True)
    if progress.started == progress.completed and mid_epoch:
        trainer.fit_loop.epoch_progress.increment_ready()
        trainer.fit_loop.epoch_progress.increment_started()


# seed_everything() leaves the seed in the environment, and Lightning seeds the DistributedSampler
# it injects from there: a resumed run with another seed would shuffle differently.
SEED_ENV_VARS = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")


def seed_environment() -> dict[str, str]:
    values = {name: settings.environment_variable(name) for name in SEED_ENV_VARS}
    return {name: value for name, value in values.items() if value is not None}


_SEED_ENV_PATTERNS = {
    # Lightning's seed range (seed_everything accepts 0 .. 2**32-1) and its 0/1 flag, nothing else.
    "PL_GLOBAL_SEED": re.compile(r"[0-9]{1,10}"),
    "PL_SEED_WORKERS": re.compile(r"[01]"),
}
_MAX_SEED = 2**32 - 1


def restore_seed_environment(saved: Any) -> None:
    """Put back the seed variables :func:`seed_environment` saved, and nothing else.

    The dict comes from a checkpoint, so it is untrusted: a name outside :data:`SEED_ENV_VARS`
    (``LD_PRELOAD``, ``HTTPS_PROXY``, ``AWS_ENDPOINT_URL`` ...) or a value that is not what
    Lightning writes is ignored with a warning and never reaches ``os.environ``.
    """
    if not isinstance(saved, dict):
        log.warning(
            "spot_callbacks: ignoring the checkpoint's seed environment: not a dict (%s)",
            type(saved).__name__,
        )
        return
    ignored = sorted(repr(name)[:80] for name in saved if name not in _SEED_ENV_PATTERNS)
    if ignored:
        log.warning(
            "spot_callbacks: ignoring %d environment variable(s) in the checkpoint that spot_callbacks never "
            "saves: %s; only %s are restored",
            len(ignored), ", ".join(ignored), ", ".join(SEED_ENV_VARS),
        )  # fmt: skip
    for name, pattern in _SEED_ENV_PATTERNS.items():
        if name not in saved:
            continue
        value = saved[name]
        if not isinstance(value, str) or not pattern.fullmatch(value) or int(value) > _MAX_SEED:
            log.warning(
                "spot_callbacks: ignoring %s=%s from the checkpoint: not a value Lightning writes",
                name,
                repr(value)[:80],
            )
            continue
        if settings.environment_variable(name) != value:
            log.info(
                "spot_callbacks: %s=%s restored from the checkpoint (was %s)",
                name,
                value,
                settings.environment_variable(name),
            )
            os.environ[name] = value


def loaders_are_stateful(trainer: Any) -> bool:
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    if combined is None:
        return False
    return all(hasattr(dl, "state_dict") and hasattr(dl, "load_state_dict") for dl in combined.flattened)


def at_optimizer_step_boundary(trainer: Any, batch_idx: int) -> bool:
    """The batch that just ended completed an optimizer step (gradient accumulation, the epoch's last)."""
    done = batch_idx + 1
    return done % trainer.accumulate_grad_batches == 0 or done == trainer.num_training_batches


def between_batches(trainer: Any) -> bool:
    """No training batch is half-done (every batch started has completed)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    return progress.ready == progress.completed


def rng_of_this_rank(per_rank: list[Any]) -> Any:
    """This rank's entry of a per-rank list of RNG states (round-robin when the world size changed)."""
    return per_rank[rank() % len(per_rank)]


def warn_if_rng_reused(per_rank: Any) -> None:
    """One line for the run (rank 0, once per resume) when the world size changed since the checkpoint."""
    if isinstance(per_rank, list) and per_rank and len(per_rank) != world_size() and rank() == 0:
        log.warning(
            "spot_callbacks: the checkpoint was written by %d processes and this run has %d; "
            "RNG streams are reused round-robin, so the resume is not bit-identical",
            len(per_rank), world_size(),
        )  # fmt: skip


def restore_position(trainer: Any, state: dict[str, Any]) -> tuple[Any, int | None] | None:
    """Put the RNG and a plain train loader back where the checkpoint ``state`` was taken.

    Returns the epoch-start RNG now in force and the batches done in the epoch (None: unchanged),
    or None when Lightning restored stateful loaders itself.
    """
    warn_if_rng_reused(state["rng"])
    current = rng_of_this_rank(state["rng"])
    if loaders_are_stateful(trainer):  # Lightning restored their position itself
        restore_rng_state(current)
        return None
    batches_done = state.get("batches_done_in_epoch", 0)
    if isinstance(batches_done, bool) or not isinstance(batches_done, int) or batches_done < 0:
        log.warning("spot_callbacks: ignoring batches_done_in_epoch=%r from the checkpoint", batches_done)
        batches_done = trainer.num_training_batches  # resume at the next epoch boundary
    epoch_start = rng_of_this_rank(state["epoch_start_rng"])
    if batches_done >= trainer.num_training_batches or epoch_start is None:
        # Saved after an epoch's last batch: Lightning runs the next epoch on the iterator
        # it made at restore time. Remake it from the RNG the uninterrupted run had there.
        restore_rng_state(current)
        positioned = restore_epoch_position(trainer, 0)
        mark_epoch_started(trainer)
        position: tuple[Any, int | None] = (current, None)
    else:
        # Mid-epoch: replay the epoch's shuffle from its start, skip what was trained on.
        restore_rng_state(epoch_start)
        positioned = restore_epoch_position(trainer, batches_done)
        position = (epoch_start, batches_done)
        restore_rng_state(current)
    if not positioned:
        restore_rng_state(current)
        log.warning(
            "spot_callbacks: the train loader has no length and no state_dict(); the epoch restarts "
            "from its first batch. Give it state_dict()/load_state_dict() for an exact resume"
        )
    return position


class LoopPosition:
    """Where the train loop is in its epoch, and the RNG its loader drew the epoch's shuffle from.

    Lightning saves neither for a plain loader; with both, a resume replays the epoch's shuffle
    and skips what was trained on (:func:`restore_position`).

    Example:
        >>> position = LoopPosition()
        >>> position.fit_starts(); position.train_starts(); position.epoch_starts(); position.batch_ends(2)
        >>> position.state_dict()["batches_done_in_epoch"]
        3
    """

    def __init__(self) -> None:
        self.epoch_start_rng: dict[str, Any] | None = None
        self.batches_done_in_epoch = 0
        self._epoch_iterator_exists = False

    def fit_starts(self) -> None:
        # The first epoch's iterator is made in FitLoop.setup_data, after this hook.
        self.epoch_start_rng = capture_rng_state()

    def train_starts(self) -> None:
        self._epoch_iterator_exists = True

    def epoch_starts(self) -> None:
        if not self._epoch_iterator_exists:  # later epochs: the iterator is made after this hook
            self.epoch_start_rng = capture_rng_state()
        self._epoch_iterator_exists = False
        self.batches_done_in_epoch = 0

    def epoch_ends(self) -> None:
        self._epoch_iterator_exists = False

    def batch_ends(self, batch_idx: int) -> None:
        self.batches_done_in_epoch = batch_idx + 1

    def state_dict(self, trainer: Any = None, rank_rng: dict[str, Any] | None = None) -> dict[str, Any]:
        """Every rank's RNG now and at the epoch's start (collective), the batches done, and (with
        the ``trainer``) the settings they are counted in.

        ``rank_rng``: gather nothing; put this rank's two RNG states into it instead (under the keys
        the gathered lists go by) and leave those keys out, for the caller to gather off the loop.
        """
        rng_lists: dict[str, Any] = {}
        if rank_rng is not None:
            rank_rng.update({"rng": capture_rng_state(), "epoch_start_rng": self.epoch_start_rng})
        else:  # One gather for both (each all_gather_object is two collectives inside the checkpoint's stall).
            gathered = gather_states_from_ranks((capture_rng_state(), self.epoch_start_rng))
            rng_lists = {
                "rng": [now for now, _ in gathered],
                "epoch_start_rng": [at_start for _, at_start in gathered],
            }
        return {
            **rng_lists,
            "batches_done_in_epoch": self.batches_done_in_epoch,
            **({"data_position": data_position(trainer).to_dict()} if trainer is not None else {}),
        }

    def restore(self, trainer: Any, state: dict[str, Any]) -> None:
        """Put the loop back where ``state`` was taken; warn once if it was counted in other settings."""
        position = restore_position(trainer, state)
        if position is not None:  # a plain loader, put back where the checkpoint was taken
            self.epoch_start_rng, batches_done = position
            if batches_done is not None:
                self.batches_done_in_epoch = batches_done
        if trainer.is_global_zero:
            where = f"step {trainer.global_step}, {self.batches_done_in_epoch} batches into epoch {trainer.current_epoch}"
            warn_if_changed(state.get("data_position"), data_position(trainer), where)


def data_position(trainer: Any) -> DataPosition:
    """The settings the train loop's position is counted in, read from the trainer and its train loaders."""
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    loaders = list(combined.flattened) if combined is not None else []
    return DataPosition(
        batch_size=tuple(_batch_size(loader) for loader in loaders),
        world_size=int(trainer.world_size),
        accumulate_grad_batches=int(trainer.accumulate_grad_batches),
        dataset_length=tuple(_length(getattr(loader, "dataset", None)) for loader in loaders),
    )


def _batch_size(loader: Any) -> int | None:
    size = getattr(loader, "batch_size", None)
    if size is None:  # a DataLoader built on a batch_sampler
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) else None


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset)  # an IterableDataset may have none
    except TypeError:
        return None


def log_persist_records(trainer: Any, records: Iterable[PersistRecord]) -> None:
    """One row per commit: what persisting it took (``spot/persist_s``) and its upload rate."""
    for record in records:
        log_metrics(trainer, {"spot/persist_s": record.persist_s, "spot/persist_MBps": record.mb_per_s})


def logger_step(trainer: Any) -> int:
    """The step Lightning's own rows carry now: ``_batches_that_stepped``, which at a batch's end is
    one less than ``global_step`` (the optimizer step already counted there)."""
    return int(getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step))


def log_metrics(trainer: Any, metrics: dict[str, float | None]) -> None:
    """Send the ``spot/...`` values that are known to the trainer's loggers, from rank 0, at the
    step numbering of Lightning's own rows."""
    values = {key: float(value) for key, value in metrics.items() if value is not None}
    if values and trainer.is_global_zero:
        step = logger_step(trainer)
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step)
