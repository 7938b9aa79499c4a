"""What the Trainer will load from a pulled ``checkpoint-N``, checked before it is handed the folder.

A committed checkpoint whose bytes match its manifest can still be unloadable (a truncated
``optimizer.pt`` committed by a writer that lied, a safetensors header that points past the end,
a ``trainer_state.json`` the Trainer cannot parse): ``train(resume_from_checkpoint=...)`` would
crash on it. :func:`check_loadable` finds it first, so the resume falls back to the previous
checkpoint with one warning, as for every other kind of damage (``resume.py``). Nothing here runs
a pickle: the ``.pt``/``.pth`` files are read with ``torch.load(weights_only=True, mmap=True)``,
as the Trainer reads them (with its numpy allowlist, ``trainer_pt_utils.safe_globals``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from transformers.trainer_pt_utils import safe_globals

from spot_callbacks.errors import CorruptCheckpointError, ManifestError
from spot_callbacks.store import CheckpointInfo
from spot_callbacks.store.layout import DCP_METADATA_FILE, HF_TRAINER_STATE_FILE
from spot_callbacks.store.manifest_limits import load_bounded_json

TRAINER_STATE = HF_TRAINER_STATE_FILE
TRAINER_STATE_MAX_BYTES = 64 * 1024 * 1024  # a log history of millions of rows still fits
SAFETENSORS_HEADER_MAX_BYTES = 100 * 1024 * 1024  # safetensors' own limit
MAX_GLOBAL_STEP = 10**12
TORCH_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt")
WEIGHT_NAMES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")  # fmt: skip
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}  # fmt: skip


def check_loadable(folder: Path, info: CheckpointInfo) -> None:
    """Raise :class:`CorruptCheckpointError` naming the file and the fault unless the Trainer can
    resume from ``folder``: ``trainer_state.json`` parses (bounded depth and size, known keys, a
    sane ``global_step``), weights exist with safetensors headers in bounds, and every
    ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt`` and ``rng_state*.pth`` loads with
    ``weights_only=True`` (RNG states that the generators accept).

    Example:
        >>> import tempfile
        >>> from datetime import datetime, timezone
        >>> info = CheckpointInfo(3, "memory://run/step-000000003", datetime.now(timezone.utc), "end", 0, "hf")
        >>> check_loadable(Path(tempfile.mkdtemp()), info)
        Traceback (most recent call last):
        ...
        spot_callbacks.errors.CorruptCheckpointError: memory://run/step-000000003: trainer_state.json is missing
    """
    _check_trainer_state(folder, info)
    _check_weights(folder, info)
    for path in [*(folder / name for name in TORCH_FILES), *sorted(folder.glob("rng_state*.pth"))]:
        if path.is_file():
            loaded = _torch_load(path, info)
            if path.name.startswith("rng_state"):
                _check_rng_state(loaded, path, info)


def _fault(info: CheckpointInfo, name: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{info.url}: {name} {what}")


def _check_trainer_state(folder: Path, info: CheckpointInfo) -> None:
    path = folder / TRAINER_STATE
    if not path.is_file():
        raise _fault(info, TRAINER_STATE, "is missing")
    if path.stat().st_size > TRAINER_STATE_MAX_BYTES:
        raise _fault(info, TRAINER_STATE, f"is over {TRAINER_STATE_MAX_BYTES} bytes")
    try:
        doc = load_bounded_json(path.read_bytes(), TRAINER_STATE)
    except ManifestError as err:
        raise _fault(info, TRAINER_STATE, f"cannot be parsed: {err}") from None
    if not isinstance(doc, dict):
        raise _fault(info, TRAINER_STATE, "is not a JSON object")
    known = {field.name for field in dataclasses.fields(transformers.TrainerState)}
    unknown = sorted(set(doc) - known)
    if unknown:  # TrainerState(**doc) raises TypeError for them
        raise _fault(info, TRAINER_STATE, f"has keys the Trainer does not know: {', '.join(unknown)[:120]}")
    step = doc.get("global_step")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_GLOBAL_STEP:
        raise _fault(
            info, TRAINER_STATE, f"has global_step {step!r:.40}, not an integer in 0..{MAX_GLOBAL_STEP}"
        )
    if step != info.step:
        raise _fault(info, TRAINER_STATE, f"says global_step {step} in the checkpoint of step {info.step}")
    for key, value in doc.items():
        expected = _STATE_VALUES.get(key)
        if expected is not None and not expected[0](value):
            raise _fault(info, TRAINER_STATE, f"has {key} {value!r:.40}, not {expected[1]}")
    for name, saved in (doc.get("stateful_callbacks") or {}).items():
        entries = saved if isinstance(saved, list) else [saved]
        if not all(_callback_state(entry) for entry in entries):
            raise _fault(
                info, TRAINER_STATE, f"has stateful_callbacks[{name!r:.40}] that is not args and attributes"
            )


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e300


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_GLOBAL_STEP


def _callback_state(entry: Any) -> bool:
    """What the Trainer rebuilds a callback from (``type(callback)(**args)``, then ``setattr``)."""
    return isinstance(entry, dict) and all(
        isinstance(entry.get(part, {}), dict) and all(isinstance(key, str) for key in entry.get(part, {}))
        for part in ("args", "attributes")
    )


# What the Trainer writes in each field of trainer_state.json, and what it uses without checking:
# another type or value there crashes train() after the weights are loaded (log_history a string,
# logging_steps 0 or a string, train_batch_size or total_flos a string, stateful_callbacks a list).
_STATE_VALUES: dict[str, tuple[Any, str]] = {
    **dict.fromkeys(("epoch", "total_flos"), (_number, "a number >= 0")),
    **dict.fromkeys(("max_steps", "num_train_epochs", "num_input_tokens_seen"), (_count, "a count")),
    **dict.fromkeys(
        ("logging_steps", "eval_steps", "save_steps"), (lambda v: _number(v) and v > 0, "a number > 0")
    ),
    "train_batch_size": (lambda v: v is None or _count(v), "a count"),
    "best_global_step": (lambda v: v is None or _count(v), "a step"),
    "best_metric": (
        lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)),
        "a number",
    ),
    **dict.fromkeys(
        ("best_model_checkpoint", "trial_name"), (lambda v: v is None or isinstance(v, str), "a string")
    ),
    **dict.fromkeys(
        ("is_local_process_zero", "is_world_process_zero", "is_hyper_param_search"),
        (lambda v: isinstance(v, bool), "true or false"),
    ),
    "trial_params": (lambda v: v is None or isinstance(v, dict), "an object"),
    "log_history": (
        lambda v: isinstance(v, list) and all(isinstance(row, dict) for row in v),
        "a list of objects",
    ),
    "stateful_callbacks": (lambda v: v is None or isinstance(v, dict), "an object"),
}


def _check_weights(folder: Path, info: CheckpointInfo) -> None:
    sharded = any(path.is_dir() and (path / DCP_METADATA_FILE).is_file() for path in folder.iterdir())
    if not sharded and not any((folder / name).is_file() for name in WEIGHT_NAMES):
        raise _fault(info, "the model weights", f"are missing (none of {', '.join(WEIGHT_NAMES[:3])}, ...)")
    for path in sorted(folder.glob("*.safetensors")):
        _check_safetensors(path, info)
    for index in sorted(folder.glob("*.index.json")):
        try:
            weight_map = json.loads(index.read_bytes()).get("weight_map", {})
            shards = set(weight_map.values())
        except (ValueError, AttributeError, TypeError):
            raise _fault(info, index.name, "is not a weight index") from None
        missing = sorted(
            name for name in shards if not isinstance(name, str) or not (folder / name).is_file()
        )
        if missing:
            raise _fault(
                info, index.name, f"names shards that are missing: {', '.join(map(str, missing))[:120]}"
            )


def _check_safetensors(path: Path, info: CheckpointInfo) -> None:
    """The header's length and every tensor's offsets fit the file, and its shape fits its bytes."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < length <= min(SAFETENSORS_HEADER_MAX_BYTES, size - 8):
            raise _fault(info, path.name, f"has a header length of {length} in a file of {size} bytes")
        raw = handle.read(length)
    try:
        header = json.loads(raw)
    except ValueError:
        raise _fault(info, path.name, "has a header that is not JSON") from None
    data_bytes = size - 8 - length
    if not isinstance(header, dict):
        raise _fault(info, path.name, "has a header that is not a JSON object")
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            count = math.prod(int(dim) for dim in entry["shape"])
            width = _DTYPE_BYTES.get(entry["dtype"])
        except (KeyError, TypeError, ValueError):
            raise _fault(info, path.name, f"has a bad header entry for {name!r:.60}") from None
        fits = isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data_bytes
        if not fits or (width is not None and end - begin != count * width):
            raise _fault(info, path.name, f"has tensor {name!r:.60} outside its {data_bytes} data bytes")


def _torch_load(path: Path, info: CheckpointInfo) -> Any:
    try:
        # The Trainer's own allowlist (numpy arrays of the RNG state), nothing more.
        with safe_globals():
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001 - anything the Trainer's own load would fail on is damage
        raise _fault(
            info, path.name, f"cannot be loaded with weights_only=True: {type(err).__name__}: {err}"[:300]
        ) from None


def _check_rng_state(state: Any, path: Path, info: CheckpointInfo) -> None:
    """The Trainer applies these to the global generators: each must be one they accept (tried on
    throwaway generators, so nothing global changes)."""
    try:
        if not isinstance(state, dict):
            raise TypeError(f"a {type(state).__name__}, not a dict")
        random.Random().setstate(state["python"])
        np.random.RandomState().set_state(state["numpy"])
        torch.Generator().set_state(state["cpu"])
    except Exception as err:  # noqa: BLE001 - a state the generators refuse crashes the resume
        raise _fault(
            info, path.name, f"holds RNG states the generators refuse: {type(err).__name__}: {err}"[:300]
        ) from None
