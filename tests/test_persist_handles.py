"""The sharded state dicts a checkpoint stages are taken once per run and reused while they are views of live tensors.

One process, an FSDP2 (``fully_shard``) model on a gloo CPU mesh with two optimizers, taken as the
Lightning adapter takes them (``get_model_state_dict`` / ``get_optimizer_state_dict`` under
ModelParallelStrategy's keys): what :class:`ShardHandles` returns at a later checkpoint must equal a
fresh take then, and a changed tensor (new storage, new shape, a reloaded optimizer, another
optimizer) must make it take the state dicts again.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from spot_callbacks.persist.handles import ShardHandles
from spot_callbacks.persist.shards import local_shards


class Run:
    def __init__(self, mesh: Any) -> None:
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        for layer in self.model:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizers = {
            "optimizer_0": torch.optim.AdamW(self.model[0].parameters(), lr=0.1),
            "optimizer_1": torch.optim.SGD(self.model[1].parameters(), lr=0.1, momentum=0.9),
        }
        self.step()

    def step(self) -> None:
        self.model(torch.randn(3, 4)).sum().backward()
        for optimizer in self.optimizers.values():
            optimizer.step()
            optimizer.zero_grad()

    def take(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state: dict[str, Any] = {"state_dict": get_model_state_dict(self.model)}
        for name, optimizer in self.optimizers.items():
            state[name] = get_optimizer_state_dict(self.model, optimizer)
        return state

    def checkpoint(self, handles: ShardHandles) -> tuple[dict[str, Any], dict[Any, Any]]:
        return handles.local_state(self.model, self.optimizers, self.take)

    def fresh(self) -> tuple[dict[str, Any], dict[Any, Any]]:
        layouts: dict[Any, Any] = {}
        state = {name: local_shards(value, layouts, (name,)) for name, value in self.take().items()}
        return state, layouts


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield Run(init_device_mesh("cpu", (1,)))
    finally:
        dist.destroy_process_group()


def assert_same(actual: Any, expected: Any) -> None:
    if isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            assert_same(actual[key], expected[key])
    elif isinstance(expected, list):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_same(a, e)
    elif isinstance(expected, torch.Tensor):
        assert actual.shape == expected.shape
        assert torch.equal(actual, expected)
    else:
        assert actual == expected


def assert_as_taken_now(run: Run, handles: ShardHandles) -> None:
    state, layouts = run.checkpoint(handles)
    expected, expected_layouts = run.fresh()
    assert_same(state, expected)
    assert layouts == expected_layouts


def test_later_checkpoints_reuse_the_views_and_stage_what_a_fresh_take_would(run: Run) -> None:
    handles = ShardHandles()
    run.checkpoint(handles)
    for lr in (0.05, 0.01):  # training moves the weights, the moments, the steps and the learning rates
        run.step()
        run.optimizers["optimizer_1"].param_groups[0]["lr"] = lr
        assert_as_taken_now(run, handles)
        assert run.checkpoint(handles)[0]["optimizer_1"]["param_groups"][0]["lr"] == lr
    assert handles.builds == 1


def replace_storage(run: Run) -> None:
    # The same Parameter, a new local shard: what FSDP2's reset_sharded_param does after
    # nn.Module._apply or load_state_dict(assign=True).
    weight = run.model[1].weight
    weight._local_tensor = torch.full_like(weight.to_local(), 7.0)


def replace_shape(run: Run) -> None:
    # The same Parameter and storage, a shard of another shape (the first element only).
    bias = run.model[1].bias
    bias._local_tensor = bias.to_local().detach()[:1]


def replace_parameter(run: Run) -> None:
    from torch.distributed.tensor import DTensor

    bias = run.model[1].bias
    local = torch.full_like(bias.to_local(), 5.0)
    replaced = torch.nn.Parameter(DTensor.from_local(local, bias.device_mesh, bias.placements))
    run.model[1].bias = replaced
    optimizer = run.optimizers["optimizer_1"]  # which trains the new one, its state carried over
    params = optimizer.param_groups[0]["params"]
    params[next(index for index, param in enumerate(params) if param is bias)] = replaced
    optimizer.state[replaced] = optimizer.state.pop(bias)


def reload_optimizer(run: Run) -> None:  # a resume from a copy: new state tensors, same optimizer
    optimizer = run.optimizers["optimizer_0"]
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))


def new_optimizer(run: Run) -> None:
    run.optimizers["optimizer_1"] = torch.optim.SGD(run.model[1].parameters(), lr=0.2)


@pytest.mark.parametrize(
    "change", [replace_storage, replace_shape, replace_parameter, reload_optimizer, new_optimizer]
)
def test_a_changed_tensor_or_optimizer_takes_the_state_dicts_again_and_keeps_the_new_ones(
    run: Run, change: Any
) -> None:
    handles = ShardHandles()
    run.checkpoint(handles)
    change(run)
    assert_as_taken_now(run, handles)  # a stale view would hold the old values (or shape)
    assert handles.builds == 2
    assert_as_taken_now(run, handles)
    assert handles.builds == 2


def test_keep_false_takes_the_state_dicts_every_time(run: Run) -> None:
    handles = ShardHandles()
    for _ in range(2):
        handles.local_state(run.model, run.optimizers, run.take, keep=False)
    assert handles.builds == 2
