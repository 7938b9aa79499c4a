"""One rank of an FSDP1 run on CPU (gloo): the flat-shard plan's cut against FSDP1's own sharded state dicts.

Run under ``torchrun --nproc-per-node N``. The model has parameters whose dim 0 does not divide by
the ranks, one smaller than the ranks, a bias, a buffer and a tied weight, wrapped in nested FSDP1
units. After a few AdamW steps the plan is built from the first "checkpoint"'s state dicts; two
steps later this rank's flat shards are copied (as the staging copies them), the state dicts are
taken again (the collective the plan avoids), training moves on one more step, and the plan cuts
the copies on a gloo group of its own. Writes ``{out}/rank{R}.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

warnings.filterwarnings(
    "ignore", category=FutureWarning
)  # FSDP1 and ShardedTensor are deprecated, tested all the same
warnings.filterwarnings("ignore", message=".*(_get_pg_default_device|Multiple backends).*")


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.blocks = torch.nn.ModuleList(
            [
                torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 6))
                for _ in range(2)
            ]
        )
        self.small = torch.nn.Linear(6, 1)  # dim 0 smaller than the ranks
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.tensor([1.5, 0.5, 2.0]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).sum() + self.small(x).sum() * self.scale.sum()


def clone_tree(tree: Any) -> Any:
    if isinstance(tree, dict):
        return type(tree)({key: clone_tree(value) for key, value in tree.items()})
    if isinstance(tree, (list, tuple)):
        return type(tree)(clone_tree(value) for value in tree)
    return tree.detach().clone() if torch.is_tensor(tree) else tree


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--orig-params", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    from spot_callbacks.persist.fsdp1_flat import (
        FlatShardPlan,
        _at,
        _Chunk,
        _chunk_shape,
        _leaves,
        _same,
        adopt_copies,
        decide,
    )
    from spot_callbacks.persist.shards import local_shards
    from spot_callbacks.staging import StagingArea

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Tiny()
    wrap = {"device_id": torch.device("cpu"), "use_orig_params": bool(args.orig_params)}
    for index, block in enumerate(model.blocks):
        model.blocks[index] = FSDP(block, **wrap)
    fsdp = FSDP(model, **wrap)
    optimizer = torch.optim.AdamW(fsdp.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)

    def step() -> None:
        fsdp(torch.randint(0, 11, (4, 5), generator=generator)).backward()
        optimizer.step()
        optimizer.zero_grad()

    def sharded_state() -> tuple[Any, Any, dict[Any, Any]]:
        layouts: dict[Any, Any] = {}
        with FSDP.state_dict_type(fsdp, StateDictType.SHARDED_STATE_DICT):
            model_state, optimizer_state = fsdp.state_dict(), FSDP.optim_state_dict(fsdp, optimizer)
        return (
            local_shards(model_state, layouts, ("model",)),
            local_shards(optimizer_state, layouts, ("optimizer",)),
            layouts,
        )

    for _ in range(3):
        step()
    first_model, first_optimizer, layouts = sharded_state()
    plan = FlatShardPlan.of(fsdp, optimizer, first_model, first_optimizer, layouts)
    result: dict[str, Any] = {"plan": plan is not None}
    if plan is not None:
        writers = dist.new_group(backend="gloo")  # the persister's own group, as the writer has
        # Checked at the step that built it, against the state dicts of that step.
        result["checked"] = plan.check(first_model, first_optimizer)
        # That checkpoint stages FSDP1's own copies as they are: no second copy of the shard.
        area = StagingArea(pin_memory=False)
        trees = {"model": first_model, "optimizer": first_optimizer}
        result["chunk_bytes"] = sum(
            chunk.numel() * chunk.element_size()
            for path, slot in plan.slots.items()
            if isinstance(slot, _Chunk)
            for chunk in _at(trees, path)
        )
        result["adopted"] = adopt_copies(fsdp, optimizer, trees, layouts)
        first = area.stage(trees)
        result["first_buffer_bytes"] = area.buffer_bytes  # the plain tensors only
        first.release()
        plan.allocate()  # what the writer does once that checkpoint is written
        for _ in range(2):
            step()
        result["decision"] = decide(plan, fsdp, optimizer)
        staged = area.stage(plan.sources())  # what the step stages: the flat shards, into the plan's buffers
        expected_model, expected_optimizer, _ = sharded_state()
        step()  # training goes on while the writer cuts
        model_cut, optimizer_cut = plan.cut(*staged.state, group=writers)
        result["model_equal"] = _same(model_cut, expected_model)
        result["optimizer_equal"] = _same(optimizer_cut, expected_optimizer)
        result["keys"] = sorted(str(key) for key in expected_model)
        result["moved"] = not _same(model_cut, first_model)
        # The chunks are cut into the buffers the flat shards were staged in, each its own exact storage.
        arenas = [
            (arena.data_ptr(), arena.data_ptr() + arena.numel() * arena.element_size())
            for arena in plan._arena.values()
        ]
        chunks = [
            leaf[0] for _, leaf in _leaves({"model": model_cut, "optimizer": optimizer_cut})
            if type(leaf) is list and len(leaf) == 1 and torch.is_tensor(leaf[0]) and leaf[0].numel()
        ]  # fmt: skip
        result["chunks"] = len(chunks)
        result["in_place"] = all(
            any(low <= chunk.data_ptr() < high for low, high in arenas)
            and chunk.untyped_storage().nbytes() == chunk.numel() * chunk.element_size()
            for chunk in chunks
        )
        result["staging_buffer_bytes"] = (
            area.buffer_bytes
        )  # the plain tensors only: the plan holds the shards
        staged.release()
        result["arena_bytes"] = plan.arena_bytes()
        result["shard_bytes"] = sum(
            unit.shard_numel * unit.flat._local_shard.element_size() * (1 + len(plan.state_names))
            for unit in plan.units
        )
        # Each rank receives its own chunks' elements and nothing else (an all-to-all, not an all-gather).
        own = {
            (slot.unit, slot.source, slot.index): _chunk_shape(plan.units[slot.unit], slot).numel()
            for slot in plan.slots.values()
            if isinstance(slot, _Chunk) and slot.rows is not None
        }
        result["received"] = sum(sum(exchange.receive_splits) for exchange in plan._exchanges.values())
        result["own_chunk_elements"] = sum(own.values())
        # One rank's state dicts differing from its flat shards fails the check on every rank.
        model_now, optimizer_now, layouts_now = sharded_state()
        other = FlatShardPlan.of(fsdp, optimizer, model_now, optimizer_now, layouts_now)
        assert other is not None
        if rank == 0:
            path = next(path for path, slot in other.slots.items() if isinstance(slot, _Chunk) and slot.rows)
            _at({"model": model_now, "optimizer": optimizer_now}, path)[0].view(-1)[0] += 1.0
        result["wrong_checked"] = other.check(model_now, optimizer_now)
        result["wrong_decision"] = decide(other, fsdp, optimizer)
        # A rank whose state dicts are not shaped as the plan expects fails the check on every rank,
        # and takes part in its collectives all the same (no rank is left waiting in one).
        model_now, optimizer_now, layouts_now = sharded_state()
        odd = FlatShardPlan.of(fsdp, optimizer, model_now, optimizer_now, layouts_now)
        assert odd is not None
        if rank == dist.get_world_size() - 1:
            path = next(path for path, slot in odd.slots.items() if isinstance(slot, _Chunk) and slot.rows)
            _at({"model": model_now, "optimizer": optimizer_now}, path).clear()
        result["odd_checked"] = odd.check(model_now, optimizer_now)
        # A plan that misplaces one parameter by one element fails its check on every rank.
        model_now, optimizer_now, layouts_now = sharded_state()
        shifted = FlatShardPlan.of(fsdp, optimizer, model_now, optimizer_now, layouts_now)
        assert shifted is not None
        unit = shifted.units[-1]
        shifted.units[-1] = dataclasses.replace(unit, starts=(*unit.starts[:-1], unit.starts[-1] + 1))
        result["shifted_checked"] = shifted.check(model_now, optimizer_now)
        optimizer.state.clear()  # a reloaded optimizer: its tensors are not the plan's
        step()
        result["after_reload"] = decide(plan, fsdp, optimizer)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
