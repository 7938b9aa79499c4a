"""A rank's sharded state dicts as they are staged, found once per run and reused by every checkpoint.

Taking FSDP2's sharded state dicts (``get_model_state_dict`` / ``get_optimizer_state_dict``) walks
every parameter and optimizer state each time: ~10 ms at each checkpoint of a 40M-parameter model,
a quarter of the copy it precedes. Their values are views of the live local shards, which the
optimizer updates in place, so :class:`ShardHandles` keeps what :func:`local_shards` made of them
at the first checkpoint and hands the same views to the next, after checking that they are still
views of the live tensors. The HF adapter (``hf/fsdp.py``) and the Lightning one
(``lightning/_compat.py``, ModelParallelStrategy) both take their state dicts through it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from spot_callbacks.persist.fsdp1_flat import Fsdp1Checkpoints
from spot_callbacks.persist.shards import ShardedTensorLayout, ShardLayout, local_shards, packed_param_groups

Layouts = dict[tuple[Any, ...], "ShardLayout | ShardedTensorLayout"]


class ShardHandles:
    """This rank's sharded state dicts, as local shards with their layouts, taken once and reused while live.

    :meth:`local_state` takes the state dicts with ``take`` at the first checkpoint and keeps what
    :func:`local_shards` made of them: views of the live local shards and their layouts. A later
    checkpoint reuses them after checking, by identity, that the model's parameters and buffers,
    each optimizer's parameters and state tensors and their local shards (storage, shape) are those
    it found; only ``param_groups`` (the learning rate moves) is read again, as
    ``Optimizer.state_dict`` packs it. Anything else (another tensor, a resharded or reloaded
    parameter, a shard of another shape, a state that is not tensors only, a state dict that holds
    a tensor made for it rather than a view) takes the state dicts again.

    Example:
        >>> ShardHandles().builds
        0
    """

    def __init__(self) -> None:
        self._kept: _Kept | None = None
        self.builds = 0  # checkpoints that took the state dicts (the first, then one per change)
        # FSDP1 (HF's plugin, Lightning's FSDPStrategy): the run's flat-shard plan and its state
        self.fsdp1 = Fsdp1Checkpoints()

    def local_state(
        self,
        model: Any,
        optimizers: Mapping[str, Any],
        take: Callable[[], dict[str, Any]],
        keep: bool = True,
    ) -> tuple[dict[str, Any], Layouts]:
        """The state dicts ``take()`` returns, DTensors replaced by their local shards, and their layouts.

        ``take()`` returns named state dicts: the entries named in ``optimizers`` are those
        optimizers' ``{"state", "param_groups"}`` dicts, the others the model's. Each one's layouts
        are keyed under its name. ``keep=False``: take them and keep nothing (a state they are not
        views of, such as FSDP1's gathered shards).
        """
        kept = self._kept
        if kept is not None and kept.matches(model, optimizers) and kept.live():
            return kept.state(), kept.layouts
        self._kept = None
        self.builds += 1
        state = take()
        layouts: Layouts = {}
        local = {name: local_shards(value, layouts, (name,)) for name, value in state.items()}
        if keep:
            self._kept = _Kept.of(model, dict(optimizers), local, layouts)
        return local, layouts


class _Kept:
    """What :class:`ShardHandles` keeps: the local state dicts, and the live tensors they were taken from."""

    def __init__(
        self,
        model: Any,
        optimizers: dict[str, Any],
        state: dict[str, Any],
        group_params: dict[str, list[list[Any]]],
        layouts: Layouts,
    ) -> None:
        self.model, self.optimizers, self.layouts = model, optimizers, layouts
        # The model's state dicts whole, the optimizers' "state" only (their groups are read again).
        self.kept_state = {
            name: value["state"] if name in optimizers else value for name, value in state.items()
        }
        self.group_params = group_params  # each param group's "params" as the state dict names them
        self.sources, self.locals = _live_sources(model, optimizers.values())

    @classmethod
    def of(
        cls, model: Any, optimizers: dict[str, Any], state: dict[str, Any], layouts: Layouts
    ) -> _Kept | None:
        """The handles, or ``None`` where reusing them could stage something else than the state dicts."""
        group_params: dict[str, list[list[Any]]] = {}
        for name, optimizer in optimizers.items():
            packed = state.get(name)
            if type(packed) is not dict or set(packed) != {"state", "param_groups"}:
                return None
            groups = packed["param_groups"]
            if type(groups) is not list or len(groups) != len(optimizer.param_groups):
                return None
            group_params[name] = [list(group.get("params", ())) for group in groups]
            if not _plain_equal(packed_param_groups(optimizer, group_params[name]), groups):
                return None  # the optimizer's state_dict packs its groups otherwise: take it every time
        kept = cls(model, optimizers, state, group_params, layouts)
        if not _tensors_only(kept.kept_state):
            return None  # a number (a step count) would be stale at the next checkpoint
        live = {ptr for ptr, _ in kept.locals}
        if not all(leaf.data_ptr() in live for leaf in _leaves(kept.kept_state)):
            return None  # a tensor made for the state dict, not a view of a live one: it would go stale
        return kept

    def matches(self, model: Any, optimizers: Mapping[str, Any]) -> bool:
        """Whether ``model`` and ``optimizers`` are the objects (under the same names) the handles were taken of."""
        return (
            self.model is model
            and list(optimizers) == list(self.optimizers)
            and all(optimizers[name] is optimizer for name, optimizer in self.optimizers.items())
        )

    def live(self) -> bool:
        """Whether the live tensors are the ones the kept views were taken from (same objects and shards)."""
        sources, locals_ = _live_sources(self.model, self.optimizers.values())
        return (
            len(sources) == len(self.sources)
            and all(now is then for now, then in zip(sources, self.sources, strict=True))
            and locals_ == self.locals
        )

    def state(self) -> dict[str, Any]:
        return {
            name: (
                {
                    "state": value,
                    "param_groups": packed_param_groups(self.optimizers[name], self.group_params[name]),
                }
                if name in self.optimizers
                else value
            )
            for name, value in self.kept_state.items()
        }


def _live_sources(model: Any, optimizers: Any) -> tuple[list[Any], list[tuple[int, torch.Size]]]:
    """The tensors a sharded state dict is taken from, and where each one's local shard lives."""
    sources: list[Any] = [*model.parameters(), *model.buffers()]
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            sources.extend(group["params"])
        for param, state in optimizer.state.items():
            sources.append(param)
            sources.extend(value for value in state.values() if isinstance(value, torch.Tensor))
    locals_ = [_local_key(source) for source in sources]
    return sources, locals_


def _local_key(tensor: Any) -> tuple[int, torch.Size]:
    # A DTensor's local shard is its _local_tensor (what to_local() returns without autograd), read
    # directly: to_local() costs a dispatch per tensor at every checkpoint; this walk is per tensor.
    local = getattr(tensor, "_local_tensor", None)
    if local is None:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.data_ptr(), local.shape


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
