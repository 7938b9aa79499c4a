"""Every exception spot_callbacks raises, in one place, under one root: :class:`SpotError`.

``except SpotError`` catches every failure the library raises on purpose. Each class also keeps
the builtin base callers already catch (``ValueError`` for configuration, ``FileNotFoundError``
for a missing checkpoint, ``TimeoutError`` for an abandoned attempt). Each message says what was
wrong, with the value, and what to do::

    SpotError
    ├── ConfigError(ValueError)              a setting or argument spot_callbacks cannot use
    ├── CheckpointError                      about a checkpoint in a store
    │   ├── CheckpointNotFoundError(FileNotFoundError)   no committed checkpoint at that step
    │   ├── ManifestError                    a manifest that cannot be trusted
    │   ├── CorruptCheckpointError           files that do not match their manifest
    │   ├── DeleteIncompleteError            a delete the store answered, objects left
    │   ├── ForeignCheckpointError           a step folder that is a link: never ours
    │   ├── UnsafeDestinationError           a pull destination that holds what is not the run's
    │   ├── RunLockedError                   another live run holds the dirpath
    │   └── StoreUnavailableError            the store cannot hold checkpoints (found at start)
    │       └── UnknownStoreError(ValueError)    no filesystem for the protocol
    ├── UnsafeCheckpointError(pickle.UnpicklingError)   objects safe loading refuses to build
    ├── IncompatibleCheckpointError(RuntimeError)       tensors that do not fit the model
    ├── AttemptTimeoutError(TimeoutError)    one storage attempt abandoned (retried as transient)
    ├── MetadataError                        a cloud metadata service gave no usable answer
    ├── PersistError(RuntimeError)           a checkpoint could not be made durable
    └── LockLostError(RuntimeError)          the run lost its lock: it stopped checkpointing

Example:
    >>> issubclass(CheckpointNotFoundError, SpotError) and issubclass(CheckpointNotFoundError, FileNotFoundError)
    True
"""

from __future__ import annotations

import errno
import os
import pickle
from pathlib import Path


class SpotError(Exception):
    """The root of every exception spot_callbacks raises on purpose.

    ``said_in_log`` is True once the library has logged the error's one line (the preflight does,
    before the first step), so a launcher that catches it need not print it again.
    """

    said_in_log: bool = False


class ConfigError(SpotError, ValueError):
    """A configuration key has a value spot_callbacks cannot use; the message names the key and the fix."""


class CheckpointError(SpotError):
    """Base class of the errors about a checkpoint in a store."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint at that step (the folder is missing or has no manifest)."""


class ManifestError(CheckpointError):
    """A manifest exists but cannot be trusted: not JSON, wrong fields, unsafe names, newer format."""


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint's files do not match its manifest (missing, truncated, altered)."""


class DeleteIncompleteError(CheckpointError):
    """The store answered a delete as done, yet objects stayed (a per-key refusal: a bucket policy,
    an object lock); ``remaining`` names them."""

    def __init__(self, message: str, remaining: list[str]) -> None:
        super().__init__(message)
        self.remaining = remaining


class ForeignCheckpointError(CheckpointError):
    """A step folder is a symbolic link: another run's checkpoint, never read as ours or deleted through."""


class UnsafeDestinationError(CheckpointError):
    """A pull's destination holds what is not the run's (or is a link, a file, the current directory)."""


class RunLockedError(CheckpointError):
    """Another live run holds the lock of this ``dirpath``."""


class StoreUnavailableError(CheckpointError):
    """The store of ``dirpath`` cannot hold checkpoints; found at start, before anything is trained.

    ``cause`` says what is wrong in one line, ``fix`` what to do; the backend's own exception is
    logged at debug level (and kept as ``backend_error``), never printed as a traceback.

    Example:
        >>> str(StoreUnavailableError("s3://b/run", "no bucket 'b'", "create it"))
        "dirpath='s3://b/run' cannot hold checkpoints: no bucket 'b'. Fix: create it"
    """

    def __init__(
        self, dirpath: str, cause: str, fix: str, backend_error: BaseException | None = None
    ) -> None:
        super().__init__(f"dirpath={dirpath!r} cannot hold checkpoints: {cause}. Fix: {fix}")
        self.dirpath = dirpath
        self.cause = cause
        self.fix = fix
        self.backend_error = backend_error

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:
        # Rebuilt from its parts (the backend's exception stays behind): it crosses ranks by pickle.
        return type(self), (self.dirpath, self.cause, self.fix)


class UnknownStoreError(StoreUnavailableError, ValueError):
    """No filesystem for the protocol of ``dirpath``: fsspec does not know it, or its package is missing."""


class UnsafeCheckpointError(SpotError, pickle.UnpicklingError):
    """A state file holds objects that safe (``weights_only``) loading refuses to construct."""


class IncompatibleCheckpointError(SpotError, RuntimeError):
    """A checkpoint's tensors do not fit the model resuming from it (another model, or a changed one)."""


class AttemptTimeoutError(SpotError, TimeoutError):
    """One attempt of a storage call ran past its timeout and was abandoned (retried as transient)."""


class MetadataError(SpotError):
    """The metadata service gave no usable answer: refused, timed out, 5xx, or a body it does not document.

    ``unreachable`` is True when no connection could be made at all (nothing listens there).
    """

    def __init__(self, message: str, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


class PersistError(SpotError, RuntimeError):
    """A checkpoint could not be made durable; ``url`` names where it was going, ``__cause__`` why."""

    def __init__(self, step: int, url: str, cause: BaseException, local_dir: Path | None) -> None:
        kept = ""
        if local_dir and _holds_payload(local_dir):
            kept = f"; the local copy is kept in {local_dir}"
        super().__init__(
            f"checkpoint of step {step} could not be persisted to {url}: {type(cause).__name__}: {cause}"
            f"{kept}{_no_space_hint(cause, local_dir)}"
        )
        self.step = step
        self.url = url
        self.cause = cause
        self.local_dir = local_dir


class LockLostError(SpotError, RuntimeError):
    """The run lost the lock of its ``dirpath`` (another run took it over): it stopped checkpointing,
    and training fails at the end of the current step rather than finish as if it had checkpointed."""


def _holds_payload(folder: Path) -> bool:
    # Any visible file but the manifest (writers' temporaries are hidden).
    return folder.is_dir() and any(
        path.is_file() and path.name != "manifest.json" and not path.name.startswith(".")
        for path in folder.rglob("*")
    )


def _no_space_hint(cause: BaseException, local_dir: Path | None) -> str:
    if not (isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)):
        return ""
    written = os.fspath(cause.filename) if cause.filename else ""
    if local_dir is not None and written.startswith(os.fspath(local_dir)):
        return (
            f"; no space left in the scratch folder {local_dir.parent}: free space there, or set "
            f"scratch_dir (or $SPOT_SCRATCH) to a bigger disk"
        )
    return f"; no space left on the device that holds {written or 'the destination'}"


__all__ = [
    "SpotError",
    "LockLostError",
    "DeleteIncompleteError",
    "ForeignCheckpointError",
    "UnsafeDestinationError",
    "AttemptTimeoutError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ConfigError",
    "CorruptCheckpointError",
    "IncompatibleCheckpointError",
    "ManifestError",
    "MetadataError",
    "PersistError",
    "RunLockedError",
    "StoreUnavailableError",
    "UnknownStoreError",
    "UnsafeCheckpointError",
]
