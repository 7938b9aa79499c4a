"""Stage a training state into reusable host buffers, then serialize it off the training loop.

The training loop pays for :meth:`StagingArea.stage` only: one copy of every tensor into a host
buffer that is kept for the next checkpoint (pinned, with non-blocking copies on a side stream,
when the tensor lives on a CUDA device). :func:`write_state` serializes the staged copy to
scratch in a background thread, computing the checksum as the bytes are written.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import random
import threading
import time
import zipfile
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, cast

import numpy as np
import torch

from spot_callbacks.errors import CorruptCheckpointError, SpotError, UnsafeCheckpointError
from spot_callbacks.log import checkpoint_line
from spot_callbacks.persist.host_buffers import Adopted, IntoBuffer, fault_in
from spot_callbacks.preemption import exit_guard
from spot_callbacks.store.checksums import ChecksumWriter, FileDigest
from spot_callbacks.store.manifest_limits import ManifestLimits

log = logging.getLogger("spot_callbacks")

# Where a tensor's bytes are and how they are laid out: equal keys are one tensor (tied weights).
_TensorKey = tuple[int, torch.Size, tuple[int, ...], torch.dtype, torch.device]


class StagedState:
    """A staged copy of a state; hold it until written, then :meth:`release` the buffers.

    Example:
        >>> area = StagingArea()
        >>> staged = area.stage({"w": torch.ones(2), "step": 3})
        >>> staged.state["w"].tolist(), staged.nbytes
        ([1.0, 1.0], 8)
        >>> staged.release()
    """

    def __init__(self, area: StagingArea, state: Any, nbytes: int, events: list[Any]) -> None:
        self._area = area
        self.state = state
        self.nbytes = nbytes
        self._events = events
        self._released = False

    def wait_copied(self) -> None:
        """Block until device-to-host copies have landed (a no-op for CPU state)."""
        for event in self._events:
            event.synchronize()
        self._events = []

    def release(self) -> None:
        """Give the buffers back to the area for the next snapshot; the staged state is then stale."""
        if not self._released:
            self._released = True
            self.state = None
            self._area._release()


class StagingArea:
    """Host buffers reused across checkpoints, one per tensor position in the state.

    A single set of buffers is kept (peak extra host memory is one copy of the state); a new
    :meth:`stage` waits until the previous staged state was released by its writer. What a stage
    found (each tensor's storage, shape, stride, dtype and device, in the order the state is
    walked, and the buffer or alias it became) is kept as the area's plan. While every tensor fits
    the buffer planned for its place (same shape, dtype and device; a new tensor object or a new
    storage does), a stage only walks the state and copies (CPU tensors in one
    ``torch._foreach_copy_``), ties between tensors decided as before; a tensor of another shape,
    dtype or device, or one more tensor, makes that stage find its buffers by path again (and
    free those of tensors gone from the state).

    Args:
        pin_memory: pin the buffers of CUDA tensors (default: when CUDA is available).

    Example:
        >>> area = StagingArea()
        >>> model = torch.nn.Linear(4, 2)
        >>> first = area.stage(model.state_dict()); buffer = first.state["weight"]; first.release()
        >>> second = area.stage(model.state_dict())
        >>> second.state["weight"] is buffer  # the same buffer, refilled
        True
        >>> second.release()
        >>> area.plan_builds  # the second stage reused the first one's plan
        1
    """

    def __init__(self, pin_memory: bool | None = None) -> None:
        self._pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._buffers_lock = threading.Lock()  # the preparing thread adds buffers while others read
        self._preparing: _Preparing | None = None
        self._prepared: set[tuple[Any, ...]] = set()  # paths whose buffer prepare() allocated, unused yet
        self._in_use = threading.Semaphore(1)
        self._streams: dict[torch.device, Any] = {}
        self._plan: _Plan | None = None
        self.prepared_buffers_used = 0  # buffers a stage found allocated by prepare()
        self.plan_builds = 0  # stages that (re)built the plan: the first, then one per change
        self.last_wait_s = 0.0

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the buffers held now (allocated by a stage, or by :meth:`prepare` in the background)."""
        with self._buffers_lock:
            return sum(_tensor_nbytes(buf) for buf in self._buffers.values())

    def prepare(self, state: Any) -> bool:
        """Allocate the buffers a first :meth:`stage` of ``state`` would, on a background thread.

        The calling thread walks ``state`` for the shapes, dtypes and devices of its tensors only
        (no tensor's data is read); a daemon thread allocates a buffer for each and touches its pages,
        so the first checkpoint copies into resident buffers like every later one. The memory is the
        buffers a stage would allocate, only earlier. A :meth:`stage` that comes before the thread is
        done stops it after the buffer in hand and allocates the rest itself. Does nothing (returns
        ``False``) once a stage has planned the buffers or while an earlier call is still allocating.

        Example:
            >>> area = StagingArea()
            >>> area.prepare({"w": torch.ones(1024)})
            True
            >>> area.wait_prepared()  # a stage need not wait: it stops the thread and allocates the rest
            True
            >>> staged = area.stage({"w": torch.ones(1024)})
            >>> area.buffer_bytes, area.prepared_buffers_used
            (4096, 1)
            >>> staged.release()
        """
        if self._plan is not None or (self._preparing is not None and self._preparing.thread.is_alive()):
            return False
        specs: list[_BufferSpec] = []
        _buffer_specs(state, (), specs, set(), self._pin_memory)
        with self._buffers_lock:
            specs = [spec for spec in specs if not _buffer_fits(self._buffers.get(spec.path), spec)]
        preparing = _Preparing(self, specs)
        self._preparing = preparing
        exit_guard.stop_at_exit(self)
        preparing.thread.start()
        return True

    def wait_prepared(self, timeout: float | None = None) -> bool:
        """Block until the buffers :meth:`prepare` allocates are all there; ``False`` on timeout."""
        preparing = self._preparing
        if preparing is not None:
            preparing.thread.join(timeout)
            return not preparing.thread.is_alive()
        return True

    def _stop_preparing(self) -> None:
        """Stop the preparing thread after the buffer it is on (a stage allocates the rest itself)."""
        preparing = self._preparing
        if preparing is not None:
            self._preparing = None
            preparing.cancel.set()
            preparing.thread.join()

    def stop_for_exit(self) -> None:
        """At the process's exit: stop the preparing thread at its next safe point (see ``exit_guard``)."""
        self._stop_preparing()

    def stage(self, state: Any, timeout: float | None = None) -> StagedState:
        """Copy every tensor of ``state`` into host buffers; copy other leaves deeply.

        Raises:
            TimeoutError: the previous staged state was not released within ``timeout`` seconds.
        """
        started = time.perf_counter()
        if not self._in_use.acquire(timeout=timeout):
            raise TimeoutError(
                "the previous checkpoint is still being written to scratch; staging buffers are busy"
            )
        self.last_wait_s = time.perf_counter() - started
        self._stop_preparing()
        if self.last_wait_s > 0.05:
            checkpoint_line(
                "spot_callbacks: waited %.2fs for the previous checkpoint to leave the staging buffers",
                self.last_wait_s,
            )
        try:
            try:
                context = _StageContext(self, self._plan)
                staged = context.copy(state, None if self._plan is not None else ())
            except _PlanChanged:  # nothing was copied yet: walk again, building the plan
                context = _StageContext(self, None)
                staged = context.copy(state, ())
            events = context.finish()
        except BaseException:
            self._in_use.release()
            raise
        return StagedState(self, staged, context.nbytes + cast(_Plan, self._plan).nbytes, events)

    def _release(self) -> None:
        self._in_use.release()

    def _buffer_for(self, path: tuple[Any, ...], tensor: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(path)
        spec = _BufferSpec(
            path, tensor.shape, tensor.dtype, self._pin_memory and tensor.device.type == "cuda"
        )
        if not _buffer_fits(buffer, spec):
            buffer = spec.allocate()
            with self._buffers_lock:
                self._buffers[path] = buffer
        elif path in self._prepared:
            self._prepared.discard(path)
            self.prepared_buffers_used += 1
        return cast(torch.Tensor, buffer)

    def _new_plan(self, plan: _Plan, paths: set[tuple[Any, ...]]) -> None:
        """Keep the plan a stage built; buffers of tensors that left the state go with the old one."""
        self._plan = plan
        with self._buffers_lock:
            self._buffers = {path: buffer for path, buffer in self._buffers.items() if path in paths}
        self._prepared.clear()
        self.plan_builds += 1

    def _stream_for(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]


class _BufferSpec:
    """What a staging buffer is: the path of its tensor in the state, its shape and dtype, pinned or not."""

    __slots__ = ("path", "shape", "dtype", "pin")

    def __init__(self, path: tuple[Any, ...], shape: torch.Size, dtype: torch.dtype, pin: bool) -> None:
        self.path, self.shape, self.dtype, self.pin = path, shape, dtype, pin

    def allocate(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="cpu", pin_memory=self.pin)


def _buffer_fits(buffer: torch.Tensor | None, spec: _BufferSpec) -> bool:
    return (
        buffer is not None
        and buffer.shape == spec.shape
        and buffer.dtype == spec.dtype
        and buffer.is_pinned() == spec.pin
    )


class _Preparing:
    """A daemon thread allocating the buffers of ``specs`` into ``area`` until done or cancelled."""

    def __init__(self, area: StagingArea, specs: list[_BufferSpec]) -> None:
        self.cancel = threading.Event()
        self.thread = threading.Thread(
            target=self._run, args=(area, specs), name="spot-staging-prepare", daemon=True
        )

    def _run(self, area: StagingArea, specs: list[_BufferSpec]) -> None:
        try:
            for spec in specs:
                if self.cancel.is_set():
                    return
                buffer = spec.allocate()
                with area._buffers_lock:  # counted from now (buffer_bytes), resident once touched
                    area._buffers[spec.path] = buffer
                    area._prepared.add(spec.path)
                fault_in(buffer, self.cancel)
        except Exception as err:  # noqa: BLE001 - out of memory here: the stage allocates, and says so then
            log.debug("spot_callbacks: preparing the staging buffers stopped: %r", err)


def _buffer_specs(
    value: Any, path: tuple[Any, ...], specs: list[_BufferSpec], seen: set[_TensorKey], pin_memory: bool
) -> None:
    """The buffers :meth:`_StageContext.copy` would allocate for ``value``, walked the same way (tied
    tensors once); reads each tensor's shape, dtype, device and storage pointer, never its data."""
    if isinstance(value, torch.Tensor):
        tensor, key = _buffered(value)
        if key is None:
            return  # copied whole at the stage: no buffer
        if tensor.numel() and key in seen:
            return
        seen.add(key)
        specs.append(
            _BufferSpec(path, tensor.shape, tensor.dtype, pin_memory and tensor.device.type == "cuda")
        )
        return
    if type(value) in ATOMIC_TYPES or isinstance(value, _ATOMIC):
        return
    if isinstance(value, Mapping):
        for key_, item in value.items():
            _buffer_specs(item, (*path, key_), specs, seen, pin_memory)
    elif type(value) in (list, tuple) or (isinstance(value, tuple) and hasattr(value, "_fields")):
        if all(type(item) in ATOMIC_TYPES for item in value):
            return
        for index, item in enumerate(value):
            _buffer_specs(item, (*path, index), specs, seen, pin_memory)


class _Plan:
    """The tensors of the last stage in walk order: each one's key and the tensor staged for it."""

    def __init__(self) -> None:
        self.keys: list[_TensorKey] = []
        self.staged: list[torch.Tensor] = []
        self.copies: list[bool] = []  # False: an alias of an earlier tensor's buffer
        self.sizes: list[int] = []
        self.nbytes = 0  # of the buffers

    def add(self, staged: torch.Tensor, copied: bool, nbytes: int) -> None:
        self.staged.append(staged)
        self.copies.append(copied)
        self.sizes.append(nbytes)
        self.nbytes += nbytes


def _fits(planned: _TensorKey, key: _TensorKey) -> bool:
    """Whether the buffer staged for the ``planned`` tensor takes this one: same shape, dtype, device."""
    return planned == key or (planned[1] == key[1] and planned[3] == key[3] and planned[4] == key[4])


class _PlanChanged(SpotError):
    """A tensor did not match the plan: the stage restarts and builds a new one."""


_ATOMIC = (str, bytes, int, float, bool, type(None))
# Values that are never changed in place: a snapshot keeps them as they are (also hf/_compat's log copy).
ATOMIC_TYPES = frozenset(_ATOMIC)


def _buffered(tensor: torch.Tensor) -> tuple[torch.Tensor, _TensorKey | None]:
    """``tensor`` as staged (a Parameter detached; other subclasses stay what they are) and the key its
    buffer and its aliases go by; ``None`` for a tensor with no plain buffer shape (sparse, quantized,
    subclassed), copied whole. What a stage copies into buffers and what :meth:`StagingArea.prepare`
    allocates ahead of it are decided here, once."""
    if type(tensor) is not torch.Tensor:
        tensor = tensor.detach()
    if tensor.layout != torch.strided or type(tensor) is not torch.Tensor or tensor.is_quantized:
        return tensor, None
    return tensor, (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype, tensor.device)


class _StageContext:
    """One walk over a state. With a ``plan`` every tensor must fit the buffer planned for its place
    (else :class:`_PlanChanged`, raised before any CPU tensor is copied); without one, it finds each
    tensor's buffer by its path in the state, and the plan is rebuilt."""

    def __init__(self, area: StagingArea, plan: _Plan | None) -> None:
        self.area = area
        self.plan = plan
        self.built = _Plan()
        self.paths: set[tuple[Any, ...]] = set()
        self.nbytes = 0  # of tensors copied whole (sparse, quantized, subclasses); buffers: the plan's
        self.aliases: dict[_TensorKey, torch.Tensor] = {}
        self.cuda_devices: set[torch.device] = set()
        self.sources: list[torch.Tensor] = []  # CPU tensors, copied together by finish()
        self.buffers: list[torch.Tensor] = []

    def copy(self, value: Any, path: tuple[Any, ...] | None) -> Any:
        """A copy of ``value``; ``path`` is ``None`` when following a plan (buffers are the plan's)."""
        if isinstance(value, torch.Tensor):
            return self.copy_tensor(value, path)
        if type(value) is IntoBuffer:
            self.nbytes += _tensor_nbytes(value.buffer)
            self._copy_into(value.buffer, _buffered(value.source)[0])
            return value.buffer
        if type(value) is Adopted:
            self.nbytes += _tensor_nbytes(value.tensor)
            return value.tensor
        if type(value) in ATOMIC_TYPES or isinstance(value, _ATOMIC):
            return value
        if type(value) in (dict, OrderedDict):
            duplicate = type(value)((key, self.copy(item, _child(path, key))) for key, item in value.items())
            if hasattr(value, "_metadata"):  # module state_dict versions, read by load_state_dict
                duplicate._metadata = _copy_plain(value._metadata)
            return duplicate
        if isinstance(value, Mapping):
            mapping: Any = copy.copy(value)  # a Mapping subclass that supports item assignment
            for key, item in value.items():
                mapping[key] = self.copy(item, _child(path, key))
            return mapping
        if type(value) is list:
            if all(type(item) in ATOMIC_TYPES for item in value):  # parameter ids of a param group
                return list(value)
            return [self.copy(item, _child(path, index)) for index, item in enumerate(value)]
        if type(value) is tuple:
            if all(type(item) in ATOMIC_TYPES for item in value):  # random.getstate()'s 625 ints: immutable
                return value
            return tuple(self.copy(item, _child(path, index)) for index, item in enumerate(value))
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
            return type(value)(*(self.copy(item, _child(path, index)) for index, item in enumerate(value)))
        # Anything else (numpy arrays, small objects) may be mutated by training after we return.
        return copy.deepcopy(value)

    def copy_tensor(self, tensor: torch.Tensor, path: tuple[Any, ...] | None) -> torch.Tensor:
        tensor, key = _buffered(tensor)
        if key is None:
            copied = tensor.detach().to("cpu", copy=True)
            self.nbytes += _tensor_nbytes(copied)
            return copied
        built = self.built
        position = len(built.keys)
        built.keys.append(key)
        if tensor.numel() and key in self.aliases:
            staged = self.aliases[key]  # tied weights stay one tensor, as torch.save would store them
            built.add(staged, copied=False, nbytes=0)
            return staged
        plan = self.plan
        if plan is None:
            assert path is not None  # no plan: the walk carries paths
            staged = self.area._buffer_for(path, tensor)
            self.paths.add(path)
            nbytes = _tensor_nbytes(staged)
        elif position < len(plan.keys) and plan.copies[position] and _fits(plan.keys[position], key):
            # A new tensor in the same place (a fresh RNG state, a reloaded parameter) refills its buffer.
            staged, nbytes = plan.staged[position], plan.sizes[position]
        else:
            raise _PlanChanged
        built.add(staged, copied=True, nbytes=nbytes)
        self._copy_into(staged, tensor)
        self.aliases[key] = staged
        return staged

    def _copy_into(self, buffer: torch.Tensor, tensor: torch.Tensor) -> None:
        if tensor.is_cuda:
            stream = self.area._stream_for(tensor.device)
            if tensor.device not in self.cuda_devices:
                stream.wait_stream(torch.cuda.current_stream(tensor.device))
                self.cuda_devices.add(tensor.device)
            with torch.cuda.stream(stream), torch.no_grad():
                buffer.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)
        elif tensor.is_cpu:
            self.sources.append(tensor)
            self.buffers.append(buffer)
        else:  # another accelerator: a plain synchronous copy
            with torch.no_grad():
                buffer.copy_(tensor)

    def finish(self) -> list[Any]:
        if self.buffers:
            with torch.no_grad():
                torch._foreach_copy_(self.buffers, self.sources)
            self.sources, self.buffers = [], []
        if self.plan is None:
            self.area._new_plan(self.built, self.paths)
        else:
            self.area._plan = self.built  # the same buffers; the tensors' keys may have moved
        events = []
        for device in self.cuda_devices:
            stream = self.area._stream_for(device)
            event = torch.cuda.Event()
            event.record(stream)
            # Later kernels on the training stream (the optimizer step) must not overwrite a
            # parameter before its copy has left: the GPU waits, the Python thread does not.
            torch.cuda.current_stream(device).wait_stream(stream)
            events.append(event)
        return events


def _child(path: tuple[Any, ...] | None, key: Any) -> tuple[Any, ...] | None:
    return None if path is None else (*path, key)


def _copy_plain(value: Any) -> Any:
    """A deep copy of plain data (dicts and lists of strings and numbers); ``deepcopy`` for the rest."""
    kind = type(value)
    if kind in ATOMIC_TYPES:
        return value
    if kind in (dict, OrderedDict) and all(type(key) in ATOMIC_TYPES for key in value):
        return kind((key, _copy_plain(item)) for key, item in value.items())
    if kind is list:
        return [_copy_plain(item) for item in value]
    return copy.deepcopy(value)


def _tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def write_state(staged: StagedState, path: str | os.PathLike[str]) -> FileDigest:
    """Serialize a staged state with ``torch.save`` to ``path``, checksumming as it writes.

    The file appears under its name only once complete (written beside it, then renamed); a
    failed write leaves nothing behind (on a full disk, a partial file would keep it full).

    Raises:
        OSError: with ``filename`` set to ``path``, also for a full disk (``errno.ENOSPC``).
    """
    staged.wait_copied()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        digest = save_hashed(staged.state, tmp, named_as=target)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return digest


def save_hashed(
    obj: Any, path: str | os.PathLike[str], named_as: str | os.PathLike[str] | None = None
) -> FileDigest:
    """``torch.save(obj)`` into ``path`` through the hashing writer: the file's digest, no second pass
    over its bytes, which reach the disk in :data:`~spot_callbacks.store.checksums.WRITE_PIECE_BYTES`
    writes.

    The zip records are named ``archive/...`` (torch's name when it writes to a file object), not after
    the file as ``torch.save(obj, path)`` names them; ``torch.load`` reads both alike.

    Raises:
        OSError: with ``filename`` set (``named_as``, else ``path``), also for a full disk, which
        ``torch.save`` reports with no file name.
    """
    try:
        with open(path, "wb") as raw:
            writer = ChecksumWriter(raw)
            torch.save(obj, cast(IO[bytes], writer))  # a write-only file object
    except OSError as err:
        if err.errno is not None and err.filename is None:
            raise OSError(err.errno, os.strerror(err.errno), os.fspath(named_as or path)) from err
        raise
    return writer.digest()


def unsafe_checkpoint_error(
    path: str | os.PathLike[str], err: BaseException, allow: str
) -> UnsafeCheckpointError:
    """The error for a state file that safe loading refused; ``allow`` says how to load it when trusted."""
    return UnsafeCheckpointError(
        f"{os.fspath(path)} holds objects that safe loading refuses to construct; nothing from it was "
        f"executed. If you trust this file and the objects it names, {allow}. Details: {err}"
    )


# A state file is a zip that torch.save writes uncompressed: what it unpacks to is about its size
# on disk. More is a decompression bomb; so is a count of entries no checkpoint has.
MAX_ARCHIVE_AMPLIFICATION = 2.0
MAX_ARCHIVE_ENTRIES = 1_000_000


def check_archive_bounds(path: str | os.PathLike[str]) -> None:
    """Raise :class:`CorruptCheckpointError` before loading a state file whose archive would unpack
    to much more than it stores, or to more than ``SPOT_CHECKPOINT_MAX_BYTES``.

    Example:
        >>> import tempfile, zipfile
        >>> from spot_callbacks.store.layout import STATE_FILE
        >>> bomb = tempfile.mkdtemp() + "/" + STATE_FILE
        >>> with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as archive:
        ...     archive.writestr("archive/data/0", bytes(50_000_000))
        >>> check_archive_bounds(bomb)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        spot_callbacks.errors.CorruptCheckpointError: ...unpacks to 50000000 bytes from ... on disk...
    """
    if not zipfile.is_zipfile(path):
        return  # the legacy format: torch reads it as it stands
    on_disk = os.path.getsize(path)
    with zipfile.ZipFile(path) as archive:
        entries = archive.infolist()
    unpacked = sum(entry.file_size for entry in entries)
    limit = ManifestLimits.from_env().max_total_bytes
    if (
        len(entries) > MAX_ARCHIVE_ENTRIES
        or unpacked > limit
        or unpacked > MAX_ARCHIVE_AMPLIFICATION * on_disk + 2**20
    ):
        raise CorruptCheckpointError(
            f"{os.fspath(path)} unpacks to {unpacked} bytes from {on_disk} on disk in {len(entries)} entries "
            f"(a state file is stored uncompressed; limit SPOT_CHECKPOINT_MAX_BYTES={limit}); not loaded"
        )


def load_state(
    path: str | os.PathLike[str],
    map_location: Any = "cpu",
    safe_globals: Sequence[Any] = (),
    weights_only: bool = True,
) -> Any:
    """Load a state file written by :func:`write_state` without running arbitrary pickled code.

    ``safe_globals`` lists extra classes or functions the file may construct (see
    ``torch.serialization.add_safe_globals``). ``weights_only=False`` executes whatever the
    file's pickle says: use it only for files you wrote yourself.

    Example:
        >>> import tempfile
        >>> area = StagingArea(); staged = area.stage({"w": torch.zeros(3)})
        >>> path = tempfile.mkdtemp() + "/state.pt"; _ = write_state(staged, path); staged.release()
        >>> load_state(path)["w"].shape
        torch.Size([3])
    """
    if not weights_only:
        return torch.load(path, map_location=map_location, weights_only=False)
    check_archive_bounds(path)
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        allow = "allow them with safe_globals=[...] (torch.serialization.add_safe_globals)"
        raise unsafe_checkpoint_error(path, err, allow) from None


# ---------------------------------------------------------------- RNG streams
def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and CUDA generator states, as tensors, ints and strings only.

    Example:
        >>> state = capture_rng_state(); a = torch.rand(2)
        >>> restore_rng_state(state); torch.equal(a, torch.rand(2))
        True
    """
    version, mt_state, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(mt_state, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "kind": str(np_kind),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def rng_state_problem(state: Any) -> str | None:
    """Why :func:`restore_rng_state` would fail on ``state`` (from a checkpoint: untrusted), or
    ``None``: each part is tried on a throwaway generator, so nothing global changes.

    Example:
        >>> rng_state_problem(capture_rng_state()) is None, rng_state_problem({"python": "x"})[:9]
        (True, 'TypeError')
    """
    try:
        py = state["python"]
        random.Random().setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
        npy = state["numpy"]
        np.random.RandomState().set_state(
            (npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["gauss"])
        )
        torch.Generator().set_state(state["torch"])
        cuda = state.get("cuda", [])
        if not isinstance(cuda, (list, tuple)) or not all(
            isinstance(item, torch.Tensor) and item.dtype == torch.uint8 and item.dim() == 1 for item in cuda
        ):
            raise TypeError("its CUDA states are not a list of byte tensors")
    except Exception as err:  # noqa: BLE001 - whatever restoring it would raise
        return f"{type(err).__name__}: {err}"[:300]
    return None


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state` (a ``state`` from a store passed :func:`rng_state_problem`)."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        (npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["gauss"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            torch.cuda.set_rng_state(cuda_states[0])
