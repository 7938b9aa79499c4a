"""The FSDP2 shards a staged HF checkpoint copies are found once per run and reused while they are live.

One process, an FSDP2 (``fully_shard``) model on a gloo CPU mesh: what :class:`ShardHandles` returns
at a later checkpoint must equal what accelerate's savers would take then (the state dicts'
local shards and ``param_groups``), and it takes the state dicts again once a tensor is replaced.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from spot_callbacks.hf import fsdp


@pytest.fixture
def sharded(tmp_path: Path) -> Iterator[Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        plugin = types.SimpleNamespace(fsdp_version=2)
        accelerator = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin))
        trainer = types.SimpleNamespace(model=model, optimizer=optimizer, accelerator=accelerator)
        train_step(trainer)
        yield trainer
    finally:
        dist.destroy_process_group()


def train_step(trainer: Any) -> None:
    trainer.model(torch.randn(3, 4)).sum().backward()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad()


def as_savers_take_it(trainer: Any) -> tuple[Any, Any, dict[Any, Any]]:
    layouts: dict[Any, Any] = {}
    model, optimizer = fsdp.model_and_optimizer_shards(trainer)
    return (
        fsdp.local_shards(model, layouts, ("model",)),
        fsdp.local_shards(optimizer, layouts, ("optimizer",)),
        layouts,
    )


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
        assert torch.equal(actual, expected)
    else:
        assert actual == expected


def test_later_checkpoints_reuse_the_shards_and_stage_what_the_savers_would(sharded: Any) -> None:
    handles = fsdp.ShardHandles()
    handles.shards_of(sharded)
    for lr in (0.05, 0.01):  # training moves the weights, the moments, the step and the learning rate
        train_step(sharded)
        sharded.optimizer.param_groups[0]["lr"] = lr
        model, optimizer, layouts = handles.shards_of(sharded)
        expected_model, expected_optimizer, expected_layouts = as_savers_take_it(sharded)
        assert_same(model, expected_model)
        assert_same(optimizer, expected_optimizer)
        assert optimizer["param_groups"][0]["lr"] == lr
        assert layouts.keys() == expected_layouts.keys()
    assert handles.builds == 1


def test_a_replaced_tensor_takes_the_state_dicts_again(sharded: Any) -> None:
    handles = fsdp.ShardHandles()
    handles.shards_of(sharded)
    # A reload that brings new tensors (a resume from a copy): the kept views would be stale.
    sharded.optimizer.load_state_dict(copy.deepcopy(sharded.optimizer.state_dict()))
    train_step(sharded)
    _, optimizer, _ = handles.shards_of(sharded)
    assert handles.builds == 2
    assert_same(optimizer, as_savers_take_it(sharded)[1])
    handles.shards_of(sharded)
    assert handles.builds == 2  # and keeps the new ones


def test_the_ranks_flos_are_added_as_store_flos_sums_them(sharded: Any) -> None:
    """The staged FSDP checkpoint's ``total_flos``: the all-gather ``Trainer.store_flos`` runs at a save,
    run on the writers' group instead, with the same float32 arithmetic (here 2**24 + 1 rounds)."""
    from transformers.trainer_pt_utils import distributed_broadcast_scalars

    from spot_callbacks.hf import _compat as compat

    current = float(2**24 + 1)
    state = types.SimpleNamespace(total_flos=1000.0)
    compat.add_ranks_flos(state, current, dist.group.WORLD)
    expected = 1000.0 + distributed_broadcast_scalars([current], device=torch.device("cpu")).sum().item()
    assert state.total_flos == expected
    assert state.total_flos != 1000.0 + current  # float32, as store_flos sums them


def test_the_dcp_folders_are_the_savers_bytes_and_come_with_their_files_digests(
    sharded: Any, tmp_path: Path
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from spot_callbacks.store.checksums import digest_local_file

    model, optimizer, layouts = as_savers_take_it(sharded)
    staged = {"model": copy.deepcopy(model), "optimizer": copy.deepcopy(optimizer)}
    for key in ("model", "optimizer"):
        written = fsdp.write_dcp_folder(key, key, staged[key], layouts, tmp_path / "ours", dist.group.WORLD)
        files = {p.relative_to(tmp_path / "ours").as_posix() for p in (tmp_path / "ours" / key).iterdir()}
        assert set(written) == files and f"{key}/.metadata" in files
        for name, digest in written.items():
            assert digest == digest_local_file(tmp_path / "ours" / name), name  # hashed as written
    # accelerate's saver, dcp.save through a plain FileSystemWriter: the same shard bytes
    live_model, live_optimizer = fsdp.model_and_optimizer_shards(sharded)
    for key, state in (("model", live_model), ("optimizer", live_optimizer)):
        dcp.save(
            {key: state},
            storage_writer=dcp.FileSystemWriter(tmp_path / "savers" / key),
            planner=DefaultSavePlanner(),
        )
        shard = f"{key}/__0_0.distcp"
        assert (tmp_path / "ours" / shard).read_bytes() == (tmp_path / "savers" / shard).read_bytes()
