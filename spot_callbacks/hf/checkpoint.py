"""The Hugging Face checkpoint in two phases: the loop pays for a RAM snapshot, a writer makes ``checkpoint-N``.

At the step boundary :meth:`StagedSaves.stage` copies what a resume needs into the run's
:class:`~spot_callbacks.staging.StagingArea` (model, optimizer, scheduler and scaler state dicts,
this rank's RNG streams). Once every callback has had its ``on_step_end`` (the flags a callback
listed after this one sets are final only then) and the step's logging is done,
:meth:`StagedSaves.submit` copies the ``TrainerState`` and hands the folder to the persister; when
the Trainer saves or evaluates at that step after all, :meth:`StagedSaves.drop` frees the snapshot
and the Trainer's own folder is persisted (two writers never meet in one ``checkpoint-N``). The
persister's writer thread writes the files ``Trainer._save_checkpoint`` would
(``model.safetensors`` through ``save_pretrained(state_dict=...)``, a PEFT model's adapters as
its ``save_pretrained`` writes them (:mod:`spot_callbacks.hf.adapters`), ``optimizer.pt``,
``scheduler.pt``, ``scaler.pt``, ``rng_state[_{rank}].pth``, ``trainer_state.json``,
``training_args.bin``, the processing class) into a hidden folder renamed to ``checkpoint-N`` when
complete; the existing pipeline uploads and commits it.

Where the folder's files are spread over ranks (FSDP with ``SHARDED_STATE_DICT``: every rank's DCP
shards; several nodes: node-local ``output_dir`` folders) *every* rank stages what it writes (its shards,
see :mod:`spot_callbacks.hf.fsdp`; its RNG streams; on the ranks where ``args.should_save``, the
rest) and its writer thread writes and uploads its own files of the folder, in parallel with the
other ranks (:class:`~spot_callbacks.persist.folders.NodeFolderPersister`); rank 0 commits. Where
the state cannot be staged faithfully (see :func:`~spot_callbacks.hf._compat.staging_blocker`)
the Trainer saves as before.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import transformers

import spot_callbacks.hf._compat as compat
import spot_callbacks.hf.adapters as adapters
import spot_callbacks.hf.fsdp as fsdp
import spot_callbacks.settings as settings
from spot_callbacks._dist import is_writer
from spot_callbacks.saving import then_call
from spot_callbacks.staging import StagedState, StagingArea, save_hashed
from spot_callbacks.store.checksums import FileDigest

if TYPE_CHECKING:
    from spot_callbacks.engine import SpotEngine

log = logging.getLogger("spot_callbacks")

SAVE_PATH_ENV = settings.HF_SAVE.name  # "staged" (the default where it applies) or "trainer"
STAGED, TRAINER = "staged", "trainer"  # the manifest's ``extra["hf_save"]``: the path a checkpoint took
TRAINER_SAVES_AT_A_STAGED_STEP = (
    "a save or evaluation comes at a staged checkpoint's step: the Trainer writes it"
)


def save_path_setting() -> str:
    """The path the user asked for in ``SPOT_HF_SAVE`` (default ``staged``)."""
    return settings.HF_SAVE.value()


@dataclass
class StagedCheckpoint:
    """One checkpoint between its snapshot and its submission.

    Example:
        >>> from spot_callbacks.hf.saves import SaveRequest
        >>> StagedCheckpoint(SaveRequest(5, "interval"), epoch=0, staged=None, blocked_s=0.01).request.step
        5
    """

    request: Any  # the adapter's SaveRequest (``step``, ``reason``), handed back by submit()
    epoch: int
    staged: StagedState | None  # None on ranks that write only their RNG file
    blocked_s: float
    layouts: dict[tuple[Any, ...], fsdp.ShardLayout] | None = None  # sharded: the DTensors' layouts
    flat: Any = None  # FSDP1's FlatShardPlan: the staged model and optimizer are flat shards, to cut
    # FSDP1's FlatShardPlan built at this step: its buffers are allocated once this checkpoint is written.
    prepare: Any = None


class StagedSaves:
    """The two-phase saves of one ``train()``: which path applies, the snapshot waiting for its submission.

    Example:
        >>> saves = StagedSaves()  # below, no Trainer is on the stack: the Trainer saves
        >>> saves.start(trainer=None, args=transformers.TrainingArguments("out"), spans_nodes=False)
        >>> saves.applies(should_save=False, should_evaluate=False), saves.fallback_reason[:31]
        (False, 'the Trainer is not on the call ')
    """

    def __init__(self) -> None:
        self._trainer: Callable[[], transformers.Trainer | None] = lambda: None
        self.fallback_reason: str | None = None
        self.owns_folders = False
        self.every_rank = False  # every rank stages and writes its own files (FSDP shards, several nodes)
        self.sharded = (
            False  # FSDP SHARDED_STATE_DICT: the model and optimizer are every rank's DTensor shards
        )
        self.submitted_steps: list[int] = []  # of this train(), in order
        self.adapters: adapters.AdapterSnapshot | None = None  # a PEFT model: its adapters are the model
        self.pending: StagedCheckpoint | None = None
        self.handles = (
            fsdp.ShardHandles()
        )  # sharded: the shards to stage, kept from one checkpoint to the next
        self._said: set[str] = set()
        self._prepared = False  # this train()'s staging buffers were asked for (prepare())

    def _live_trainer(self) -> transformers.Trainer:
        trainer = self._trainer()
        if trainer is None:  # start() saw no Trainer, or it was garbage-collected: nothing to stage from
            raise RuntimeError("spot_callbacks: the Trainer of this train() is gone")
        return trainer

    def start(self, trainer: transformers.Trainer | None, args: Any, spans_nodes: bool) -> None:
        """At ``on_train_begin`` (every rank): choose the path for this run and log it once."""
        self._trainer = weakref.ref(trainer) if trainer is not None else (lambda: None)
        self.pending, self.submitted_steps = None, []
        self.handles = fsdp.ShardHandles()
        self._prepared = False
        self.owns_folders = compat.save_strategy(args) == "no"  # nothing else rotates checkpoint-N
        if args.save_only_model:
            log.warning(
                "spot_callbacks: save_only_model=True: checkpoints hold no optimizer, scheduler or RNG state, "
                "so a resume from them is not exact"
            )
        fsdp_on = trainer is not None and bool(trainer.is_fsdp_enabled)
        reason = compat.staging_blocker(trainer)
        if reason is None and fsdp_on:
            reason = fsdp.fsdp_blocker(trainer)
        self.sharded = fsdp_on and reason is None
        peft_model = adapters.peft_model_of(trainer) if trainer is not None else None
        if self.sharded and not compat.fsdp_saves_adapters_only():
            peft_model = None  # the Trainer's FSDP save holds the whole model then
        self.adapters = adapters.AdapterSnapshot(peft_model) if peft_model is not None else None
        # An FSDP run's folders hold every rank's files even when the Trainer writes them.
        self.every_rank = fsdp_on or spans_nodes
        if reason is None and save_path_setting() == TRAINER:
            reason = f"{SAVE_PATH_ENV}={TRAINER}"
        self.fallback_reason = reason
        if reason is None:
            who = (
                " (every rank writes its own shards)" if self.sharded
                else " (every node writes its own files)" if self.every_rank
                else ""
            )  # fmt: skip
            line = f"spot_callbacks: checkpoints are staged in RAM and written in the background{who}"
        else:
            line = f"spot_callbacks: the Trainer writes each checkpoint, then it is uploaded ({reason})"
        # Each node says which path it takes (they write their own files): one line per node.
        self._say(line, every_node=spans_nodes and args.local_process_index == 0)

    def _say(self, line: str, every_node: bool = False) -> None:
        if line not in self._said:
            self._said.add(line)
            log.info("%s", line, extra={"every_rank": every_node})

    def applies(self, should_save: bool, should_evaluate: bool) -> bool:
        """Whether this step's checkpoint is staged (else the adapter sets ``control.should_save``)."""
        if self.fallback_reason is not None:
            return False
        if should_save:  # the Trainer saves this step anyway (save_strategy): that folder is persisted
            return False
        if should_evaluate:
            # The evaluation draws random numbers and updates best_metric after the callbacks ran.
            self._say(
                "spot_callbacks: an evaluation runs at the checkpoint step: the Trainer writes that one"
            )
            return False
        return True

    def prepare(self, writer: SpotEngine) -> None:
        """At the first ``on_step_end`` of a train() without a checkpoint (every rank, after the resume):
        the persister of :attr:`every_rank` folders, made now (a collective: its gloo groups), or on one
        node the writer's (its threads); with several processes on one node, a first ``store_flos``
        all-gather (:func:`warm_flos_gather`); and the buffers :meth:`stage` will copy into, allocated in
        the background (every rank that stages). What the first checkpoint would otherwise pay once.

        The buffers are skipped where taking the state dicts is itself a collective or a gather (FSDP1,
        sharded adapters): their first checkpoint allocates them, as before.
        """
        if self._prepared:
            return
        self._prepared = True
        if self.every_rank:  # the Trainer's own saves go through it too (the folders span ranks)
            writer.prepare_rank_files()
        else:  # save_folder's on one node: the writer's persister and its threads (not collective)
            writer.prepare_state_file()
        trainer = self._trainer()
        if trainer is None or self.fallback_reason is not None:
            return
        if not self.every_rank and compat.defers_flos(trainer):
            warm_flos_gather(trainer)
        if self.every_rank:
            if self.sharded and (self.adapters is not None or not fsdp.is_fsdp2(trainer)):
                return
            state = rank_state(trainer, self.sharded, {}, self.adapters, self.handles)
        elif is_writer():
            state = rank_state(trainer, sharded=False, layouts={}, peft=self.adapters)
        else:
            return
        writer.staging.prepare(state)

    def stage(self, request: Any, epoch: int, staging: StagingArea) -> None:
        """At ``on_step_end``: snapshot the tensors and RNG streams (the writer rank stages them all,
        or, for :attr:`every_rank`, every rank what it writes)."""
        started = time.perf_counter()
        trainer = self._live_trainer()
        staged: StagedState | None = None
        layouts: dict[tuple[Any, ...], Any] | None = None
        flat = prepare = None
        if self.every_rank:
            layouts = {}
            staged = staging.stage(rank_state(trainer, self.sharded, layouts, self.adapters, self.handles))
            flat, prepare = (self.handles.flat, self.handles.prepare) if self.sharded else (None, None)
        elif is_writer():
            staged = staging.stage(rank_state(trainer, sharded=False, layouts={}, peft=self.adapters))
        elif not trainer.args.save_only_model:
            # A few KB: this rank's file goes into the folder now, before the writer rank submits.
            folder = partial_folder(compat.checkpoint_dir(trainer.args.output_dir, request.step))
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(compat.rng_states(trainer.args), folder / compat.rng_state_name(trainer.args))
        self.pending = StagedCheckpoint(
            request, epoch, staged, time.perf_counter() - started, layouts, flat, prepare
        )

    def drop(self, step: int | None = None) -> StagedCheckpoint | None:
        """The Trainer saves the pending snapshot's step itself: free the snapshot (every rank).

        Returns the dropped checkpoint (its ``request`` and ``blocked_s``; its buffers are released),
        or ``None`` when no snapshot is pending (for ``step``, when given).
        """
        pending = self.pending
        if pending is None or (step is not None and pending.request.step != step):
            return None
        self.pending = None
        if pending.staged is not None:
            pending.staged.wait_copied()
            pending.staged.release()
        output_dir = self._live_trainer().args.output_dir
        shutil.rmtree(
            partial_folder(compat.checkpoint_dir(output_dir, pending.request.step)), ignore_errors=True
        )
        self._say(f"spot_callbacks: {TRAINER_SAVES_AT_A_STAGED_STEP}")
        return pending

    def submit(self, writer: SpotEngine, extra: dict[str, Any]) -> tuple[Any, float | None]:
        """Once the step's logs are in ``TrainerState``: copy it, hand the folder to the writer (every rank).

        Returns the pending save's request and the seconds the loop was blocked for it (``None``:
        not persisted, the step was checkpointed already).
        """
        pending, self.pending = self.pending, None
        if pending is None:
            raise RuntimeError("spot_callbacks: submit() without a staged checkpoint (stage() first)")
        started = time.perf_counter()
        trainer = self._live_trainer()
        # Every rank writes: the flos all-gather of store_flos runs beside the DCP writes, on the writers'
        # group, not here in the loop (the Trainer's own counters are left as they are: its next
        # store_flos counts them once).
        flos = trainer.current_flos if self.every_rank and compat.defers_flos(trainer) else None
        trainer_state = compat.trainer_state_at_save(trainer, flush_flos=flos is None)
        step, reason = pending.request.step, pending.request.reason
        folder = compat.checkpoint_dir(trainer.args.output_dir, step)
        stall_s = pending.blocked_s + time.perf_counter() - started

        def write(target: Path) -> dict[str, FileDigest]:
            if pending.staged is None:
                raise RuntimeError("spot_callbacks: this rank staged nothing to write")
            # The files hashed as they were written; the pipeline hashes the others as it uploads them.
            return write_checkpoint_folder(trainer, pending.staged, trainer_state, target, self.adapters)

        on_written = _release_then_allocate(pending)
        if self.every_rank:

            def write_own(target: Path, group: Any) -> dict[str, FileDigest | None]:
                if flos is not None:
                    compat.add_ranks_flos(trainer_state, flos, group.group)
                return write_rank_files(
                    trainer, pending, trainer_state, target, group, self.sharded, self.adapters
                )

            persisted = writer.save_rank_files(
                step, pending.epoch, folder, reason, write_own, stall_s=stall_s, owns_folder=self.owns_folders,
                extra=extra, on_written=on_written,
            )  # fmt: skip
        else:
            persisted = writer.save_folder(
                step, pending.epoch, folder, reason, stall_s=stall_s, owns_folder=self.owns_folders,
                extra=extra, write=write, on_written=on_written,
            )  # fmt: skip
        if persisted:
            self.submitted_steps.append(step)
        return pending.request, stall_s if persisted else None


def warm_flos_gather(trainer: transformers.Trainer) -> None:
    """A throwaway of the all-gather ``Trainer.store_flos`` runs at each checkpoint's ``trainer_state.json``
    (every rank, at the same step boundary: collective): its first call costs 10-15 ms (gloo), paid here
    at the first step boundary instead of by the first checkpoint. Nothing of the Trainer changes."""
    from transformers.trainer_pt_utils import distributed_broadcast_scalars

    distributed_broadcast_scalars([float(trainer.current_flos)], device=trainer.args.device)


def partial_folder(folder: Path) -> Path:
    """Where ``checkpoint-N`` is written until complete (not matched by the Trainer's ``checkpoint-*``)."""
    return folder.with_name(f".{folder.name}.partial")


def write_checkpoint_folder(
    trainer: transformers.Trainer,
    staged: StagedState,
    trainer_state: Any,
    folder: Path,
    peft: adapters.AdapterSnapshot | None = None,
) -> dict[str, FileDigest]:
    """Write the staged checkpoint as ``Trainer._save_checkpoint`` lays it out, then rename it to ``folder``.

    Returns the digests of the files hashed as they were written (see :func:`_write_files`).
    """
    staged.wait_copied()
    partial = partial_folder(folder)
    partial.mkdir(parents=True, exist_ok=True)
    try:
        digests = _write_files(trainer, staged.state, trainer_state, partial, peft=peft)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # a failed write must not keep the disk full
        raise
    if folder.exists():  # a leftover of an earlier run at this step, never committed
        shutil.rmtree(folder)
    os.replace(partial, folder)
    return digests


def _release_then_allocate(pending: StagedCheckpoint) -> Callable[[], None] | None:
    """What the writer calls once ``pending`` is written: release its staged state, then, where its
    step built FSDP1's flat-shard plan, allocate the plan's buffers (after FSDP1's copies are freed:
    the two never hold memory at once)."""
    if pending.staged is None:
        return None
    return then_call(
        pending.staged.release, pending.prepare.allocate if pending.prepare is not None else None
    )


def rank_state(
    trainer: transformers.Trainer,
    sharded: bool,
    layouts: dict[tuple[Any, ...], Any],
    peft: adapters.AdapterSnapshot | None = None,
    handles: fsdp.ShardHandles | None = None,
) -> dict[str, Any]:
    """What this rank writes of ``checkpoint-N``, to stage: as ``Trainer._save_checkpoint`` chooses it.

    ``sharded``: this rank's DTensor shards of model and optimizer, their layouts into ``layouts``
    (``handles``: the run's, which keep them from one checkpoint to the next).
    Otherwise the model and optimizer state where ``args.should_save`` (rank 0, or every node's main
    process with ``save_on_each_node``); of a PEFT model (``peft``) the adapters ``save_pretrained``
    writes. Scheduler and scaler where ``should_save``, the RNG streams
    everywhere; with ``save_only_model`` the model only.
    """
    args = trainer.args
    only_model = bool(args.save_only_model)
    state: dict[str, Any] = {}
    if sharded:
        handles = handles or fsdp.ShardHandles()
        state["model"], state["optimizer"], shard_layouts = handles.shards_of(trainer, peft)
        layouts.update(shard_layouts)
    elif args.should_save:
        state["model"] = peft.state() if peft is not None else _built(trainer.model, "model").state_dict()
        if not only_model:
            state["optimizer"] = _built(trainer.optimizer, "optimizer").state_dict()
    if args.should_save and not only_model:
        state["scheduler"] = _built(trainer.lr_scheduler, "lr_scheduler").state_dict()
        scaler = compat.grad_scaler(trainer)
        state["scaler"] = None if scaler is None else scaler.state_dict()
    if not only_model:
        state["rng"] = compat.rng_states(args)
    return state


_T = TypeVar("_T")


def _built(part: _T | None, name: str) -> _T:
    """``part`` of the Trainer, which exists once training began (a step boundary is past that)."""
    if part is None:
        raise RuntimeError(f"spot_callbacks: the Trainer has no {name} at a step boundary")
    return part


def write_rank_files(
    trainer: transformers.Trainer,
    pending: StagedCheckpoint,
    trainer_state: Any,
    folder: Path,
    group: Any,
    sharded: bool,
    peft: adapters.AdapterSnapshot | None = None,
) -> dict[str, FileDigest | None]:
    """This rank's files of ``checkpoint-N``, written from its staged state (every rank at once): their
    names, each with its digest where it was hashed as written (else ``None``).

    Collective on ``group`` (a :class:`~spot_callbacks.persist.rank_group.RankGroup`): each step is
    agreed on, so a rank that fails fails the checkpoint on all. Each node's main process clears a
    leftover and renames its node's hidden folder to ``folder`` once every rank's files are in; on a
    folder several nodes share, the first rename wins.
    """
    staged = _built(pending.staged, "staged state")
    staged.wait_copied()
    state, step = staged.state, pending.request.step
    partial = partial_folder(folder)
    node_main = trainer.args.local_process_index == 0
    group.agree(lambda: _clear_leftovers(folder) if node_main else None, "clear a leftover", folder, step)
    names: dict[str, FileDigest | None] = {}
    try:
        group.agree(lambda: partial.mkdir(parents=True, exist_ok=True), "create", partial, step)
        if sharded:  # DCP shares a rank's write error with every rank
            layouts = pending.layouts or {}
            shards = {"model": state["model"], "optimizer": state["optimizer"]}
            if pending.flat is not None:  # FSDP1: each parameter's chunk cut from the flat shards here
                shards["model"], shards["optimizer"] = pending.flat.cut(
                    state["model"], state["optimizer"], group.group
                )
            for name, key in ((fsdp.FSDP_MODEL_DIR, "model"), (fsdp.FSDP_OPTIMIZER_DIR, "optimizer")):
                names.update(fsdp.write_dcp_folder(name, key, shards[key], layouts, partial, group.group))
            del shards
        group.agree(
            lambda: names.update(
                _write_own_files(trainer, state, trainer_state, partial, set(names), sharded, peft)
            ),
            "write its files", partial, step,
        )  # fmt: skip
        group.agree(lambda: _publish(partial, folder) if node_main else None, "rename", partial, step)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # a failed write must not keep the disk full
        raise
    return names


def _clear_leftovers(folder: Path) -> None:
    # Of an earlier run at this step, never committed (a committed step is never saved again).
    shutil.rmtree(partial_folder(folder), ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)


def _publish(partial: Path, folder: Path) -> None:
    try:
        os.replace(partial, folder)
    except FileNotFoundError:  # another node's main process renamed the folder they share
        if not folder.is_dir():
            raise


_PER_RANK = re.compile(r"(?:rng_state_|__)(\d+)[_.]")  # rng_state_{rank}.pth, DCP's __{rank}_0.distcp


def _write_own_files(
    trainer: transformers.Trainer,
    state: dict[str, Any],
    trainer_state: Any,
    partial: Path,
    written: set[str],
    sharded: bool,
    peft: adapters.AdapterSnapshot | None = None,
) -> dict[str, FileDigest | None]:
    """Write this rank's non-DCP files into ``partial``: the files this rank wrote there, each with its
    digest where it was hashed as written."""
    args = trainer.args
    if "rng" in state:
        torch.save(state["rng"], partial / compat.rng_state_name(args))
    if not args.should_save:
        return {compat.rng_state_name(args): None} if "rng" in state else {}
    digests = _write_files(trainer, {**state, "rng": None}, trainer_state, partial, sharded, peft)
    rank = str(args.process_index)
    own: dict[str, FileDigest | None] = {}
    for path in sorted(partial.rglob("*")):
        name = path.relative_to(partial).as_posix()
        other_rank = (match := _PER_RANK.match(path.name)) is not None and match.group(1) != rank
        if path.is_file() and name not in written and not other_rank:
            own[name] = digests.get(name)
    return own


def _write_files(
    trainer: transformers.Trainer,
    state: dict[str, Any],
    trainer_state: Any,
    partial: Path,
    sharded: bool = False,
    peft: adapters.AdapterSnapshot | None = None,
) -> dict[str, FileDigest]:
    """The files ``Trainer._save_checkpoint`` writes from the staged ``state`` (its absent or ``None``
    entries are not written: ``save_only_model``). ``sharded``: FSDP's ``save_model`` writes nothing,
    the model and optimizer are the DCP folders; ``peft``: the model is its staged adapters.

    Returns the digests of the files hashed as they were written: ``optimizer.pt``, the bulk, through
    :func:`~spot_callbacks.staging.save_hashed` (its zip records named ``archive/``, not ``optimizer/``:
    ``torch.load`` reads both alike); the files of a few KB keep the Trainer's bytes exactly and are
    hashed as they upload.
    """
    digests: dict[str, FileDigest] = {}
    if not sharded:
        if peft is not None:
            peft.write(state["model"], partial)
        else:
            compat.save_model_weights(trainer, state["model"], partial)
        processing_class = compat.processing_class_of(trainer)
        if processing_class is not None:
            processing_class.save_pretrained(partial)
        torch.save(trainer.args, partial / transformers.trainer.TRAINING_ARGS_NAME)
        if state.get("optimizer") is not None:
            name = transformers.trainer.OPTIMIZER_NAME
            digests[name] = save_hashed(state["optimizer"], partial / name)
    if state.get("scheduler") is not None:
        torch.save(state["scheduler"], partial / transformers.trainer.SCHEDULER_NAME)
    if state.get("scaler") is not None:
        torch.save(state["scaler"], partial / transformers.trainer.SCALER_NAME)
    if state.get("rng") is not None:
        torch.save(state["rng"], partial / compat.rng_state_name(trainer.args))
    trainer_state.save_to_json(os.fspath(partial / transformers.trainer.TRAINER_STATE_NAME))
    return digests
