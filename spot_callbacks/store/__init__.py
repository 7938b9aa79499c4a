"""The checkpoints of a run in any fsspec filesystem, and the commit protocol that keeps them.

Where each part lives:

- :mod:`~spot_callbacks.store.commit`: THE protocol (what is committed, the write order, retention).
- :mod:`~spot_callbacks.store.checkpoint_store`: :class:`CheckpointStore`, the reader's face over it.
- :mod:`~spot_callbacks.store.writer`: :class:`CommitWriter`, the one writer of the commit sequence.
- :mod:`~spot_callbacks.store.manifest`: :class:`CheckpointInfo`, building and validating manifests.
- :mod:`~spot_callbacks.store.layout`: step folder names, URLs and paths, backend quirks, payload names.
- :mod:`~spot_callbacks.store.backends`: the backend table, one row per protocol family.
- :mod:`~spot_callbacks.store.transfer`: parallel uploads and pulls, timeouts, the local disk.
- :mod:`~spot_callbacks.store.checksums`, :mod:`~spot_callbacks.store.retry`,
  :mod:`~spot_callbacks.store.runlock`: checksums, retries and timeouts, the run lock.
"""

from __future__ import annotations

from spot_callbacks.store.backends import S3_UPLOAD_CONCURRENCY
from spot_callbacks.store.checkpoint_store import CheckpointStore
from spot_callbacks.store.layout import (
    MANIFEST_NAME,
    local_payload_names,
    parse_step_dirname,
    step_dirname,
)
from spot_callbacks.store.manifest import (
    FORMAT_VERSION,
    MANIFEST_FORMAT,
    REASONS,
    CheckpointInfo,
    parse_manifest,
)
from spot_callbacks.store.writer import CommitWriter

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "REASONS",
    "S3_UPLOAD_CONCURRENCY",
    "CheckpointInfo",
    "CheckpointStore",
    "CommitWriter",
    "local_payload_names",
    "parse_manifest",
    "parse_step_dirname",
    "step_dirname",
]
