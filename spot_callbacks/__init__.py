"""spot_callbacks: train on interruptible spot instances without losing work.

Add one callback (``spot_callbacks.lightning.SpotCheckpoint`` or
``spot_callbacks.hf.SpotCheckpointCallback``) and resume with ``ckpt_path="latest"``.
This module holds the public contract only: the configuration, the view of a run's committed
checkpoints, the loaders, and the error classes (one root: ``SpotError``). Internals stay importable from their own
modules (see docs/architecture.md).

The library logs to the ``spot_callbacks`` logger and configures no logging at import; see
:func:`spot_callbacks.log.show_info_lines` for what the callbacks do when the application has
configured none.
"""

import spot_callbacks.log  # noqa: F401 - the logger's filters (rank 0 info lines, escaped controls) on any import
from spot_callbacks.config import SpotConfig, parse_duration
from spot_callbacks.errors import (
    AttemptTimeoutError,
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DeleteIncompleteError,
    ForeignCheckpointError,
    IncompatibleCheckpointError,
    LockLostError,
    ManifestError,
    PersistError,
    RunLockedError,
    SpotError,
    StoreUnavailableError,
    UnknownStoreError,
    UnsafeCheckpointError,
    UnsafeDestinationError,
)
from spot_callbacks.store import CheckpointInfo, CheckpointStore

__version__ = "0.1.0"


def __getattr__(name: str):  # noqa: ANN202 - PEP 562 lazy attribute
    # Imported on first use: they need torch, which the command line and the store do not.
    if name == "load_state":
        from spot_callbacks.staging import load_state

        return load_state
    if name == "load_sharded_state":
        from spot_callbacks.persist.sharded import load_sharded_state

        return load_sharded_state
    raise AttributeError(f"module 'spot_callbacks' has no attribute {name!r}")


__all__ = [
    "AttemptTimeoutError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointStore",
    "ConfigError",
    "CorruptCheckpointError",
    "DeleteIncompleteError",
    "ForeignCheckpointError",
    "IncompatibleCheckpointError",
    "LockLostError",
    "ManifestError",
    "PersistError",
    "RunLockedError",
    "SpotConfig",
    "SpotError",
    "StoreUnavailableError",
    "UnknownStoreError",
    "UnsafeCheckpointError",
    "UnsafeDestinationError",
    "load_sharded_state",
    "load_state",
    "parse_duration",
]
