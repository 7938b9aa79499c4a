"""Hugging Face under accelerate's FSDP plugin: each rank stages its own shards, writes the Trainer's DCP folders.

What ``Trainer._save_checkpoint`` writes under FSDP with ``SHARDED_STATE_DICT`` (transformers 5.24,
accelerate 1.15): ``save_model`` writes nothing (no ``model.safetensors``, no ``training_args.bin``);
``save_fsdp_model`` runs ``dcp.save({"model": get_model_state_dict(model)})`` into
``pytorch_model_fsdp_0/`` and ``save_fsdp_optimizer`` ``dcp.save({"optimizer":
get_optimizer_state_dict(model, optimizer)})`` into ``optimizer_0/``, both with DCP's
``FileSystemWriter`` and ``DefaultSavePlanner`` (one ``__{rank}_0.distcp`` per rank, ``.metadata``
from rank 0); then ``scheduler.pt`` (and ``scaler.pt``) where ``args.should_save``, every rank's
``rng_state_{rank}.pth``, ``trainer_state.json``.

At the step :func:`local_shards` replaces every DTensor of those state dicts by its local shard
(a view: no gather, no copy) and keeps its :class:`ShardLayout`; the run's
:class:`~spot_callbacks.staging.StagingArea` copies the shards. In the background
:func:`write_dcp_folder` wraps the staged buffers back into DTensors of the same global shape,
placements and ranks (``DTensor.from_local`` on a CPU mesh of the same layout, made without
process groups: ``DeviceMesh(..., _init_backend=False)``, private in torch 2.13) and saves them with ``dcp.save``
on the persister's own gloo group with the planner accelerate uses: DCP plans from global
tensors, so ``.metadata`` describes them as in the Trainer's own save and accelerate's
``load_fsdp_model`` / ``load_fsdp_optimizer`` load (and reshard) the folder unchanged.

FSDP1 (``fsdp_version=1``): accelerate takes ``model.state_dict()`` and ``FSDP.optim_state_dict``
under ``FSDP.state_dict_type(SHARDED_STATE_DICT)``, whose values are ``ShardedTensor`` (each
parameter's dim-0 chunk of this rank, cut from the all-gathered flat parameter: a collective at the
step, in the Trainer's save). The first checkpoint of a run takes them and stages their local shards
(FSDP1's own fresh copies) with a :class:`ShardedTensorLayout`; later ones stage the flat shards and
the writers cut the same chunks (:class:`~spot_callbacks.persist.fsdp1_flat.Fsdp1Checkpoints`),
rebuilt into global tensors with the same metadata.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spot_callbacks.persist import handles
from spot_callbacks.persist.dcp_digests import digesting_writer, written_digests
from spot_callbacks.persist.fsdp1_flat import FlatShardPlan
from spot_callbacks.persist.shards import (  # the shard helpers, here where the HF path names them
    ShardedTensorLayout,
    ShardLayout,
    as_global,
    local_shards,
)
from spot_callbacks.store.checksums import FileDigest
from spot_callbacks.store.layout import DCP_METADATA_FILE

__all__ = [
    "ShardHandles",
    "ShardLayout",
    "ShardedTensorLayout",
    "as_global",
    "local_shards",
    "write_dcp_folder",
]

FSDP_MODEL_DIR = "pytorch_model_fsdp_0"  # accelerate's f"{FSDP_MODEL_NAME}_{model_index}"
FSDP_OPTIMIZER_DIR = "optimizer_0"  # accelerate's f"{OPTIMIZER_NAME}_{optimizer_index}"
DCP_METADATA = DCP_METADATA_FILE


def fsdp_blocker(trainer: Any) -> str | None:
    """Why this FSDP Trainer's checkpoint is written by the Trainer, or ``None`` when it is staged."""
    from torch.distributed.fsdp import StateDictType

    plugin = trainer.accelerator.state.fsdp_plugin
    kind = plugin.state_dict_type
    if kind == StateDictType.FULL_STATE_DICT:
        return (
            "FSDP with FULL_STATE_DICT gathers every parameter on rank 0 at the step, the cost a snapshot "
            "would pay too (fsdp_config state_dict_type: SHARDED_STATE_DICT is staged)"
        )
    if kind != StateDictType.SHARDED_STATE_DICT:
        return f"FSDP with {getattr(kind, 'name', kind)} is not staged (SHARDED_STATE_DICT is)"
    return None


def model_and_optimizer_shards(trainer: Any, adapters: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's sharded model and optimizer state dicts, as accelerate's savers take them (DTensor values).

    ``adapters``: a PEFT model's :class:`~spot_callbacks.hf.adapters.AdapterSnapshot`, whose active
    adapter is the model state (``save_fsdp_model(adapter_only=True)``).

    ``cpu_offload`` stays off whatever the plugin says: the staging copies the shards to host memory
    once, and the bytes DCP writes are the same.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    plugin = trainer.accelerator.state.fsdp_plugin
    if getattr(plugin, "fsdp_version", 1) == 1:
        return _fsdp1_shards(trainer.model, trainer.optimizer, plugin)
    options = StateDictOptions(full_state_dict=False, cpu_offload=False)
    if adapters is not None:
        model = adapters.active_state()
    else:
        model = get_model_state_dict(trainer.model, options=options)
    optimizer = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=options)
    return model, optimizer


def _fsdp1_shards(model: Any, optimizer: Any, plugin: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """FSDP1, as accelerate's savers take them: ``model.state_dict()`` and ``FSDP.optim_state_dict`` under
    ``FSDP.state_dict_type(SHARDED_STATE_DICT)`` with the plugin's configs, less the CPU offload.

    Collective on the training group: FSDP1 all-gathers each flat parameter and cuts every
    parameter's own shard from it (``ShardedTensor`` values), as in the Trainer's save.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    configs = [plugin.state_dict_config, plugin.optim_state_dict_config]
    configs = [
        dataclasses.replace(config, offload_to_cpu=False) if config is not None else None
        for config in configs
    ]
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, *configs):
        return model.state_dict(), FSDP.optim_state_dict(model, optimizer)


class ShardHandles(handles.ShardHandles):
    """This rank's FSDP shards as they are staged, found once per run and reused by every checkpoint.

    The first checkpoint takes the state dicts as accelerate's savers do
    (:func:`model_and_optimizer_shards`); later ones reuse their local shards while they are live
    (:class:`spot_callbacks.persist.handles.ShardHandles`). FSDP1 stages its flat shards instead,
    cut into the state dicts' chunks by the writer (:attr:`flat`, a
    :class:`~spot_callbacks.persist.fsdp1_flat.FlatShardPlan`), where the plan applies; PEFT
    adapters take the state dicts at every checkpoint.

    Example:
        >>> ShardHandles().builds
        0
    """

    def __init__(self) -> None:
        super().__init__()
        self.flat: FlatShardPlan | None = None  # FSDP1: the plan the last shards_of staged through
        self.prepare: FlatShardPlan | None = None  # FSDP1: the plan built at the last shards_of, to allocate

    def shards_of(
        self, trainer: Any, adapters: Any = None
    ) -> tuple[Any, Any, dict[tuple[Any, ...], ShardLayout | ShardedTensorLayout]]:
        """This rank's model and optimizer state dicts with local shards for DTensors, and their layouts;
        FSDP1 with a plan (:attr:`flat` set): its flat shards, which the plan's ``cut`` turns into them."""
        self.flat = None

        def take() -> dict[str, Any]:
            model, optimizer = model_and_optimizer_shards(trainer, adapters)
            return {"model": model, "optimizer": optimizer}

        if adapters is None and not is_fsdp2(trainer):
            return self._fsdp1(trainer, take)
        state, layouts = self.local_state(
            trainer.model, {"optimizer": trainer.optimizer}, take, keep=is_fsdp2(trainer) and adapters is None
        )
        return state["model"], state["optimizer"], layouts

    def _fsdp1(
        self, trainer: Any, take: Callable[[], dict[str, Any]]
    ) -> tuple[Any, Any, dict[tuple[Any, ...], Any]]:
        def state_dicts() -> tuple[Any, Any, dict[tuple[Any, ...], Any]]:
            # FSDP1's own state dicts (a collective): fresh copies, nothing to keep.
            state, layouts = self.local_state(
                trainer.model, {"optimizer": trainer.optimizer}, take, keep=False
            )
            return state["model"], state["optimizer"], layouts

        model, optimizer, layouts = self.fsdp1.take(trainer.model, trainer.optimizer, state_dicts)
        self.flat, self.prepare = self.fsdp1.flat, self.fsdp1.prepare
        return model, optimizer, layouts


def is_fsdp2(trainer: Any) -> bool:
    """Whether accelerate wraps the Trainer's model with FSDP2 (``fully_shard``) rather than FSDP1."""
    return getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1) == 2


def write_dcp_folder(
    name: str, key: str, state: Any, layouts: dict[tuple[Any, ...], ShardLayout], folder: Path, group: Any
) -> dict[str, FileDigest | None]:
    """``dcp.save({key: state})`` into ``folder/name`` as accelerate's saver does (the same bytes, hashed
    as they are written); return this rank's files, each with its digest (``None``: hash it at upload).

    Collective on ``group`` (every rank at once). ``layouts`` are those :func:`local_shards` recorded
    for ``state`` under the top-level ``key``. The names are relative to ``folder``.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    target = folder / name
    target.mkdir(parents=True, exist_ok=True)
    writer = digesting_writer(target)  # accelerate's dcp.FileSystemWriter(target), its files hashed
    dcp.save(
        {key: as_global(state, layouts, (key,))},
        storage_writer=writer,
        planner=DefaultSavePlanner(),
        process_group=group,
    )
    digests = written_digests(writer)
    rank = dist.get_rank(group)
    own = [entry for entry in os.listdir(target) if entry.startswith(f"__{rank}_")]
    if rank == 0:
        own.append(DCP_METADATA)
    return {f"{name}/{entry}": digests.get(entry) for entry in sorted(own)}
