"""FSDP1's sharded state dicts without the collective at the step: flat shards staged, cut in the background.

FSDP1 keeps each wrapped module's parameters as one flat parameter, sharded in equal contiguous
slices; its ``SHARDED_STATE_DICT`` (``model.state_dict()``, ``FSDP.optim_state_dict``) is every
parameter's dim-0 chunk instead (``ShardedTensor``), cut from the all-gathered flat parameter: a
collective over the training group at every checkpoint, inside the step (0.86 s of a 0.90 s stall
for a 245 MB shard on 2 CPU ranks, against a 0.02 s copy).

:class:`FlatShardPlan` is built once per run from the first checkpoint's real state dicts (taken
as the Trainer takes them): which flat parameter and which rows of it every ``ShardedTensor``
holds on this rank, which live tensor every plain one is (buffers, the optimizer's step counts).
Later checkpoints stage only this rank's flat shards (the parameters' and the optimizer states',
views of the live tensors: no collective, one copy), and the background writer, on the persister's
own gloo group, exchanges what every rank's chunks need with one all-to-all per flat tensor (each rank
receives its chunks' elements only: its share of the bytes, where an all-gather would bring it every
rank's) and assembles the same chunks (:meth:`FlatShardPlan.cut`):
the same bytes as the state dicts would have held, written by DCP with the first checkpoint's
global metadata. The plan is checked before it is used: at the checkpoint that builds it the step also
stages the flat shards, and the writer compares their cut with the state dicts taken at that step, on
every rank (:meth:`FlatShardPlan.check`); until then, where it fails, and where it does not apply
(hybrid sharding, a shard group that is not every rank in order, a state it cannot place) every
checkpoint takes the state dicts as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from spot_callbacks.persist.shards import ShardedTensorLayout

log = logging.getLogger("spot_callbacks")

Path = tuple[Any, ...]


@dataclass(frozen=True)
class _Unit:
    """One flat parameter: where each original parameter sits in its padded, unsharded flat tensor."""

    flat: Any  # the FlatParameter
    starts: tuple[int, ...]  # per original parameter, its first element in the unsharded flat tensor
    shapes: tuple[torch.Size, ...]
    params: tuple[Any, ...]  # use_orig_params: the original (sharded, 1-D) parameters; else ()
    infos: tuple[Any, ...]  # each original parameter's _ShardParamInfo on this rank
    shard_numel: int  # every rank's padded shard


@dataclass(frozen=True)
class _Chunk:
    """A ``ShardedTensor`` leaf: ``rows`` of original parameter ``index`` of unit ``unit``, of ``source``."""

    unit: int
    index: int
    source: str  # "param", or the optimizer state's name ("exp_avg")
    rows: tuple[int, int] | None  # [first, end) of dim 0 on this rank; None: no local shard
    rows_of: tuple[tuple[int, int] | None, ...]  # the same on every rank, by rank


@dataclass(frozen=True)
class _Exchange:
    """Which elements of one flat tensor go from which rank to which, for every rank's chunks at once."""

    send: list[tuple[int, int]]  # slices of this rank's flat shard, destination by destination
    send_splits: list[int]
    receive_splits: list[int]
    # per parameter index: (where in the received tensor, offset in its chunk, length) of each piece
    pieces: dict[int, list[tuple[int, int, int]]]


class FlatShardPlan:
    """Where FSDP1's sharded state dicts come from in its flat shards: built once, then cut in the background.

    Example:
        >>> FlatShardPlan.of(torch.nn.Linear(2, 2), None, {}, {}, {}) is None  # not FSDP1
        True
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        units: list[_Unit],
        templates: dict[str, Any],
        slots: dict[Path, Any],
        group_params: list[list[Any]],
        world: int,
        training_group: Any,
    ) -> None:
        self.model, self.optimizer, self.units = model, optimizer, units
        self.templates, self.slots, self.group_params = templates, slots, group_params
        self.world, self.training_group = world, training_group
        self.state_names = sorted(
            {slot.source for slot in slots.values() if isinstance(slot, _Chunk)} - {"param"}
        )
        self.plain_paths = [path for path, slot in slots.items() if isinstance(slot, _Plain)]
        chunks: dict[tuple[int, str], list[tuple[Path, _Chunk]]] = {}
        for path, slot in slots.items():
            if isinstance(slot, _Chunk):
                chunks.setdefault((slot.unit, slot.source), []).append((path, slot))
        self._chunks = dict(sorted(chunks.items()))  # per flat tensor (unit, source), in one order everywhere
        self.training_device = _fsdp1_modules(model)[0][1].compute_device  # for the agreement in decide()
        self._sources = self._live_ids()
        self.verified: bool | None = None  # None until check() ran in the writer
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}  # cut's, kept from one checkpoint to the next
        self._exchanges: dict[tuple[int, str], _Exchange] = {}

    @classmethod
    def of(
        cls,
        model: Any,
        optimizer: Any,
        model_state: Any,
        optimizer_state: Any,
        layouts: dict[Path, Any],
    ) -> FlatShardPlan | None:
        """The plan for these state dicts (as :func:`~spot_callbacks.persist.shards.local_shards` made
        them, under ``"model"`` and ``"optimizer"``), or ``None`` where it does not apply. Collective on
        the training group when ``model`` is FSDP1 (every rank calls it at the same checkpoint)."""
        try:
            plan = cls._build(model, optimizer, model_state, optimizer_state, layouts)
        except Exception as error:  # an FSDP internal this torch does not have: the collective stays
            log.debug("spot_callbacks: FSDP1 flat shards not used: %s", error)
            plan = None
        return _agreed(model, plan)

    @classmethod
    def _build(
        cls, model: Any, optimizer: Any, model_state: Any, optimizer_state: Any, layouts: dict[Path, Any]
    ) -> FlatShardPlan | None:
        import torch.distributed as dist

        roots = _fsdp1_modules(model)
        if not roots or optimizer is None:
            return None
        group = roots[0][1].process_group
        world = dist.get_world_size(group)
        if any(module.process_group is not group for _, module in roots) or dist.get_process_group_ranks(
            group
        ) != list(range(dist.get_world_size())):
            return None  # hybrid or partial sharding: the persister's group is every rank
        units: list[_Unit] = []
        where: dict[str, tuple[int, int]] = {}
        for name, module in roots:
            handle = module._handle
            if handle is None:
                continue
            if not handle.uses_sharded_strategy:
                return None
            unit, fqns = _unit_of(handle)
            prefix = f"{name}." if name else ""
            for index, fqn in enumerate(fqns):
                where[_clean(prefix + fqn)] = (len(units), index)
            for shared in handle.flat_param._shared_param_infos:
                primary = _join(shared.prim_module_name, shared.prim_param_name)
                if primary in fqns:
                    where[_clean(prefix + _join(shared.module_name, shared.param_name))] = (
                        len(units),
                        fqns.index(primary),
                    )
            units.append(unit)
        if not units or len({bool(unit.params) for unit in units}) != 1:
            return None
        templates = {"model": model_state, "optimizer": optimizer_state}
        slots: dict[Path, Any] = {}
        live_buffers = {buffer.data_ptr(): buffer for buffer in model.buffers()}
        for path, leaf in _leaves(templates):
            layout = layouts.get(path)
            slot = _slot(path, leaf, layout, where, units, live_buffers, optimizer, world)
            if slot is None:
                return None
            if slot is not _CONSTANT:
                slots[path] = slot
        groups = optimizer_state.get("param_groups") if isinstance(optimizer_state, dict) else None
        if type(groups) is not list or len(groups) != len(optimizer.param_groups):
            return None
        # Only the trees' shape is kept: the first checkpoint's tensors would stay alive for the run.
        skeletons = {
            name: _refill(tree, (name,), dict.fromkeys(slots), {}) for name, tree in templates.items()
        }
        group_params = [list(g.get("params", ())) for g in groups]
        return cls(model, optimizer, units, skeletons, slots, group_params, world, group)

    def check(self, flat_sources: Any, model_state: Any, optimizer_state: Any, group: Any) -> bool:
        """Whether the cut of ``flat_sources`` equals the state dicts taken at the same step, on every
        rank (collective on ``group``, in the background writer); sets :attr:`verified`."""
        import torch.distributed as dist

        expected = {"model": model_state, "optimizer": optimizer_state}

        def compare(path: Path, received: torch.Tensor, pieces: list[tuple[int, int, int]]) -> bool:
            # Piece by piece against the staged chunk: no copy of the cut is made.
            staged = _at(expected, path)
            if type(staged) is not list or len(staged) != 1 or not torch.is_tensor(staged[0]):
                return False
            slot = self.slots[path]
            chunk = staged[0]
            if chunk.shape != _chunk_shape(self.units[slot.unit], slot) or chunk.dtype != received.dtype:
                return False
            flat = chunk.reshape(-1)
            covered = sum(length for _, _, length in pieces)
            return covered == flat.numel() and all(
                torch.equal(received[at : at + length], flat[offset : offset + length])
                for at, offset, length in pieces
            )

        try:
            values = self._cut(flat_sources[0], flat_sources[1], group, compare)

            def matches(path: Path, value: Any) -> bool:
                staged = _at(expected, path)
                if not isinstance(self.slots[path], _Chunk):
                    return _same(value, staged)
                return value == [True] if value else isinstance(staged, list) and not staged

            groups = flat_sources[1]["param_groups"]
            same = all(matches(path, value) for path, value in values.items()) and _same(
                groups, optimizer_state["param_groups"]
            )
        except Exception as error:  # the plan is not used; the checkpoint is written all the same
            log.debug("spot_callbacks: FSDP1 flat shards could not be checked: %s", error)
            same = False
        verdict = torch.tensor([1 if same else 0])
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=group)
        self.verified = bool(verdict.item())
        if not self.verified:
            log.info(
                "spot_callbacks: FSDP1's flat shards do not cut into its sharded state dicts here: every "
                "checkpoint takes the state dicts (an all-gather in the step)"
            )
        return self.verified

    def _live_ids(self) -> list[tuple[int, int]]:
        tensors: list[Any] = []
        for unit in self.units:
            tensors.append(unit.flat._local_shard)
            for param in unit.params or (unit.flat,):
                tensors.extend(v for v in self.optimizer.state.get(param, {}).values() if torch.is_tensor(v))
        tensors.extend(self.slots[path].tensor() for path in self.plain_paths)
        return [(id(tensor), tensor.data_ptr() if tensor is not None else 0) for tensor in tensors]

    def live(self, model: Any, optimizer: Any) -> bool:
        """Whether ``model`` and ``optimizer`` are the plan's, with the same tensors (not collective)."""
        return model is self.model and optimizer is self.optimizer and self._live_ids() == self._sources

    def sources(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """What to stage at a checkpoint, for :meth:`cut`: this rank's flat shards (views of the live
        parameters and optimizer states), the plain tensors, the optimizer's groups; no collective."""
        flats, states = [], []
        for unit in self.units:
            flats.append(unit.flat._local_shard)
            if unit.params:  # use_orig_params: each original parameter's piece of the shard
                per = [self.optimizer.state.get(param, {}) for param in unit.params]
                states.append(
                    {name: [state.get(name) if _shard_piece(state.get(name)) else None for state in per]
                     for name in self.state_names}
                )  # fmt: skip
            else:
                state = self.optimizer.state.get(unit.flat, {})
                states.append({name: state.get(name) for name in self.state_names})
        plain = [self.slots[path].tensor() for path in self.plain_paths]
        groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": list(params)}
            for group, params in zip(self.optimizer.param_groups, self.group_params, strict=True)
        ]
        return {"flat": flats, "plain": plain}, {"flat": states, "param_groups": groups}

    def cut(self, model_src: dict[str, Any], optimizer_src: dict[str, Any], group: Any) -> tuple[Any, Any]:
        """The model and optimizer state dicts as :func:`~spot_callbacks.persist.shards.local_shards` made
        them at the first checkpoint, from :meth:`sources` as staged (CPU copies). Collective on ``group``;
        the chunks are buffers the next cut reuses."""

        def keep(path: Path, received: torch.Tensor, pieces: list[tuple[int, int, int]]) -> torch.Tensor:
            # Each chunk its own storage (DCP writes it without the copy it makes of a view), kept from
            # one checkpoint to the next: no heap churn per checkpoint.
            slot = self.slots[path]
            shape = _chunk_shape(self.units[slot.unit], slot)
            kept = self._buffer(("chunk", path), shape.numel(), received.dtype, exact=True)
            for at, offset, length in pieces:
                kept[offset : offset + length].copy_(received[at : at + length])
            return kept.view(shape)

        values = self._cut(model_src, optimizer_src, group, keep)
        model = _refill(self.templates["model"], ("model",), values, {})
        subtrees = {("optimizer", "param_groups"): optimizer_src}
        return model, _refill(self.templates["optimizer"], ("optimizer",), values, subtrees)

    def _cut(
        self,
        model_src: dict[str, Any],
        optimizer_src: dict[str, Any],
        group: Any,
        take: Callable[[Path, torch.Tensor, list[tuple[int, int, int]]], Any],
    ) -> dict[Path, Any]:
        """For each flat tensor, its pieces of this rank's chunks from every rank (one all-to-all: each
        rank receives its chunks' elements only), then each chunk leaf's ``take(path, received, pieces)``
        (``received`` valid during the call; ``pieces``: where its elements are in it) or ``[]`` where
        this rank holds none; each plain leaf's tensor. By path."""
        import torch.distributed as dist

        values: dict[Path, Any] = {}
        for key, chunks in self._chunks.items():  # every rank in the same order: each is an all-to-all
            exchange = self._exchanges.get(key)
            if exchange is None:
                exchange = self._exchanges[key] = _exchange(self.units[key[0]], chunks, self.world)
            local = self._flat_source(self.units[key[0]], key, model_src, optimizer_src)
            send = self._buffer(("send", local.dtype), sum(exchange.send_splits))
            if exchange.send:
                torch.cat([local[start:end] for start, end in exchange.send], out=send)
            received = self._buffer(("received", local.dtype), sum(exchange.receive_splits))
            dist.all_to_all_single(received, send, exchange.receive_splits, exchange.send_splits, group=group)
            for path, slot in chunks:
                pieces = exchange.pieces.get(slot.index, [])
                values[path] = [] if slot.rows is None else [take(path, received, pieces)]
        # Plain tensors: this rank's own; a step count this rank holds no piece of comes from one that does.
        plain_local = dict(zip(self.plain_paths, model_src["plain"], strict=True))
        known = {path: value.cpu() for path, value in plain_local.items() if value is not None}
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, known, group=group)
        for path in self.plain_paths:
            value = plain_local[path]
            if value is None:
                value = next(theirs[path] for theirs in everyone if path in theirs)
            values[path] = value
        return values

    def _buffer(
        self, key: tuple[Any, ...], numel: int, dtype: torch.dtype | None = None, exact: bool = False
    ) -> torch.Tensor:
        """A CPU buffer of ``numel`` elements kept under ``key`` for the next cut (``exact``: of exactly
        that size, else grown when too small)."""
        dtype = dtype if dtype is not None else key[1]
        buffer = self._buffers.get(key)
        if (
            buffer is None
            or buffer.dtype != dtype
            or buffer.numel() < numel
            or (exact and buffer.numel() != numel)
        ):
            buffer = torch.empty(numel, dtype=dtype)
            self._buffers[key] = buffer
        return buffer[:numel] if buffer.numel() != numel else buffer

    def _flat_source(
        self, unit: _Unit, key: tuple[int, str], model_src: dict[str, Any], optimizer_src: dict[str, Any]
    ) -> torch.Tensor:
        index, source = key
        if source == "param":
            return model_src["flat"][index]
        state = optimizer_src["flat"][index][source]
        if not unit.params:
            return state
        flat = self._buffer(("pieces", model_src["flat"][index].dtype), unit.shard_numel)
        flat.zero_()
        for piece, info in zip(state, unit.infos, strict=True):
            if piece is not None and info.in_shard:
                flat[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard] = piece.reshape(-1)
        return flat


@dataclass(frozen=True)
class _Plain:
    """A plain tensor leaf (a buffer, a step count): staged as it is, from the live tensor ``tensor()``."""

    tensor: Callable[[], Any]


_CONSTANT = object()  # a leaf that is the same at every checkpoint (a param group's names are refilled)


def _slot(
    path: Path,
    leaf: Any,
    layout: Any,
    where: dict[str, tuple[int, int]],
    units: list[_Unit],
    live_buffers: dict[int, Any],
    optimizer: Any,
    world: int,
) -> Any:
    if path[:2] == ("optimizer", "param_groups"):
        return _CONSTANT
    if isinstance(layout, ShardedTensorLayout):
        fqn, source = (path[1], "param") if path[0] == "model" else (path[2], path[3])
        if path[0] != "model" and (len(path) != 4 or path[1] != "state"):
            return None
        if fqn not in where or len(layout.local) > 1:
            return None
        unit_index, index = where[fqn]
        shape = units[unit_index].shapes[index]
        rows_of: list[tuple[int, int] | None] = [None] * world
        for shard in layout.metadata.shards_metadata:
            if any(shard.shard_offsets[1:]) or list(shard.shard_sizes[1:]) != list(shape[1:]):
                return None  # not a dim-0 chunk
            rank = shard.placement.rank()
            if not 0 <= rank < world or rows_of[rank] is not None:
                return None
            rows_of[rank] = (shard.shard_offsets[0], shard.shard_offsets[0] + shard.shard_sizes[0])
        rows = None
        if layout.local:
            local = layout.local[0]
            rows = (local.shard_offsets[0], local.shard_offsets[0] + local.shard_sizes[0])
            if rows_of[local.placement.rank()] != rows:
                return None
        return _Chunk(unit_index, index, source, rows, tuple(rows_of))
    if not torch.is_tensor(leaf):
        return None
    if path[0] == "model":
        buffer = live_buffers.get(leaf.data_ptr())
        return None if buffer is None else _Plain(lambda: buffer)
    if len(path) == 4 and path[1] == "state" and leaf.dim() == 0 and path[2] in where:
        unit = units[where[path[2]][0]]
        param = unit.params[where[path[2]][1]] if unit.params else unit.flat
        name = path[3]
        return _Plain(lambda: optimizer.state.get(param, {}).get(name))
    return None


def _unit_of(handle: Any) -> tuple[_Unit, list[str]]:
    flat = handle.flat_param
    starts, offset = [], 0
    for numel, padding in zip(flat._numels_with_padding, flat._is_padding_mask, strict=True):
        if not padding:
            starts.append(offset)
        offset += numel
    params = tuple(flat._params) if handle._use_orig_params else ()
    unit = _Unit(
        flat=flat,
        starts=tuple(starts),
        shapes=tuple(flat._shapes),
        params=params,
        infos=tuple(flat._shard_param_infos),
        shard_numel=flat._sharded_size.numel(),
    )
    return unit, list(flat._fqns)


def _row_numel(shape: torch.Size) -> int:
    numel = 1
    for size in shape[1:]:
        numel *= size
    return numel


def _chunk_shape(unit: _Unit, slot: _Chunk) -> torch.Size:
    assert slot.rows is not None
    shape = unit.shapes[slot.index]
    return torch.Size([slot.rows[1] - slot.rows[0], *shape[1:]])


def _exchange(unit: _Unit, slots: list[tuple[Path, _Chunk]], world: int) -> _Exchange:
    """What this rank sends and receives so that every rank gets its chunks of ``slots``' parameters
    (one flat tensor), computed alike on every rank from the chunks' rows on every rank."""
    import torch.distributed as dist

    me, size = dist.get_rank(), unit.shard_numel
    rows: dict[int, tuple[tuple[int, int] | None, ...]] = {}
    for _, slot in slots:  # a tied parameter's two names are one chunk
        rows.setdefault(slot.index, slot.rows_of)

    def wanted(rank: int) -> list[tuple[int, int, int]]:  # (index, first, end) in the unsharded flat tensor
        spans = []
        for index, by_rank in rows.items():
            mine = by_rank[rank]
            if mine is not None and mine[1] > mine[0]:
                row, start = _row_numel(unit.shapes[index]), unit.starts[index]
                spans.append((index, start + mine[0] * row, start + mine[1] * row))
        return spans

    def overlaps(spans: list[tuple[int, int, int]], source: int) -> list[tuple[int, int, int]]:
        held = (source * size, (source + 1) * size)
        found = []
        for index, first, end in spans:
            low, high = max(first, held[0]), min(end, held[1])
            if high > low:
                found.append((index, low - first, high - low))  # offset in the chunk, length
        return found

    send: list[tuple[int, int]] = []
    send_splits = []
    for rank in range(world):
        theirs = wanted(rank)
        spans = {index: first for index, first, _ in theirs}
        pieces = overlaps(theirs, me)
        send += [(spans[index] + offset - me * size, spans[index] + offset - me * size + length)
                 for index, offset, length in pieces]  # fmt: skip
        send_splits.append(sum(length for _, _, length in pieces))
    mine = wanted(me)
    receive_splits = []
    placed: dict[int, list[tuple[int, int, int]]] = {}
    at = 0
    for rank in range(world):  # the received tensor holds every source's pieces, source by source
        pieces = overlaps(mine, rank)
        for index, offset, length in pieces:
            placed.setdefault(index, []).append((at, offset, length))
            at += length
        receive_splits.append(sum(length for _, _, length in pieces))
    return _Exchange(send, send_splits, receive_splits, placed)


def _shard_piece(value: Any) -> bool:
    return torch.is_tensor(value) and value.dim() > 0


def _fsdp1_modules(model: Any) -> list[tuple[str, Any]]:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:
        return []
    if not isinstance(model, torch.nn.Module):
        return []
    return [(name, module) for name, module in model.named_modules() if isinstance(module, FSDP)]


def _clean(name: str) -> str:
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    return clean_tensor_name(name)


def _join(module_name: str, param_name: str) -> str:
    return f"{module_name}.{param_name}" if module_name else param_name


def _leaves(tree: Any, path: Path = ()) -> list[tuple[Path, Any]]:
    """Every leaf of a state tree; a ShardedTensor's local-shard list (tensors only) is one leaf."""
    if isinstance(tree, dict):
        return [leaf for key, value in tree.items() for leaf in _leaves(value, (*path, key))]
    if type(tree) is list and not (tree and all(torch.is_tensor(item) for item in tree)) and tree:
        return [leaf for index, value in enumerate(tree) for leaf in _leaves(value, (*path, index))]
    return [(path, tree)]


def _at(tree: Any, path: Path) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _refill(template: Any, path: Path, values: dict[Path, Any], subtrees: dict[Path, Any]) -> Any:
    if path in subtrees:
        return subtrees[path]["param_groups"]
    if path in values:
        return values[path]
    if isinstance(template, dict):
        filled = {key: _refill(value, (*path, key), values, subtrees) for key, value in template.items()}
        return filled if type(template) is dict else type(template)(filled)
    if type(template) is list and template and not all(torch.is_tensor(item) for item in template):
        return [_refill(value, (*path, index), values, subtrees) for index, value in enumerate(template)]
    return template


def _same(a: Any, b: Any) -> bool:
    """Equal trees, tensors bit for bit (on the CPU) and of the same dtype and shape."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        return bool(torch.equal(a.detach().cpu(), b.detach().cpu()))
    if isinstance(a, dict) and isinstance(b, dict):  # a staged copy may be a plain dict of an OrderedDict
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _agreed(model: Any, plan: FlatShardPlan | None) -> FlatShardPlan | None:
    """``plan`` where every rank has one, else ``None`` on all (one small all-reduce on the training group)."""
    import torch.distributed as dist

    roots = _fsdp1_modules(model)
    if not roots or not dist.is_initialized():
        return plan
    group = roots[0][1].process_group
    device = roots[0][1].compute_device
    ok = torch.tensor([1 if plan is not None else 0], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return plan if int(ok.item()) == 1 else None


def decide(plan: FlatShardPlan, model: Any, optimizer: Any) -> str:
    """What every rank does at this checkpoint (one small all-reduce on the training group): ``"flat"``
    (stage the flat shards), ``"check"`` (take the state dicts; the plan is not checked yet),
    ``"stale"`` (the tensors changed: take them and build the plan again) or ``"failed"`` (take them,
    now and for the rest of the run)."""
    import torch.distributed as dist

    verified = {None: 1, True: 2, False: 0}[plan.verified]
    votes = torch.tensor([1 if plan.live(model, optimizer) else 0, verified], device=plan.training_device)
    dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=plan.training_group)
    live, verified = (int(value) for value in votes.tolist())
    if verified == 0:
        return "failed"
    if not live:
        return "stale"
    return "flat" if verified == 2 else "check"
