"""The remote layout: step folder names, URLs and paths, and which local files are payload.

(Being filled in: the rest of the layout moves here from the store facade.)
"""

from __future__ import annotations

from typing import Any

# torch.distributed.checkpoint's index of every shard: a hidden name, yet payload.
DCP_METADATA_FILE = ".metadata"


def fs_protocols(fs: Any) -> tuple[str, ...]:
    """The protocols an fsspec filesystem answers to (``fs.protocol`` is a str or a tuple)."""
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)
