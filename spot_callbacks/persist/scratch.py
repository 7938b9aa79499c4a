"""The local scratch disk: where a run stages its checkpoint folders, and which of them stay after a commit."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from spot_callbacks.store import local_payload_names


def default_scratch_root(store_url: str, scratch_dir: str | None = None) -> Path:
    """The local staging folder of one run: ``scratch_dir``, else ``$SPOT_SCRATCH``, else a temp dir.

    Runs are kept apart by a short hash of the store URL, so two runs can share a scratch disk.

    Example:
        >>> default_scratch_root("s3://bucket/run", scratch_dir="/scratch").as_posix()
        '/scratch/03236a011055'
    """
    base = (
        scratch_dir
        or os.environ.get("SPOT_SCRATCH")
        or os.path.join(tempfile.gettempdir(), "spot-callbacks-scratch")
    )
    run_key = hashlib.sha256(store_url.encode()).hexdigest()[:12]
    return Path(base).expanduser() / run_key


def folder_bytes(folder: Path) -> int:
    """Bytes of the payload files in a local checkpoint folder (0 when it does not exist)."""
    if not folder.is_dir():
        return 0
    return sum((folder / name).stat().st_size for name in local_payload_names(folder))


def discard_folder(folder: Path, owned: bool) -> None:
    """Delete a local checkpoint folder the run owns; never one of the framework's or the user's."""
    if owned:
        shutil.rmtree(folder, ignore_errors=True)


class NewestCommittedFolder:
    """The newest committed local folder a persister owns: keeping one deletes the one kept before.

    A restart on the same machine then resumes from it without a download.

    Example:
        >>> import tempfile, pathlib
        >>> root = pathlib.Path(tempfile.mkdtemp())
        >>> (root / "step-1").mkdir(); (root / "step-2").mkdir()
        >>> kept = NewestCommittedFolder()
        >>> kept.keep(root / "step-1"); kept.keep(root / "step-2")
        >>> sorted(path.name for path in root.iterdir()), kept.folder.name
        (['step-2'], 'step-2')
        >>> kept.drop(); list(root.iterdir()), kept.folder
        ([], None)
    """

    def __init__(self) -> None:
        self.folder: Path | None = None

    def keep(self, folder: Path) -> None:
        previous, self.folder = self.folder, folder
        if previous is not None and previous != folder:
            shutil.rmtree(previous, ignore_errors=True)

    def drop(self) -> None:
        """Delete the kept folder too (its copy could not be completed, or no local copy is wanted)."""
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.folder = None
