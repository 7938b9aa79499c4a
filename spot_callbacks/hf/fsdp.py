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
step, in the Trainer's save as here). Their local shards are staged with a
:class:`ShardedTensorLayout`, and rebuilt over the buffers with the same global metadata.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from spot_callbacks.persist.shards import (  # the shard helpers, here where the HF path names them
    ShardedTensorLayout,
    ShardLayout,
    as_global,
    local_shards,
)
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


class ShardHandles:
    """This rank's FSDP2 shards as they are staged, found once per run and reused by every checkpoint.

    The first checkpoint takes the state dicts as accelerate's savers do
    (:func:`model_and_optimizer_shards`) and keeps what :func:`local_shards` made of them: views of
    the live local shards, which the optimizer updates in place, and their layouts. A later
    checkpoint reuses them after checking, by identity, that the model's parameters and buffers,
    the optimizer's parameters and state tensors and their local shards (storage, shape) are those
    it found; only ``param_groups`` (the learning rate moves) is read again, as
    ``Optimizer.state_dict`` packs it. Anything else (another tensor, a resharded or reloaded
    parameter, FSDP1, PEFT adapters, a state that is not tensors only) takes the state dicts again.

    Example:
        >>> ShardHandles().builds
        0
    """

    def __init__(self) -> None:
        self._kept: _Kept | None = None
        self.builds = 0  # checkpoints that took the state dicts (the first, then one per change)

    def local_state(
        self, trainer: Any, adapters: Any = None
    ) -> tuple[Any, Any, dict[tuple[Any, ...], ShardLayout | ShardedTensorLayout]]:
        """This rank's model and optimizer state dicts with local shards for DTensors, and their layouts."""
        model, optimizer = trainer.model, trainer.optimizer
        kept = self._kept
        if (
            kept is not None
            and kept.model is model
            and kept.optimizer is optimizer
            and kept.live(model, optimizer)
        ):
            return kept.model_state, kept.optimizer_state(optimizer), kept.layouts
        self._kept = None
        self.builds += 1
        model_state, optimizer_state = model_and_optimizer_shards(trainer, adapters)
        layouts: dict[tuple[Any, ...], Any] = {}
        model_local = local_shards(model_state, layouts, ("model",))
        optimizer_local = local_shards(optimizer_state, layouts, ("optimizer",))
        fsdp2 = getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1) == 2
        if fsdp2 and adapters is None:
            self._kept = _Kept.of(model, optimizer, model_local, optimizer_local, layouts)
        return model_local, optimizer_local, layouts


class _Kept:
    """What :class:`ShardHandles` keeps: the local state dicts, and the live tensors they were taken from."""

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        model_state: Any,
        optimizer_state: dict[str, Any],
        group_params: list[list[Any]],
        layouts: dict[tuple[Any, ...], Any],
    ) -> None:
        self.model, self.optimizer, self.layouts = model, optimizer, layouts
        self.model_state, self.state = model_state, optimizer_state["state"]
        self.group_params = group_params  # each param group's "params" as the state dict names them
        self.sources, self.locals = _live_sources(model, optimizer)

    @classmethod
    def of(
        cls,
        model: Any,
        optimizer: Any,
        model_state: Any,
        optimizer_state: Any,
        layouts: dict[tuple[Any, ...], Any],
    ) -> _Kept | None:
        """The handles, or ``None`` where reusing them could stage something else than the state dicts."""
        if type(optimizer_state) is not dict or set(optimizer_state) != {"state", "param_groups"}:
            return None
        if not (_tensors_only(model_state) and _tensors_only(optimizer_state["state"])):
            return None  # a number (a step count) would be stale at the next checkpoint
        groups = optimizer_state["param_groups"]
        if type(groups) is not list or len(groups) != len(optimizer.param_groups):
            return None
        group_params = [list(group.get("params", ())) for group in groups]
        if not _plain_equal(_param_groups(optimizer, group_params), groups):
            return None  # the optimizer's state_dict packs its groups otherwise: take it every time
        kept = cls(model, optimizer, model_state, optimizer_state, group_params, layouts)
        live = {ptr for ptr, _ in kept.locals}
        if not all(leaf.data_ptr() in live for leaf in _leaves([model_state, optimizer_state["state"]])):
            return None  # a tensor made for the state dict, not a view of a live one: it would go stale
        return kept

    def live(self, model: Any, optimizer: Any) -> bool:
        """Whether the live tensors are the ones the kept views were taken from (same objects and shards)."""
        sources, locals_ = _live_sources(model, optimizer)
        return (
            len(sources) == len(self.sources)
            and all(now is then for now, then in zip(sources, self.sources, strict=True))
            and locals_ == self.locals
        )

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {"state": self.state, "param_groups": _param_groups(optimizer, self.group_params)}


def _live_sources(model: Any, optimizer: Any) -> tuple[list[Any], list[tuple[int, torch.Size]]]:
    """The tensors a sharded state dict is taken from, and where each one's local shard lives."""
    sources: list[Any] = [*model.parameters(), *model.buffers()]
    for group in optimizer.param_groups:
        sources.extend(group["params"])
    for param, state in optimizer.state.items():
        sources.append(param)
        sources.extend(value for value in state.values() if isinstance(value, torch.Tensor))
    with torch.no_grad():  # DTensor.to_local() is then the local tensor itself, no autograd node
        locals_ = [_local_key(source) for source in sources]
    return sources, locals_


def _local_key(tensor: Any) -> tuple[int, torch.Size]:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.data_ptr(), local.shape


def _param_groups(optimizer: Any, group_params: list[list[Any]]) -> list[dict[str, Any]]:
    """``param_groups`` as ``Optimizer.state_dict`` packs them, with the kept names of their parameters."""
    return [
        {**{key: value for key, value in group.items() if key != "params"}, "params": list(params)}
        for group, params in zip(optimizer.param_groups, group_params, strict=True)
    ]


def _leaves(state: Any) -> list[torch.Tensor]:
    if isinstance(state, dict):
        return [leaf for value in state.values() for leaf in _leaves(value)]
    if type(state) is list:
        return [leaf for value in state for leaf in _leaves(value)]
    return [state] if isinstance(state, torch.Tensor) else []


def _tensors_only(state: Any) -> bool:
    if isinstance(state, dict):
        return all(_tensors_only(value) for value in state.values())
    if type(state) is list:
        return all(_tensors_only(value) for value in state)
    return isinstance(state, torch.Tensor)


def _plain_equal(a: Any, b: Any) -> bool:
    """Equal plain data (a tensor anywhere: not equal, as this is used to decide a reuse is safe)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_plain_equal(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_plain_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value whose equality is not a bool
        return False


def write_dcp_folder(
    name: str, key: str, state: Any, layouts: dict[tuple[Any, ...], ShardLayout], folder: Path, group: Any
) -> list[str]:
    """``dcp.save({key: state})`` into ``folder/name`` as accelerate's saver does; return this rank's files.

    Collective on ``group`` (every rank at once). ``layouts`` are those :func:`local_shards` recorded
    for ``state`` under the top-level ``key``. The names are relative to ``folder``.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    target = folder / name
    target.mkdir(parents=True, exist_ok=True)
    dcp.save(
        {key: as_global(state, layouts, (key,))},
        storage_writer=dcp.FileSystemWriter(target),
        planner=DefaultSavePlanner(),
        process_group=group,
    )
    rank = dist.get_rank(group)
    own = [entry for entry in os.listdir(target) if entry.startswith(f"__{rank}_")]
    if rank == 0:
        own.append(DCP_METADATA)
    return [f"{name}/{entry}" for entry in sorted(own)]
