"""FSDP1's sharded state dicts without the collective at the step: flat shards staged, cut in the background.

FSDP1 keeps each wrapped module's parameters as one flat parameter, sharded in equal contiguous
slices; its ``SHARDED_STATE_DICT`` (``model.state_dict()``, ``FSDP.optim_state_dict``) is every
parameter's dim-0 chunk instead (``ShardedTensor``), cut from the all-gathered flat parameter: a
collective over the training group at every checkpoint, inside the step (0.86 s of a 0.90 s stall
for a 245 MB shard on 2 CPU ranks, against a 0.02 s copy).

:class:`FlatShardPlan` is built once per run from the first checkpoint's real state dicts (taken
as the Trainer takes them): which flat parameter and which rows of it every ``ShardedTensor``
holds on this rank, which live tensor every plain one is (buffers, the optimizer's step counts).
It is checked at once, in that step, against those state dicts (:meth:`FlatShardPlan.check`: a
sample of every chunk's elements, both ends of every piece, compared bit for bit with the live
flat shards that hold them, one small all-reduce), and that checkpoint writes FSDP1's own copies
without copying them again. Later checkpoints stage only this rank's flat shards (the parameters'
and the optimizer states', no collective, one copy) into one buffer per flat tensor, and the
background writer, on the persister's own gloo group, exchanges what every rank's chunks need with
one all-to-all per flat tensor (each rank receives its chunks' elements only) and lays the chunks
out in the same buffer (:meth:`FlatShardPlan.cut`): the same bytes as the state dicts would have
held, their only copy, written by DCP with the first checkpoint's global metadata. Where the check
fails, and where the plan does not apply (hybrid sharding, a shard group that is not every rank in
order, a state it cannot place), every checkpoint takes the state dicts as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from spot_callbacks.persist.host_buffers import Adopted, IntoBuffer, fault_in
from spot_callbacks.persist.shards import ShardedTensorLayout, packed_param_groups

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
class _Probes:
    """The elements :meth:`FlatShardPlan.check` compares in one chunk: rank ``rank``'s rows of parameter
    ``index``, starting at element ``first`` of the unsharded flat tensor; probe numbers from ``number``."""

    index: int
    rank: int
    first: int
    positions: list[int]
    number: int


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
        self.verified: bool | None = None  # None until check() ran
        self._exchanges = {
            key: _exchange(self.units[key[0]], found, world) for key, found in self._chunks.items()
        }
        # Where each chunk of this rank lies in its flat tensor's buffer once cut: (offset, numel), by
        # parameter index, one after another (a tied parameter's two names are one chunk).
        self._placed: dict[tuple[int, str], dict[int, tuple[int, int]]] = {}
        for key, found in self._chunks.items():
            placed, offset = {}, 0
            for _, slot in found:
                if slot.rows is not None and slot.index not in placed:
                    numel = _chunk_shape(self.units[key[0]], slot).numel()
                    placed[slot.index], offset = (offset, numel), offset + numel
            self._placed[key] = placed
        # One buffer per flat tensor, staged into (this rank's flat shard) and cut in place (its
        # chunks): max(shard, chunks) elements, allocated once (allocate()).
        self._sizes = {
            key: max(self.units[key[0]].shard_numel, sum(numel for _, numel in self._placed[key].values()))
            for key in self._chunks
        }
        self._arena: dict[tuple[int, str], torch.Tensor] = {}
        # Each chunk of this rank: a tensor with a storage of its own, in the arena.
        self._views: dict[Path, torch.Tensor] = {}
        self._arena_lock = threading.Lock()  # the writer allocates while the step may stage
        self._temps: dict[str, torch.Tensor] = {}  # the exchange's send and receive buffers, reused
        self._dtypes: dict[tuple[int, str], torch.dtype] = {}  # each flat tensor's, as check() found it

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

    def check(self, model_state: Any, optimizer_state: Any) -> bool:
        """Whether the plan places the state dicts taken at this step where the live flat shards hold
        them, on every rank; sets :attr:`verified`. Collective on the training group, at the step.

        Compared bit for bit on a sample: both ends of every chunk and of every piece of it that one
        rank's shard holds, and :data:`PROBES_PER_CHUNK` positions spread between (a misplaced offset,
        row or padding moves them all), gathered with one all-reduce of their bits; the plain tensors
        and the optimizer's groups whole. No copy of the state is made.
        """
        import torch.distributed as dist

        # Every rank reaches both all-reduces, whatever it finds: a rank that returned early would
        # leave the others in a collective it never enters.
        probes, count = self._probes()
        bits = torch.zeros(count, dtype=torch.int64, device=self.training_device)
        try:
            mine = self._probe(model_state, optimizer_state, probes, bits)
        except Exception as error:  # the plan is not used; this checkpoint takes the state dicts
            log.debug("spot_callbacks: FSDP1 flat shards could not be checked: %s", error)
            mine = None
        if mine is None:
            bits.zero_()
        dist.all_reduce(bits, group=self.training_group)  # every probe has one owner: the sum is its bits
        try:
            same = mine is not None and all(
                torch.equal(bits[first : first + values.numel()], values.to(self.training_device))
                for first, values in mine
            )
            same = same and self._plain_same(model_state, optimizer_state)
        except Exception as error:
            log.debug("spot_callbacks: FSDP1 flat shards could not be checked: %s", error)
            same = False
        verdict = torch.tensor([1 if same else 0], device=self.training_device)
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=self.training_group)
        self.verified = bool(verdict.item())
        if not self.verified:
            log.info(
                "spot_callbacks: FSDP1's flat shards do not cut into its sharded state dicts here: every "
                "checkpoint takes the state dicts (an all-gather in the step)"
            )
        return self.verified

    def _probes(self) -> tuple[dict[tuple[int, str], list[_Probes]], int]:
        """Where :meth:`check` compares, per flat tensor, and how many elements in all: from the plan
        alone, so the same on every rank (the all-reduce's length)."""
        probes: dict[tuple[int, str], list[_Probes]] = {}
        count = 0
        for key, found in self._chunks.items():
            unit, rows_of = self.units[key[0]], {slot.index: slot.rows_of for _, slot in found}
            probes[key] = []
            for index in sorted(rows_of):
                row, start = _row_numel(unit.shapes[index]), unit.starts[index]
                for rank, rows in enumerate(rows_of[index]):
                    if rows is not None and rows[1] > rows[0]:
                        first, numel = start + rows[0] * row, (rows[1] - rows[0]) * row
                        positions = _probe_positions(first, numel, unit.shard_numel)
                        probes[key].append(_Probes(index, rank, first, positions, count))
                        count += len(positions)
        return probes, count

    def _probe(
        self,
        model_state: Any,
        optimizer_state: Any,
        probes: dict[tuple[int, str], list[_Probes]],
        bits: torch.Tensor,
    ) -> list[tuple[int, torch.Tensor]] | None:
        """Fill ``bits`` at the ``probes`` this rank's live shards hold; return (first probe number, bits)
        of this rank's chunks, or ``None`` where the state dicts are not shaped as the plan expects."""
        import torch.distributed as dist

        expected = {"model": model_state, "optimizer": optimizer_state}
        me = dist.get_rank()
        mine: list[tuple[int, torch.Tensor]] = []  # (first probe number, bits) of this rank's chunks
        for key, found in self._chunks.items():
            unit, live = self.units[key[0]], self._live_pieces(self.units[key[0]], key)
            chunks = [
                staged[0] for path, _ in found if type(staged := _at(expected, path)) is list and staged
            ]
            dtype = live[0][0].dtype if live else chunks[0].dtype if chunks else unit.flat._local_shard.dtype
            self._dtypes[key] = dtype  # a rank that holds no piece of it receives its chunks all the same
            chunk_of: dict[int, list[torch.Tensor]] = {}  # a tied parameter's names: each checked
            for path, slot in found:  # the state dicts hold every chunk the plan expects, shaped as it says
                staged = _at(expected, path)
                if slot.rows is None:
                    if not (type(staged) is list and not staged):
                        return None
                    continue
                if type(staged) is not list or len(staged) != 1 or not torch.is_tensor(staged[0]):
                    return None
                chunk = staged[0]
                if chunk.shape != _chunk_shape(unit, slot) or chunk.dtype != dtype:
                    return None
                chunk_of.setdefault(slot.index, []).append(chunk.reshape(-1))
            held: dict[int, list[int]] = {}  # local index in this rank's shard -> probe numbers
            for probe in probes[key]:
                for chunk in chunk_of.get(probe.index, []) if probe.rank == me else []:
                    at = torch.tensor(probe.positions, device=chunk.device)
                    mine.append((probe.number, _bits(chunk.index_select(0, at))))
                for number, position in enumerate(probe.positions, start=probe.number):
                    owner, local = divmod(probe.first + position, unit.shard_numel)
                    if owner == me:
                        held.setdefault(local, []).append(number)
            if held:
                numbers, values = self._held_values(unit, key, held)
                bits[torch.tensor(numbers, device=self.training_device)] = values.to(self.training_device)
        return mine

    def _plain_same(self, model_state: Any, optimizer_state: Any) -> bool:
        """The plain tensors this rank holds and the optimizer's groups, whole, against the state dicts."""
        expected = {"model": model_state, "optimizer": optimizer_state}
        for path in self.plain_paths:
            live = self.slots[path].tensor()
            if live is not None and not _same(live, _at(expected, path)):
                return False
        return _same(packed_param_groups(self.optimizer, self.group_params), optimizer_state["param_groups"])

    def _held_values(
        self, unit: _Unit, key: tuple[int, str], held: dict[int, list[int]]
    ) -> tuple[list[int], torch.Tensor]:
        """The bits of this rank's live flat shard at the local indices in ``held``: (probe numbers, bits)."""
        numbers, values = [], []
        for tensor, offset, numel in self._live_pieces(unit, key):
            local = [index for index in held if offset <= index < offset + numel]
            if not local:
                continue
            at = torch.tensor([index - offset for index in local], device=tensor.device)
            picked = _bits(tensor.reshape(-1).index_select(0, at))
            for position, index in enumerate(local):
                for number in held[index]:
                    numbers.append(number)
                    values.append(picked[position : position + 1])
        if sum(len(found) for found in held.values()) != len(numbers):
            raise ValueError(f"flat tensor {key}: a chunk's element lies in no live shard")
        return numbers, torch.cat(values)

    def _live_pieces(self, unit: _Unit, key: tuple[int, str]) -> list[tuple[torch.Tensor, int, int]]:
        """The live tensors of flat tensor ``key`` on this rank: (tensor, offset in the shard, numel)."""
        source = key[1]
        if source == "param":
            return [(unit.flat._local_shard, 0, unit.shard_numel)]
        if not unit.params:
            state = self.optimizer.state.get(unit.flat, {}).get(source)
            return [] if state is None else [(state, 0, unit.shard_numel)]
        pieces = []
        for param, info in zip(unit.params, unit.infos, strict=True):
            state = self.optimizer.state.get(param, {}).get(source)
            if info.in_shard and _shard_piece(state):
                pieces.append((state, info.offset_in_shard, info.numel_in_shard))
        return pieces

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

    def allocate(self) -> None:
        """Allocate this rank's buffers (one per flat tensor) and make them resident, if not yet done:
        called by the writer once the checkpoint that built the plan is written and its state dicts
        freed, so that the next checkpoint copies into resident memory and the two never coexist."""
        with self._arena_lock:
            for key in self._chunks:
                dtype = self._dtypes[key]  # as check() found it: the plan is used only once checked
                arena = self._arena.get(key)
                if arena is None or arena.dtype != dtype:
                    pin = self.units[key[0]].flat._local_shard.is_cuda and torch.cuda.is_available()
                    arena = torch.empty(self._sizes[key], dtype=dtype, pin_memory=pin)
                    fault_in(arena)
                    self._arena[key] = arena
                    self._views_of(key, arena)

    def _views_of(self, key: tuple[int, str], arena: torch.Tensor) -> None:
        """Each of this rank's chunks of flat tensor ``key``: a tensor whose storage is exactly its place
        in ``arena`` (DCP writes a view of a larger storage through a copy of it; this one it writes as is)."""
        unit = self.units[key[0]]
        raw = memoryview(cast(Any, arena.view(torch.uint8).numpy()))
        size = arena.element_size()
        for path, slot in self._chunks[key]:
            if slot.rows is None:
                continue
            offset, numel = self._placed[key][slot.index]
            shape = _chunk_shape(unit, slot)
            if numel == 0:
                self._views[path] = torch.empty(shape, dtype=arena.dtype)
            else:
                view = torch.frombuffer(raw, dtype=arena.dtype, count=numel, offset=offset * size)
                self._views[path] = view.view(shape)

    def arena_bytes(self) -> int:
        """Bytes of this rank's buffers (what it stages and what its chunks are cut into, in place)."""
        return sum(arena.numel() * arena.element_size() for arena in self._arena.values())

    def sources(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """What to stage at a checkpoint, for :meth:`cut`: this rank's flat shards (views of the live
        parameters and optimizer states, each to be copied into its place in this rank's buffers:
        :class:`~spot_callbacks.persist.host_buffers.IntoBuffer`), the plain tensors, the optimizer's groups; no
        collective. Allocates the buffers if :meth:`allocate` has not."""
        if len(self._arena) != len(self._chunks):
            self.allocate()
        flats: list[Any] = []
        with self._arena_lock:
            for key in self._chunks:
                arena, unit = self._arena[key], self.units[key[0]]
                if key[1] == "param" or not unit.params:
                    ((tensor, _, numel),) = self._live_pieces(unit, key)
                    flats.append(IntoBuffer(tensor, arena[:numel]))
                else:  # use_orig_params: each original parameter's piece of the shard, at its offset
                    flats.append(
                        [IntoBuffer(tensor.reshape(-1), arena[offset : offset + numel])
                         for tensor, offset, numel in self._live_pieces(unit, key)]
                    )  # fmt: skip
        plain = [self.slots[path].tensor() for path in self.plain_paths]
        return {"flat": flats, "plain": plain}, {
            "param_groups": packed_param_groups(self.optimizer, self.group_params)
        }

    def cut(self, model_src: dict[str, Any], optimizer_src: dict[str, Any], group: Any) -> tuple[Any, Any]:
        """The model and optimizer state dicts as :func:`~spot_callbacks.persist.shards.local_shards` made
        them at the first checkpoint, from :meth:`sources` as staged. Collective on ``group``: one
        all-to-all per flat tensor, in which each rank receives its chunks' elements only; the chunks
        are then laid out in the same buffers the flat shards were staged in (their only copy: the
        next stage overwrites them, after the writer released the staged state)."""
        import torch.distributed as dist

        values: dict[Path, Any] = {}
        for position, (key, chunks) in enumerate(self._chunks.items()):  # the same order on every rank
            exchange, arena = self._exchanges[key], self._arena[key]
            staged = model_src["flat"][position]
            for tensor in staged if type(staged) is list else [staged]:
                if tensor.untyped_storage().data_ptr() != arena.untyped_storage().data_ptr():
                    raise RuntimeError(
                        f"spot_callbacks: FSDP1 flat tensor {key} was not staged into its buffer"
                    )
            send = self._temp("send", arena.dtype, sum(exchange.send_splits))
            if exchange.send:
                torch.cat([arena[start:end] for start, end in exchange.send], out=send)
            received = self._temp("received", arena.dtype, sum(exchange.receive_splits))
            dist.all_to_all_single(received, send, exchange.receive_splits, exchange.send_splits, group=group)
            for index, (offset, _) in self._placed[key].items():  # the flat shard is in send: overwrite it
                for at, within, length in exchange.pieces.get(index, []):
                    arena[offset + within : offset + within + length].copy_(received[at : at + length])
            for path, slot in chunks:
                values[path] = [] if slot.rows is None else [self._views[path]]
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
        model = _refill(self.templates["model"], ("model",), values, {})
        subtrees = {("optimizer", "param_groups"): optimizer_src}
        return model, _refill(self.templates["optimizer"], ("optimizer",), values, subtrees)

    def _temp(self, name: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The exchange's ``name`` buffer, ``numel`` elements of it: kept (grown to the largest flat
        tensor) for the next cut, so a checkpoint does not churn the heap."""
        buffer = self._temps.get(name)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._temps[name] = torch.empty(nbytes, dtype=torch.uint8)
        return buffer[:nbytes].view(dtype)


PROBES_PER_CHUNK = 6  # between a chunk's two ends, besides both ends of every piece


def _probe_positions(first: int, numel: int, shard_numel: int) -> list[int]:
    """Positions in a chunk of ``numel`` elements starting at ``first`` of the unsharded flat tensor
    that :meth:`FlatShardPlan.check` compares: both ends, both sides of every shard boundary inside
    it, and :data:`PROBES_PER_CHUNK` spread between.

    Example:
        >>> _probe_positions(10, 20, 16)  # crosses the boundary at 16 (positions 5 and 6)
        [0, 2, 5, 6, 8, 10, 13, 16, 19]
    """
    positions = {0, numel - 1}
    boundary = (first // shard_numel + 1) * shard_numel
    while boundary < first + numel:
        positions.update((boundary - first - 1, boundary - first))
        boundary += shard_numel
    positions.update(j * (numel - 1) // (PROBES_PER_CHUNK + 1) for j in range(1, PROBES_PER_CHUNK + 1))
    return sorted(positions)


_INTEGER_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(values: torch.Tensor) -> torch.Tensor:
    """``values``' bit patterns as int64 (equal exactly when the values are equal bit for bit)."""
    size = values.element_size()
    if size not in _INTEGER_OF_SIZE or values.is_complex():
        raise ValueError(f"no bit view for {values.dtype}")
    return values.contiguous().view(_INTEGER_OF_SIZE[size]).to(torch.int64)


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
    (stage the flat shards), ``"stale"`` (the tensors changed: take the state dicts and build the plan
    again) or ``"failed"`` (take them, now and for the rest of the run: the plan was not checked, or
    its check failed on some rank)."""
    import torch.distributed as dist

    votes = torch.tensor(
        [1 if plan.live(model, optimizer) else 0, 1 if plan.verified else 0], device=plan.training_device
    )
    dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=plan.training_group)
    live, verified = (int(value) for value in votes.tolist())
    if not verified:
        return "failed"
    return "flat" if live else "stale"


def adopt_copies(model: Any, optimizer: Any, trees: dict[str, Any], layouts: dict[Path, Any]) -> int:
    """Mark the local shards of FSDP1's sharded state dicts in ``trees`` (``{"model": ..., "optimizer":
    ...}``, as :func:`~spot_callbacks.persist.shards.local_shards` made them) to be staged as they are
    (:class:`~spot_callbacks.persist.host_buffers.Adopted`): FSDP1 cuts each from the all-gathered parameter or
    state into a fresh CPU tensor, so a second copy would only double the memory. A shard on a device,
    or one that shares memory with a live parameter, buffer or optimizer state, is copied as before.
    Returns the bytes adopted.

    Example:
        >>> adopt_copies(torch.nn.Linear(2, 2), None, {}, {})
        0
    """
    live: set[int] = set()
    for tensor in [*model.parameters(), *model.buffers()]:
        live.add(tensor.untyped_storage().data_ptr())
    for _, module in _fsdp1_modules(model):
        handle = getattr(module, "_handle", None)
        if handle is not None:
            live.add(handle.flat_param._local_shard.untyped_storage().data_ptr())
    for state in optimizer.state.values() if optimizer is not None else ():
        live.update(v.untyped_storage().data_ptr() for v in state.values() if torch.is_tensor(v))
    adopted = 0
    for path, layout in layouts.items():
        if not isinstance(layout, ShardedTensorLayout) or path[0] not in trees:
            continue
        parent = _at(trees, path[:-1])
        shards = parent[path[-1]]
        if type(shards) is not list:
            continue
        marked: list[Any] = []
        for shard in shards:
            if torch.is_tensor(shard) and shard.is_cpu and shard.untyped_storage().data_ptr() not in live:
                marked.append(Adopted(shard))
                adopted += shard.numel() * shard.element_size()
            else:
                marked.append(shard)
        parent[path[-1]] = marked
    return adopted


StateDicts = tuple[Any, Any, dict[Path, Any]]


class Fsdp1Checkpoints:
    """One run's FSDP1 checkpoints: the sharded state dicts at the first, the flat shards after, where the
    plan applies (the shared core of the HF and Lightning adapters).

    :meth:`take` returns what a checkpoint stages, model and optimizer state as
    :func:`~spot_callbacks.persist.shards.local_shards` makes them (``"model"`` and ``"optimizer"``
    paths in the layouts); after it, :attr:`flat` is the plan whose :meth:`FlatShardPlan.cut` the writer
    applies (``None``: the state dicts themselves were staged) and :attr:`prepare` the plan that step
    built, whose buffers the writer allocates once it released that checkpoint.

    Example:
        >>> run = Fsdp1Checkpoints()
        >>> run.take(torch.nn.Linear(2, 2), None, lambda: ({}, {}, {}))  # not FSDP1: the state dicts
        ({}, {}, {})
        >>> run.flat is None
        True
    """

    def __init__(self) -> None:
        self.flat: FlatShardPlan | None = None
        self.prepare: FlatShardPlan | None = None
        self._plan: FlatShardPlan | None = None
        self._tried = False
        self._layouts: dict[Path, Any] = {}

    @property
    def plan(self) -> FlatShardPlan | None:
        """The run's checked plan, while it applies (``None``: the state dicts are taken)."""
        return self._plan

    def take(self, model: Any, optimizer: Any, state_dicts: Callable[[], StateDicts]) -> StateDicts:
        """This checkpoint's model state, optimizer state and layouts (collective on the training group:
        every rank calls it at the same checkpoint). ``state_dicts()`` takes FSDP1's sharded state dicts
        as local shards with their layouts, as the framework's own save would (a collective)."""
        self.flat = self.prepare = None
        plan = self._plan
        if plan is not None:
            decision = decide(plan, model, optimizer)
            if decision == "flat":
                self.flat = plan
                model_src, optimizer_src = plan.sources()
                return model_src, optimizer_src, dict(self._layouts)
            if decision == "stale":  # reloaded or resharded: build it again from these state dicts
                self._plan, self._tried = None, False
            else:
                self._plan = None
        model_state, optimizer_state, layouts = state_dicts()
        if not self._tried:
            self._tried = True
            built = FlatShardPlan.of(model, optimizer, model_state, optimizer_state, layouts)
            if built is not None and built.check(model_state, optimizer_state):
                self._plan = self.prepare = built  # allocated by the writer once this checkpoint is freed
            self._layouts = dict(layouts)
        if _fsdp1_modules(model):  # FSDP1's local shards are fresh copies: staged as they are
            adopt_copies(model, optimizer, {"model": model_state, "optimizer": optimizer_state}, layouts)
        return model_state, optimizer_state, layouts
