"""spot_callbacks: train on interruptible spot instances without losing work.

Add one callback (``spot_callbacks.lightning.SpotCheckpoint`` or
``spot_callbacks.hf.SpotCheckpointCallback``) and resume with ``ckpt_path="latest"``.
The names below are the shared core the adapters stand on.
"""

import logging as _logging

from spot_callbacks.checksums import FileDigest
from spot_callbacks.config import ConfigError, SpotConfig, parse_duration
from spot_callbacks.persist import Persister, PersistError, PersistJob, PersistRecord
from spot_callbacks.retry import AttemptTimeoutError, RetryPolicy, UploadTimeout
from spot_callbacks.runlock import RunLockedError
from spot_callbacks.store import (
    CheckpointError,
    CheckpointInfo,
    CheckpointNotFoundError,
    CheckpointStore,
    CorruptCheckpointError,
    ManifestError,
)

__version__ = "0.1.0"

# Imported on first use: they need torch, which the command line and the store do not.
_SNAPSHOT_NAMES = {
    "IncompatibleCheckpointError",
    "StagedState",
    "StagingArea",
    "UnsafeCheckpointError",
    "load_state",
    "write_state",
}


_SHARDED_NAMES = {"ShardedPersister", "load_sharded_state"}


def __getattr__(name: str):  # noqa: ANN202 - PEP 562 lazy attribute
    if name in _SNAPSHOT_NAMES:
        from spot_callbacks import snapshot

        return getattr(snapshot, name)
    if name in _SHARDED_NAMES:
        from spot_callbacks import sharded

        return getattr(sharded, name)
    raise AttributeError(f"module 'spot_callbacks' has no attribute {name!r}")


# As Lightning does for its own logger: info lines (resumed from, committed, skipped) are shown
# unless the application configured logging itself.
_logger = _logging.getLogger(__name__)
_logger.setLevel(_logging.INFO)
if not _logging.getLogger().hasHandlers():
    _logger.addHandler(_logging.StreamHandler())
    _logger.propagate = False

__all__ = [
    "AttemptTimeoutError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointStore",
    "ConfigError",
    "CorruptCheckpointError",
    "FileDigest",
    "IncompatibleCheckpointError",
    "ManifestError",
    "PersistError",
    "PersistJob",
    "PersistRecord",
    "Persister",
    "RetryPolicy",
    "RunLockedError",
    "SpotConfig",
    "StagedState",
    "ShardedPersister",
    "StagingArea",
    "UnsafeCheckpointError",
    "UploadTimeout",
    "load_sharded_state",
    "load_state",
    "parse_duration",
    "write_state",
]
