"""A rank's shards of a sharded state (DTensor, FSDP1's ``ShardedTensor``) as plain local tensors, and back.

:func:`local_shards` replaces every DTensor of a state by its local shard (a view: no gather, no
copy) and keeps its :class:`ShardLayout`, so a :class:`~spot_callbacks.staging.StagingArea` copies
the shards into its reused buffers like any tensor; :func:`as_global` wraps the staged buffers
back into DTensors of the same global shape, placements and ranks (``DTensor.from_local`` on a CPU
mesh of the same layout, made without process groups: ``DeviceMesh(..., _init_backend=False)``,
private in torch 2.13), which ``dcp.save`` plans from as from the training run's own.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ShardLayout:
    """Where one DTensor's local shard sits in its global tensor: enough to rebuild it over a staged copy.

    Example:
        >>> layout = ShardLayout(mesh=None, placements=(), shape=torch.Size([8, 4]), stride=(4, 1))
        >>> layout.shape
        torch.Size([8, 4])
    """

    mesh: Any  # a CPU DeviceMesh of the same ranks and layout as the DTensor's (no process groups)
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]


@dataclass(frozen=True)
class ShardedTensorLayout:
    """FSDP1's ``ShardedTensor``: its global metadata and this rank's shards' (placed on CPU), to rebuild it.

    Example:
        >>> ShardedTensorLayout(metadata=None, local=()).local
        ()
    """

    metadata: Any  # ShardedTensorMetadata: every rank's shards (offsets, sizes), the tensor's properties
    local: tuple[Any, ...]  # ShardMetadata of this rank's local shards, in order


class _CpuMeshes:
    """One CPU mesh per training mesh (a run has one or two): built once, reused by every checkpoint."""

    def __init__(self) -> None:
        self._made: dict[int, tuple[Any, Any]] = {}

    def of(self, mesh: Any) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        if mesh.device_type == "cpu":
            return mesh
        made = self._made.get(id(mesh))
        if made is None or made[0] is not mesh:
            cpu = DeviceMesh("cpu", mesh.mesh, mesh_dim_names=mesh.mesh_dim_names, _init_backend=False)
            made = self._made[id(mesh)] = (mesh, cpu)
        return made[1]


_MESHES = _CpuMeshes()


def local_shards(
    state: Any, layouts: dict[tuple[Any, ...], ShardLayout | ShardedTensorLayout], path: tuple[Any, ...] = ()
) -> Any:
    """``state`` with every DTensor replaced by its local shard; each one's layout goes into ``layouts``.

    Example:
        >>> layouts = {}
        >>> local_shards({"w": torch.ones(2), "step": 3}, layouts), layouts
        ({'w': tensor([1., 1.]), 'step': 3}, {})
    """
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        layouts[path] = ShardLayout(
            _MESHES.of(state.device_mesh), tuple(state.placements), state.shape, tuple(state.stride())
        )
        return state.to_local()
    if isinstance(state, ShardedTensor):
        shards = state.local_shards()
        metadata = copy.copy(state.metadata())
        metadata.shards_metadata = [_on_cpu(shard) for shard in metadata.shards_metadata]
        layouts[path] = ShardedTensorLayout(metadata, tuple(_on_cpu(shard.metadata) for shard in shards))
        return [shard.tensor for shard in shards]
    if isinstance(state, dict):  # dict, and the OrderedDict of an FSDP1 model.state_dict()
        copied = {key: local_shards(value, layouts, (*path, key)) for key, value in state.items()}
        return copied if type(state) is dict else type(state)(copied)
    if type(state) is list:
        return [local_shards(value, layouts, (*path, index)) for index, value in enumerate(state)]
    return state


def as_global(state: Any, layouts: dict[tuple[Any, ...], Any], path: tuple[Any, ...] = ()) -> Any:
    """Inverse of :func:`local_shards` over staged buffers: DTensors on CPU meshes, FSDP1's
    ``ShardedTensor`` of the same global metadata; no data copied."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensorBase
    from torch.distributed.tensor import DTensor

    layout = layouts.get(path)
    if isinstance(layout, ShardLayout):
        return DTensor.from_local(
            state, layout.mesh, layout.placements, run_check=False, shape=layout.shape, stride=layout.stride
        )
    if isinstance(layout, ShardedTensorLayout):
        shards = [Shard(tensor, metadata) for tensor, metadata in zip(state, layout.local, strict=True)]
        # The base class's constructor (a ShardedTensor all the same): it keeps the training run's
        # tensor properties, which DCP writes into .metadata, where the subclass's would check them
        # against the staged buffers (pinned on CUDA) and need a process group.
        return ShardedTensorBase._init_from_local_shards_and_global_metadata(shards, layout.metadata)
    if isinstance(state, dict):
        copied = {key: as_global(value, layouts, (*path, key)) for key, value in state.items()}
        return copied if type(state) is dict else type(state)(copied)
    if type(state) is list:
        return [as_global(value, layouts, (*path, index)) for index, value in enumerate(state)]
    return state


def _on_cpu(shard: Any) -> Any:
    """A ``ShardMetadata`` placed on the same rank's CPU (where the staged shard lives)."""
    placement = f"rank:{shard.placement.rank()}/cpu"
    return dataclasses.replace(shard, placement=placement)


def packed_param_groups(optimizer: Any, group_params: list[list[Any]]) -> list[dict[str, Any]]:
    """``optimizer.param_groups`` as ``Optimizer.state_dict`` packs them, each group's ``"params"`` the
    names a sharded state dict gave its parameters (``group_params``, by group).

    Example:
        >>> optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.5)
        >>> packed_param_groups(optimizer, [["w"]])[0]["params"], packed_param_groups(optimizer, [["w"]])[0]["lr"]
        (['w'], 0.5)
    """
    return [
        {**{key: value for key, value in group.items() if key != "params"}, "params": list(params)}
        for group, params in zip(optimizer.param_groups, group_params, strict=True)
    ]
