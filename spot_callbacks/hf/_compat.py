"""Every private (or unexported) Transformers API spot_callbacks touches, in one place (checked on 4.5x-5.24).

- ``transformers.trainer_jit_checkpoint.CheckpointManager``: ``TrainingArguments(enable_jit_checkpoint=True)``
  installs its bound method as the SIGTERM handler and keeps the previous one in
  ``_original_sigterm_handler``; it saves locally, without rank agreement, ~3 s later.
- ``checkpoint-is-incomplete.txt``: the marker that JIT handler leaves in a folder it has not finished.
- ``TrainingArguments.save_strategy``: an enum (``.value``) or a plain string, depending on the version.
- For the two-phase save: the running Trainer is found on the call stack; ``Trainer._save_checkpoint``'s
  steps are mirrored from its attributes (``is_deepspeed_enabled``, ``is_fsdp_enabled``, ``hp_search_backend``,
  ``accelerator.scaler``, ``callback_handler``, ``store_flos``, ``_get_output_dir``) and
  ``Trainer._save_rng_state``'s dict layout.
- For the metrics: ``Trainer.callback_handler.callbacks`` (a list, reordered in place),
  ``integrations.integration_utils.INTEGRATION_TO_CALLBACK`` (the ``report_to`` callback classes).
- ``Trainer._load_callback_state``: with ``restore_callback_states_from_checkpoint=True`` it
  re-instantiates every callback named in ``trainer_state.json``'s ``stateful_callbacks`` as
  ``type(callback)(**stored_args)``; wrapped so that a checkpoint never rebuilds ours.
- ``LambdaLR.lr_lambdas`` / ``base_lrs`` / ``last_epoch`` (every Transformers schedule is a ``LambdaLR``,
  rebuilt for the new ``max_steps``; a resume loads only its counters): the learning rate the rebuilt
  schedule gives at the resumed step; ``AcceleratedScheduler.scheduler``: the one it wraps.
- ``Trainer.train``: wrapped so that however it unwinds, our callbacks' runs are released (the
  Trainer has no exception event; ``on_train_end`` runs only after the last step).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import random
import signal
import sys
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import safetensors.torch
import torch
import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

import spot_callbacks.settings as settings
from spot_callbacks.errors import ConfigError
from spot_callbacks.run_lease import release_on_unwind
from spot_callbacks.staging import ATOMIC_TYPES
from spot_callbacks.training_horizon import Horizon

log = logging.getLogger("spot_callbacks")

JIT_INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"


def save_strategy(args: Any) -> str:
    """``args.save_strategy`` as a plain string (``"no"``, ``"steps"``, ``"epoch"``, ``"best"``)."""
    strategy = getattr(args, "save_strategy", "no")
    return str(getattr(strategy, "value", strategy))


def jit_checkpoint_enabled(args: Any) -> bool:
    return bool(getattr(args, "enable_jit_checkpoint", False))


def jit_checkpoint_complete(folder: Path) -> bool:
    """The Trainer's JIT save finished this folder (it exists and has no "incomplete" marker)."""
    return folder.is_dir() and not (folder / JIT_INCOMPLETE_MARKER).exists()


def bypass_jit_sigterm_handler(store_url: str) -> None:
    """Take the Trainer's JIT-checkpoint SIGTERM handler out of the chain, if it is installed.

    Our handler would otherwise chain to it and the same step would be saved twice; ours runs
    the same Trainer save, persisted and agreed by every rank.
    """
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
            store_url,
        )


def checkpoint_dir(output_dir: str | Path | None, step: int) -> Path:
    """The Trainer's folder of ``step``: ``output_dir/checkpoint-N``.

    ``TrainingArguments`` types ``output_dir`` as optional but sets it by the time a Trainer exists.
    """
    if output_dir is None:
        raise ValueError("spot_callbacks: TrainingArguments.output_dir is not set")
    return Path(output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"


def local_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """The ``checkpoint-N`` folders in ``output_dir``, with their steps."""
    found = []
    for folder in Path(output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
        suffix = folder.name[len(PREFIX_CHECKPOINT_DIR) + 1 :]
        if suffix.isdigit():
            found.append((int(suffix), folder))
    return found


# ------------------------------------------------ the two-phase save's view of the Trainer
# Callbacks get no Trainer; the one running an event is ``self`` of a frame further up the stack
# (``Trainer._inner_training_loop`` calls ``on_train_begin``).
def running_trainer() -> transformers.Trainer | None:
    """The Trainer whose event is running now, or ``None`` when none is on the call stack."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, transformers.Trainer):
            return candidate
        frame = frame.f_back
    return None


def _unstaged_rng_device() -> str | None:
    checks = {
        "XLA": transformers.utils.is_torch_xla_available, "NPU": transformers.utils.is_torch_npu_available,
        "HPU": transformers.utils.is_torch_hpu_available, "MLU": transformers.utils.is_torch_mlu_available,
        "MUSA": transformers.utils.is_torch_musa_available,
    }  # fmt: skip
    return next((name for name, available in checks.items() if available()), None)


def staging_blocker(trainer: transformers.Trainer | None) -> str | None:
    """Why the Trainer's checkpoint cannot be staged faithfully, or ``None`` when it can.

    FSDP is decided apart (:func:`spot_callbacks.hf.fsdp.fsdp_blocker`: ``SHARDED_STATE_DICT`` is staged).
    """
    if trainer is None:
        return "the Trainer is not on the call stack of its callbacks (an unknown Trainer loop)"
    args = trainer.args
    unwrapped = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    reasons = [
        (trainer.is_deepspeed_enabled, "DeepSpeed saves its own engine checkpoint"),
        (transformers.utils.is_sagemaker_mp_enabled(), "SageMaker model parallelism saves partial state"),
        (args.push_to_hub, "push_to_hub=True pushes from the Trainer's own save"),
        (trainer.hp_search_backend is not None, "a hyperparameter search names its own run folders"),
        (
            _is_peft_model(unwrapped) and type(unwrapped).__name__ == "PeftMixedModel",
            "peft cannot save a PeftMixedModel (its save_pretrained raises NotImplementedError)",
        ),
        (
            _is_peft_model(unwrapped) and trainer.is_fsdp_enabled and _fsdp_version(trainer) == 1,
            "PEFT under FSDP1 is not staged (fsdp_config version: 2 is)",
        ),
    ]
    reason = next((why for blocked, why in reasons if blocked), None)
    if reason is None and (device := _unstaged_rng_device()) is not None:
        reason = f"the {device} RNG streams are not staged"
    return reason


def _is_peft_model(model: Any) -> bool:
    return type(model).__module__.startswith("peft.")


def _fsdp_version(trainer: transformers.Trainer) -> int:
    return getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1)


def fsdp_saves_adapters_only() -> bool:
    """Whether the Trainer's FSDP save of a PEFT model holds its active adapter only
    (``get_fsdp_ckpt_kwargs()`` in ``transformers.trainer``: ``adapter_only`` where accelerate takes it)."""
    kwargs_of = getattr(transformers.trainer, "get_fsdp_ckpt_kwargs", dict)  # as the Trainer calls it
    kwargs: dict[str, Any] = kwargs_of()
    return bool(kwargs.get("adapter_only", False))


def rng_states(args: Any) -> dict[str, Any]:
    """This rank's RNG streams as ``Trainer._save_rng_state`` records them (``rng_state[_{rank}].pth``)."""
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        distributed = args.parallel_mode == transformers.training_args.ParallelMode.DISTRIBUTED
        states["cuda"] = (
            torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
        )
    return states


def rng_state_name(args: Any) -> str:
    return "rng_state.pth" if args.world_size <= 1 else f"rng_state_{args.process_index}.pth"


def defers_flos(trainer: transformers.Trainer) -> bool:
    """Whether ``Trainer.store_flos`` would be a collective (an all-gather of every rank's count) at a save."""
    distributed = trainer.args.parallel_mode == transformers.training_args.ParallelMode.DISTRIBUTED
    return distributed and trainer.hp_search_backend is None


def trainer_state_at_save(trainer: transformers.Trainer, flush_flos: bool = True) -> Any:
    """A copy of ``trainer.state`` as ``Trainer._save_checkpoint`` writes it to ``trainer_state.json``.

    Collective with several processes (``store_flos``): every rank calls it at the same point.
    ``flush_flos=False``: no ``store_flos`` (nothing collective, ``trainer`` untouched); the copy's
    ``total_flos`` then lacks the ranks' ``current_flos``, which :func:`add_ranks_flos` adds later.
    """
    if trainer.hp_search_backend is None and flush_flos:
        trainer.store_flos()
    history = trainer.state.log_history
    state = copy.deepcopy(trainer.state, {id(history): _HISTORY_COPIES.copy(trainer.state)})
    run_dir = trainer._get_output_dir(trial=None)
    if save_strategy(trainer.args) in ("steps", "epoch", "best") and state.best_global_step:
        best = checkpoint_dir(run_dir, state.best_global_step)
        if best.exists():
            trainer.state.best_model_checkpoint = state.best_model_checkpoint = str(best)
    exportable = transformers.trainer_callback.ExportableState
    # A dict of callback name -> state at run time; transformers annotates the field as a list.
    stateful = cast(dict[str, Any], state.stateful_callbacks)
    for callback in [*trainer.callback_handler.callbacks, trainer.control]:
        if not isinstance(callback, exportable):
            continue
        name, callback_state = type(callback).__name__, copy.deepcopy(callback.state())
        if callback is trainer.control:
            callback_state["args"]["should_save"] = True  # as it reads while the Trainer saves
        if isinstance(stateful.get(name), list):
            stateful[name].append(callback_state)
        else:
            stateful[name] = callback_state
    return state


def _entry_copy(entry: Any) -> Any:
    """A copy of one ``TrainerState.log_history`` entry at a few µs, where ``deepcopy`` takes ~5: an
    entry of plain values (what ``Trainer.log`` appends) is copied as a dict, anything else deep-copied
    (10,000 entries: 54 ms deep-copied, 8 ms this way)."""
    if type(entry) is dict and all(type(value) in ATOMIC_TYPES for value in entry.values()):
        return dict(entry)
    return copy.deepcopy(entry)


class _LogHistoryCopies:
    """Copies of a ``TrainerState.log_history``'s entries, kept from one checkpoint to the next: a
    checkpoint copies only the entries logged since the last one (O(new entries), not O(history)).

    An entry is written once: ``Trainer.log`` appends a new dict and never changes an older one;
    the one change after the append is at the same step (this package's metrics merged into the
    step's row, ``hf/metrics.py``), so the entries of the newest copied step are copied again. A
    history replaced or cut (another ``TrainerState``, ``log_history[:] = ...``) is copied whole.
    A callback that edits an older entry in place would not be seen; none of transformers' does.

    Example:
        >>> from transformers import TrainerState
        >>> state = TrainerState(log_history=[{"loss": 1.0, "step": 1}, {"loss": 0.9, "step": 2}])
        >>> copies = _LogHistoryCopies()
        >>> first = copies.copy(state)
        >>> state.log_history.append({"loss": 0.5, "step": 3})
        >>> second = copies.copy(state)
        >>> second == state.log_history and second[0] is first[0] and second[0] is not state.log_history[0]
        True
    """

    def __init__(self) -> None:
        self._owner: Callable[[], Any] = lambda: None  # the TrainerState, weakly
        self._history_id = 0
        self._originals: list[Any] = []  # the live entries copied, by identity
        self._copies: list[Any] = []

    def copy(self, state: Any) -> list[Any]:
        """A copy of ``state.log_history``, entry by entry; the entries copied before are reused."""
        history = state.log_history
        kept = len(self._originals)
        if (
            self._owner() is not state
            or id(history) != self._history_id
            or len(history) < kept
            or (
                kept
                and (history[0] is not self._originals[0] or history[kept - 1] is not self._originals[-1])
            )
        ):
            self._owner, self._history_id, self._originals, self._copies = (
                weakref.ref(state),
                id(history),
                [],
                [],
            )
            kept = 0
        kept = self._newest_step_start(kept)
        del self._originals[kept:], self._copies[kept:]
        for entry in history[kept:]:
            self._originals.append(entry)
            self._copies.append(_entry_copy(entry))
        return list(self._copies)

    def _newest_step_start(self, kept: int) -> int:
        """Where the entries of the newest copied step begin: they may still change (copied again)."""
        if not kept:
            return 0
        step = _step_of(self._originals[kept - 1])
        while kept and _step_of(self._originals[kept - 1]) == step:
            kept -= 1
        return kept


def _step_of(entry: Any) -> Any:
    return entry.get("step") if isinstance(entry, dict) else None


# The copies of the history of the TrainerState last checkpointed (one Trainer trains at a time).
_HISTORY_COPIES = _LogHistoryCopies()


def add_ranks_flos(trainer_state: Any, current_flos: float, group: Any) -> None:
    """Add every rank's ``current_flos`` to ``trainer_state.total_flos`` as ``Trainer.store_flos`` sums them
    (float32 all-gather, summed, ``item()``), over ``group`` (collective: every rank at once)."""
    import torch.distributed as dist

    scalar = torch.tensor([current_flos])
    gathered = [scalar.clone() for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, scalar, group=group)
    trainer_state.total_flos += torch.cat(gathered, dim=0).sum().item()


def save_model_weights(trainer: transformers.Trainer, state_dict: dict[str, Any], folder: Path) -> None:
    """Write ``state_dict`` (of ``trainer.model``) into ``folder`` as ``Trainer._save`` writes the model."""
    model = trainer.model
    unwrapped = trainer.accelerator.unwrap_model(model, keep_torch_compile=False)
    if isinstance(model, transformers.PreTrainedModel):
        model.save_pretrained(folder, state_dict=state_dict, is_main_process=True)
    elif isinstance(unwrapped, transformers.PreTrainedModel):
        unwrapped.save_pretrained(folder, state_dict=state_dict, is_main_process=True)
    else:
        safetensors.torch.save_file(
            state_dict, os.fspath(folder / transformers.trainer.SAFE_WEIGHTS_NAME), metadata={"format": "pt"}
        )


def processing_class_of(trainer: transformers.Trainer) -> Any:
    """What ``Trainer._save`` saves beside the model: the processing class, else the collator's tokenizer."""
    if trainer.processing_class is not None:
        return trainer.processing_class
    return getattr(trainer.data_collator, "tokenizer", None)


def grad_scaler(trainer: transformers.Trainer) -> Any:
    """The accelerator's gradient scaler (``scaler.pt``), or ``None``."""
    return getattr(trainer.accelerator, "scaler", None)


# ------------------------------------------------ report_to integrations
def _integration_callback_types() -> tuple[type, ...]:
    try:
        from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK
    except ImportError:  # an older layout: no known integrations to order against
        return ()
    return tuple(INTEGRATION_TO_CALLBACK.values())


def place_ahead_of_integrations(trainer: transformers.Trainer | None, callback: Any) -> None:
    """Move ``callback`` just ahead of the first ``report_to`` integration among ``trainer``'s callbacks.

    The Trainer lists the integrations before user callbacks, so a row a user callback logs at
    ``on_train_end`` would reach TensorBoard after its writer closed. Safe while the handler is
    iterating its callbacks: only entries before ``callback`` move, the ones after keep their place.
    Called at ``on_init_end`` and again at ``on_train_begin`` (a callback added with
    ``Trainer.add_callback`` gets no ``on_init_end``).
    """
    if trainer is None:
        return
    callbacks = trainer.callback_handler.callbacks
    integrations = _integration_callback_types()
    first = next(
        (i for i, other in enumerate(callbacks) if integrations and isinstance(other, integrations)), None
    )
    mine = next((i for i, other in enumerate(callbacks) if other is callback), None)
    if first is not None and mine is not None and first < mine:
        callbacks.insert(first, callbacks.pop(mine))


def check_trainer_spans_the_process_group(args: Any) -> None:
    """Refuse a Trainer that trains alone in a process group of several (before the first step);
    warn when the launcher was asked for several processes and started one.

    Under torchrun on a machine without a GPU, a Trainer without ``use_cpu=True`` finds no
    distributed backend and trains each process's own copy of the model, while the process group
    holds them all: one rank's state would be committed for the run.
    """
    dist = torch.distributed
    group_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    mode = args.parallel_mode
    alone = (
        transformers.training_args.ParallelMode.NOT_PARALLEL,
        transformers.training_args.ParallelMode.NOT_DISTRIBUTED,
    )
    if group_size == 1 and launcher_started_one_of_several():
        log.warning(
            "spot_callbacks: accelerate launch was asked for several processes but started only this one "
            "(without --multi_gpu it starts one and leaves the others to mpirun); training on 1 process. "
            "For several, run `accelerate launch --multi_gpu --num_processes N %s` or "
            "`torchrun --standalone --nproc_per_node N %s`", sys.argv[0], sys.argv[0],
        )  # fmt: skip
    if group_size > 1 and args.world_size == 1 and mode in alone:  # not SageMaker MP, not XLA
        raise ConfigError(
            f"the process group has {group_size} processes but the Trainer trains as one "
            f"(TrainingArguments.world_size=1, parallel_mode={getattr(mode, 'value', mode)}): "
            "each process would train its own copy of the model and only rank 0's would be checkpointed. "
            "On a machine without a GPU pass TrainingArguments(use_cpu=True) (use_cpu: true in YAML); "
            "launch with torchrun or `accelerate launch --multi_gpu`"
        )


def launcher_started_one_of_several() -> bool:
    """``accelerate launch --cpu --num_processes N`` (and without ``--multi_gpu`` on fewer GPUs than N)
    took accelerate's plain launcher: it starts exactly this process and leaves the others to mpirun.

    It always sets ``ACCELERATE_USE_CPU``, and ``MASTER_ADDR`` only when asked for several processes
    or machines; where mpirun did start them, accelerate reads the world size from ``PMI_SIZE`` or
    ``OMPI_``/``MV2_..._SIZE``.
    """
    world_size_names = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
    variable = settings.environment_variable
    return (
        variable("ACCELERATE_USE_CPU") is not None
        and variable("MASTER_ADDR") is not None
        and not any(variable(name) is not None for name in world_size_names)
    )


NEVER_RESTORED_MARK = "_spot_never_restored_from_checkpoints"


def never_rebuild_from_checkpoints() -> None:
    """Make ``Trainer._load_callback_state`` ignore the ``stateful_callbacks`` entries of our callbacks.

    A checkpoint's ``trainer_state.json`` is untrusted (anyone who can write the bucket wrote it):
    restoring an entry would rebuild our callback with the checkpoint's ``dirpath`` and
    ``storage_options``, sending the run's state to another store. The user's object is the only
    one; a class carries :data:`NEVER_RESTORED_MARK` to be kept so. Idempotent, process-wide.
    """
    original = getattr(transformers.Trainer, "_load_callback_state", None)
    if original is None or getattr(original, NEVER_RESTORED_MARK, False):
        return

    @functools.wraps(original)
    def _load_callback_state(self: transformers.Trainer) -> None:
        ours = {
            type(callback).__name__
            for callback in self.callback_handler.callbacks
            if getattr(type(callback), NEVER_RESTORED_MARK, False)
        }
        stateful = cast(dict[str, Any], self.state.stateful_callbacks)  # a dict at run time
        named = sorted(ours & set(stateful))
        if named and self.args.restore_callback_states_from_checkpoint:
            for name in named:
                del stateful[name]
            log.warning(
                "spot_callbacks: the checkpoint's trainer_state.json names %s in stateful_callbacks; ignored: "
                "a checkpoint never rebuilds this callback (the one passed to the Trainer stays, with its "
                "own dirpath and storage_options)", ", ".join(named),
            )  # fmt: skip
        original(self)

    setattr(_load_callback_state, NEVER_RESTORED_MARK, True)
    transformers.Trainer._load_callback_state = _load_callback_state  # type: ignore[method-assign]


def release_runs_when_train_unwinds() -> None:
    """Wrap ``Trainer.train`` (process-wide, idempotent): when it raises or returns, each of our
    callbacks (a class with :data:`NEVER_RESTORED_MARK`) releases its run lock and workers."""
    release_on_unwind(
        transformers.Trainer,
        "train",
        lambda trainer: [
            callback
            for callback in getattr(getattr(trainer, "callback_handler", None), "callbacks", [])
            if getattr(type(callback), NEVER_RESTORED_MARK, False)
        ],
    )


def horizon(args: Any) -> Horizon:
    """The limit the user set: ``max_steps`` when positive (it overrides the epochs), else ``num_train_epochs``."""
    max_steps = getattr(args, "max_steps", -1)
    if isinstance(max_steps, int) and max_steps > 0:
        return Horizon.of(max_steps, None)
    return Horizon.of(None, getattr(args, "num_train_epochs", None))


def rebuilt_schedule_rates(scheduler: Any) -> tuple[str, list[float], list[float]] | None:
    """For a ``LambdaLR`` just resumed: its name, the learning rates the checkpoint left (restored
    ``_last_lr``) and those its lambdas, built for this run's horizon, give at the restored step;
    ``None`` for another kind of scheduler (its whole state was loaded)."""
    scheduler = getattr(scheduler, "scheduler", scheduler)  # accelerate's AcceleratedScheduler
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return None
    step = scheduler.last_epoch
    new_rates = [
        float(base) * float(lr_lambda(step))
        for lr_lambda, base in zip(scheduler.lr_lambdas, scheduler.base_lrs, strict=True)
    ]
    return type(scheduler).__name__, [float(rate) for rate in scheduler.get_last_lr()], new_rates
