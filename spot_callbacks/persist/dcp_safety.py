"""Sharded (DCP) checkpoints from a store, read without running their pickles.

``torch.distributed.checkpoint`` keeps two kinds of pickle in a checkpoint folder, and loads both
whole: the ``.metadata`` index (``FileSystemReader.read_metadata``: ``pickle.load``) and every
non-tensor value, a "byte item" in a ``.distcp`` file (``DefaultLoadPlanner.load_bytes``:
``torch.load(weights_only=False)``). Whoever can write the bucket writes those bytes, and can
recompute the manifest's sizes and checksums too, so a committed checkpoint is no proof that its
pickles are DCP's. Here (read off torch 2.13):

- :class:`MetadataUnpickler` builds only what DCP writes into ``.metadata`` (its metadata
  dataclasses, ``_StorageInfo``, torch dtypes, layouts, memory formats, ``torch.Size``, paths);
  any other name is refused before it is imported: :class:`~spot_callbacks.errors.UnsafeCheckpointError`.
- :class:`SafeFileSystemReader` reads ``.metadata`` with it; :class:`SafeLoadPlanner` loads byte
  items with ``weights_only=True``. :func:`~spot_callbacks.persist.sharded.load_sharded_state` uses both.
- :func:`check_sharded_folder` is the resume's check of a pulled checkpoint before any framework
  sees it (Lightning's strategies and accelerate load with DCP's own reader and planner): every
  DCP folder in it, its ``.metadata`` through the unpickler, every byte item's bytes, sliced and
  transformed exactly as DCP will read them, through ``weights_only`` loading. Once these bytes pass
  both allowlists, a full unpickling of the same local bytes constructs the same objects and runs
  nothing else. A failure is :class:`~spot_callbacks.errors.CorruptCheckpointError`: damage.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path, PosixPath, PurePosixPath, PureWindowsPath, WindowsPath
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint import FileSystemReader

# DCP's private pieces are used beside their one use (torch 2.13): _StorageInfo and
# _MEM_FORMAT_ENCODING are what .metadata pickles, set_element puts a byte item back into a nested
# state dict, _StorageReaderTransforms un-transforms a stored slice (compression) as DCP does.
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StorageReaderTransforms
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from spot_callbacks.errors import CorruptCheckpointError, UnsafeCheckpointError
from spot_callbacks.store.layout import DCP_METADATA_FILE, is_dcp_index

METADATA_NAME = DCP_METADATA_FILE


def _torch_constants() -> dict[tuple[str, str], Any]:
    # Listed from torch's own namespace, never looked up by the pickle's name: torch.__getattr__
    # imports submodules.
    kinds = (torch.dtype, torch.layout, torch.memory_format)
    return {("torch", name): value for name, value in vars(torch).items() if isinstance(value, kinds)}


_METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **{
        ("torch.distributed.checkpoint.metadata", cls.__name__): cls
        for cls in (
            Metadata,
            TensorStorageMetadata,
            BytesStorageMetadata,
            ChunkStorageMetadata,
            TensorProperties,
            MetadataIndex,
            StorageMeta,
            _MEM_FORMAT_ENCODING,
        )
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a dict lookup by name
    # StorageMeta.checkpoint_id: the folder DCP saved to, as the writer was given it.
    **{("pathlib", cls.__name__): cls for cls in (PosixPath, PurePosixPath, WindowsPath, PureWindowsPath)},
    **_torch_constants(),
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file, constructing nothing DCP does not write there.

    Every global the pickle names is looked up in a fixed table of the objects DCP's
    ``FileSystemWriter`` pickles; any other name raises :class:`UnsafeCheckpointError` before its
    module is imported (so before any of its code runs).

    Example:
        >>> import os
        >>> MetadataUnpickler(io.BytesIO(pickle.dumps(torch.Size([2, 3])))).load()
        torch.Size([2, 3])
        >>> MetadataUnpickler(io.BytesIO(pickle.dumps(os.system))).load()
        Traceback (most recent call last):
        ...
        spot_callbacks.errors.UnsafeCheckpointError: the pickle names 'posix.system', which DCP never writes into .metadata
    """

    def __init__(self, file: IO[bytes]) -> None:
        # No Python 2 name mapping: the table holds Python 3 names only, and mapped ones are refused.
        super().__init__(file, fix_imports=False)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _METADATA_GLOBALS[(module, name)]
        except (KeyError, TypeError):
            raise UnsafeCheckpointError(
                f"the pickle names {_printable(repr(f'{module}.{name}'))}, which DCP never writes into {METADATA_NAME}"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(
            f"the pickle holds a persistent id ({_printable(repr(pid))}), which DCP never writes"
        )


def read_metadata(file: IO[bytes], name: str = METADATA_NAME) -> Metadata:
    """Unpickle a DCP ``.metadata`` stream with :class:`MetadataUnpickler`; check it is DCP's ``Metadata``.

    Raises :class:`UnsafeCheckpointError` for a pickle that names anything else (nothing of it was
    run), :class:`CorruptCheckpointError` for one that cannot be read or holds something else.

    Example:
        >>> read_metadata(io.BytesIO(pickle.dumps({"state_dict_metadata": {}})), "x/.metadata")
        Traceback (most recent call last):
        ...
        spot_callbacks.errors.CorruptCheckpointError: x/.metadata is not DCP metadata: it holds a dict
    """
    try:
        metadata = MetadataUnpickler(file).load()
    except UnsafeCheckpointError as err:
        raise UnsafeCheckpointError(f"{name}: {err}; nothing of it was run") from None
    except Exception as err:  # noqa: BLE001 - a truncated or garbled pickle: unreadable, never the user's code
        raise CorruptCheckpointError(f"{name} cannot be read: {type(err).__name__}: {_reason(err)}") from err
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{name} is not DCP metadata: it holds a {type(metadata).__name__}")
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        raise CorruptCheckpointError(
            f"{name} is not DCP metadata: no state_dict_metadata or storage_data dict"
        )
    return metadata


def load_byte_item(data: IO[bytes], name: str) -> Any:
    """One byte item (a non-tensor value of the state) loaded with ``weights_only=True``.

    Example:
        >>> buffer = io.BytesIO()
        >>> torch.save({"lr": 0.1}, buffer)
        >>> _ = buffer.seek(0)
        >>> load_byte_item(buffer, "optimizer.param_groups.0")
        {'lr': 0.1}
    """
    try:
        return torch.load(data, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            f"byte item {name!r} holds objects that weights_only loading refuses to construct; nothing "
            f"of it was run (state of your own that holds them: allow them with "
            f"torch.serialization.add_safe_globals([...])): {_reason(err)}"
        ) from None


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``.metadata`` is read with :class:`MetadataUnpickler`.

    Example:
        >>> import tempfile, torch.distributed.checkpoint as dcp
        >>> folder = tempfile.mkdtemp()
        >>> _ = dcp.save({"w": torch.ones(2)}, checkpoint_id=folder, no_dist=True)
        >>> sorted(SafeFileSystemReader(folder).read_metadata().state_dict_metadata)
        ['w']
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = read_metadata(cast(IO[bytes], stream), os.fspath(path))
        # As FileSystemReader.read_metadata does after its pickle.load.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        storage_meta = cast(StorageMeta, metadata.storage_meta)
        storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner`` that loads byte items with ``weights_only=True`` (torch's loads them whole).

    Example:
        >>> import tempfile, torch.distributed.checkpoint as dcp
        >>> folder = tempfile.mkdtemp()
        >>> _ = dcp.save({"opt": {"lr": 0.5, "w": torch.ones(2)}}, checkpoint_id=folder, no_dist=True)
        >>> state = {"opt": {"lr": 0.0, "w": torch.zeros(2)}}
        >>> dcp.load(state, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner(), no_dist=True)
        >>> state["opt"]["lr"]
        0.5
    """

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = load_byte_item(value, fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def is_metadata_file(path: Path) -> bool:
    """True for a DCP index: ``.metadata`` or a rank's ``__N.metadata``.

    Example:
        >>> [is_metadata_file(Path(n)) for n in (".metadata", "__3.metadata", "meta.pt")]
        [True, True, False]
    """
    return is_dcp_index(path.name)


def check_dcp_folder(folder: str | os.PathLike[str]) -> int:
    """Check one DCP folder as :func:`check_sharded_folder` does; return how many byte items it read.

    Example:
        >>> import tempfile, torch.distributed.checkpoint as dcp
        >>> folder = tempfile.mkdtemp()
        >>> _ = dcp.save({"epoch": 1, "w": torch.ones(2)}, checkpoint_id=folder, no_dist=True)
        >>> check_dcp_folder(folder)
        1
    """
    return _check_folder(Path(folder), f"{os.fspath(folder)}/")


def check_sharded_folder(path: str | os.PathLike[str]) -> list[Path]:
    """Raise :class:`CorruptCheckpointError` unless every DCP folder under ``path`` loads without running code.

    A DCP folder is one holding ``.metadata`` (or a rank's ``__N.metadata``): a sharded Lightning
    checkpoint is one, a Trainer's FSDP ``checkpoint-N`` holds two (``pytorch_model_fsdp_0/``,
    ``optimizer_0/``). Each index must unpickle through :class:`MetadataUnpickler` into DCP's
    ``Metadata`` whose byte items lie inside its folder's files, and each byte item must load
    with ``weights_only=True``. Messages name files relative to ``path``. Returns the DCP
    folders checked (none: nothing to check).

    Example:
        >>> import tempfile, torch.distributed.checkpoint as dcp
        >>> root = Path(tempfile.mkdtemp())
        >>> _ = dcp.save({"step": 3, "w": torch.ones(2)}, checkpoint_id=root / "optimizer_0", no_dist=True)
        >>> [folder.name for folder in check_sharded_folder(root)]
        ['optimizer_0']
        >>> _ = (root / "optimizer_0" / ".metadata").write_bytes(pickle.dumps(print))
        >>> check_sharded_folder(root)
        Traceback (most recent call last):
        ...
        spot_callbacks.errors.CorruptCheckpointError: optimizer_0/.metadata: the pickle names 'builtins.print', which DCP never writes into .metadata; nothing of it was run
    """
    root = Path(path)
    folders = sorted({p.parent for p in root.rglob("*") if p.is_file() and is_metadata_file(p)})
    for folder in folders:
        relative = folder.relative_to(root).as_posix()
        _check_folder(folder, "" if relative == "." else f"{relative}/")
    return folders


def _check_folder(folder: Path, prefix: str) -> int:
    """``prefix``: how messages name the folder ("" for the checkpoint's top folder)."""
    checked = 0
    for index_file in sorted(p for p in folder.iterdir() if p.is_file() and is_metadata_file(p)):
        where = f"{prefix}{index_file.name}"
        with index_file.open("rb") as stream:
            metadata = _as_damage(where, read_metadata, stream, where)
        checked += _check_byte_items(folder, prefix, where, metadata)
    return checked


def _check_byte_items(folder: Path, prefix: str, where: str, metadata: Metadata) -> int:
    transforms = _StorageReaderTransforms()
    checked = 0
    for fqn, kind in metadata.state_dict_metadata.items():
        if not isinstance(kind, BytesStorageMetadata):
            continue  # tensors: DCP itself loads them with weights_only=True
        item = f"{where}: byte item {_printable(repr(fqn))}"
        entry = metadata.storage_data.get(MetadataIndex(fqn)) if isinstance(fqn, str) else None
        if not isinstance(entry, _StorageInfo):
            raise CorruptCheckpointError(f"{item} has no storage entry")
        stored = _stored_bytes(folder, entry, item, prefix)
        descriptors = entry.transform_descriptors or ()
        value = _as_damage(item, _untransformed, transforms, descriptors, stored)
        _as_damage(f"{prefix}{entry.relative_path}", load_byte_item, value, fqn)
        checked += 1
    return checked


def _stored_bytes(folder: Path, entry: _StorageInfo, what: str, prefix: str) -> IO[bytes]:
    name, offset, length = entry.relative_path, entry.offset, entry.length
    plain = (
        isinstance(name, str)
        and name.isprintable()
        and name not in ("", ".", "..")
        and not re.search(r"[/\\]", name)
    )
    if not plain or not (folder / name).is_file():
        raise CorruptCheckpointError(f"{what} is stored in {name!r}, not a file of its folder")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (offset, length)):
        raise CorruptCheckpointError(f"{what} has offset {offset!r} and length {length!r}")
    descriptors = entry.transform_descriptors
    if descriptors is not None and not (
        isinstance(descriptors, (list, tuple)) and all(isinstance(d, str) for d in descriptors)
    ):
        raise CorruptCheckpointError(f"{what} has transform descriptors {descriptors!r}")
    with (folder / name).open("rb") as shard:
        shard.seek(offset)
        data = shard.read(length)
    if len(data) != length:
        size = (folder / name).stat().st_size
        raise CorruptCheckpointError(
            f"{what} lies at bytes {offset}-{offset + length} of {prefix}{name}, which holds {size}"
        )
    return io.BytesIO(data)


def _untransformed(transforms: _StorageReaderTransforms, descriptors: Any, stored: IO[bytes]) -> io.BytesIO:
    # Read whole, as FileSystemReader.read_data hands a byte item to the planner.
    # The read item is not consulted by the transforms this reader allows (descriptors decide).
    read_item = cast(Any, None)
    return io.BytesIO(transforms.transform_load_stream(read_item, descriptors, stored).read(-1))


def _as_damage(where: str, read: Callable[..., Any], *args: Any) -> Any:
    """``read(*args)``; what it raises becomes :class:`CorruptCheckpointError` (damage: the resume falls back)."""
    try:
        return read(*args)
    except CorruptCheckpointError:
        raise
    except UnsafeCheckpointError as err:
        raise CorruptCheckpointError(str(err) if str(err).startswith(where) else f"{where}: {err}") from err
    except Exception as err:  # noqa: BLE001 - unreadable is damage, never the user's error
        raise CorruptCheckpointError(
            f"{where} cannot be loaded: {type(err).__name__}: {_reason(err)}"
        ) from err


def _reason(err: BaseException) -> str:
    """What ``err`` says went wrong, in one printable sentence. torch's weights_only refusal wraps
    its reason in paragraphs of advice; the name it refused comes from the file, so it is escaped."""
    text = str(err)
    refusal = re.search(r"WeightsUnpickler error: ([^\n]*)", text)
    if refusal:
        text = refusal.group(1)
    else:
        paragraphs = [part.strip() for part in re.split(r"\n\s*\n", text) if part.strip()]
        useful = [
            p for p in paragraphs if not p.startswith(("Weights only load failed", "Check the documentation"))
        ]
        text = (useful or paragraphs or [type(err).__name__])[0]
    sentence = " ".join(text.split()).split(". ")[0]
    return _printable(sentence)


def _printable(text: str, limit: int = 300) -> str:
    escaped = "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)
    return escaped if len(escaped) <= limit else f"{escaped[:limit]}..."
