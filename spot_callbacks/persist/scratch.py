"""The local scratch disk: where a run stages its checkpoint folders, and which of them stay.

The default scratch is a per-user folder of the system temp dir, ``0700`` and refused when
another user owns it (or it is a link): other local users can neither read a checkpoint nor
plant a link where the run writes. What stays after a commit or a failure is what a restart on
this machine needs (:func:`prune_scratch`): the newest committed local copy, the newest failed
copy (the one a manual upload would want) and the folders of checkpoints still in flight.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

import spot_callbacks.settings as settings
from spot_callbacks.errors import ConfigError
from spot_callbacks.store import MANIFEST_NAME, local_payload_names, parse_step_dirname

log = logging.getLogger("spot_callbacks")

PRIVATE_FOLDER_MODE = 0o700


def _user_key() -> str:
    getuid = getattr(os, "getuid", None)
    return str(getuid()) if getuid is not None else getpass.getuser()


def default_scratch_root(store_url: str, scratch_dir: str | None = None) -> Path:
    """The local staging folder of one run: ``scratch_dir``, else ``$SPOT_SCRATCH``, else a per-user temp dir.

    Runs are kept apart by a short hash of the store URL, so two runs can share a scratch disk.

    Example:
        >>> default_scratch_root("s3://bucket/run", scratch_dir="/scratch").as_posix()
        '/scratch/03236a011055'
        >>> default_scratch_root("s3://bucket/run").parent.name == f"spot-callbacks-{_user_key()}"
        True
    """
    run_key = hashlib.sha256(store_url.encode()).hexdigest()[:12]
    return scratch_base(scratch_dir) / run_key


def scratch_base(scratch_dir: str | None = None) -> Path:
    """The folder that holds every run's scratch folder: ``scratch_dir``, else ``$SPOT_SCRATCH``, else
    :func:`per_user_base`."""
    return Path(scratch_dir or settings.SCRATCH.value() or per_user_base()).expanduser()


def per_user_base() -> Path:
    """The default base, ``$TMPDIR/spot-callbacks-<uid>``: private, so everything in it is a run's scratch."""
    return Path(tempfile.gettempdir()) / f"spot-callbacks-{_user_key()}"


def private_scratch_root(store_url: str, scratch_dir: str | None = None) -> Path:
    """:func:`default_scratch_root`, created ``0700``; the default per-user folder above it too.

    Raises:
        ConfigError: a folder on the way is a link, not a folder, or another user's.

    Example:
        >>> import tempfile
        >>> root = private_scratch_root("s3://bucket/run", scratch_dir=tempfile.mkdtemp())
        >>> oct(root.stat().st_mode & 0o777)
        '0o700'
    """
    root = default_scratch_root(store_url, scratch_dir)
    if not (scratch_dir or settings.SCRATCH.value()):
        ensure_private_folder(root.parent)
    ensure_private_folder(root)
    return root


def ensure_private_folder(folder: Path) -> None:
    """Make ``folder`` (``0700``) or check the one there: a folder, not a link, this user's; tightened to ``0700``."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=PRIVATE_FOLDER_MODE)
    found = os.lstat(folder)
    fix = "set scratch_dir= (or $SPOT_SCRATCH) to a folder of your own"
    if stat.S_ISLNK(found.st_mode) or not stat.S_ISDIR(found.st_mode):
        raise ConfigError(
            f"scratch folder {folder} is a link or not a folder; refusing to write checkpoints there: {fix}"
        )
    getuid = getattr(os, "getuid", None)
    if getuid is not None and found.st_uid != getuid():
        raise ConfigError(
            f"scratch folder {folder} belongs to another user (uid {found.st_uid}); refusing to write "
            f"checkpoints there: {fix}"
        )
    if found.st_mode & 0o077:
        os.chmod(folder, PRIVATE_FOLDER_MODE)


def folder_bytes(folder: Path) -> int:
    """Bytes of the payload files in a local checkpoint folder (0 when it does not exist)."""
    if not folder.is_dir():
        return 0
    return sum((folder / name).stat().st_size for name in local_payload_names(folder))


def discard_folder(folder: Path, owned: bool) -> None:
    """Delete a local checkpoint folder the run owns; never one of the framework's or the user's."""
    if owned:
        shutil.rmtree(folder, ignore_errors=True)


def _step_folders(root: Path) -> dict[int, Path]:
    """The step folders directly in ``root``, by step: real folders with a step folder name (no links)."""
    folders = {}
    for path in root.iterdir() if root.is_dir() else ():
        step = parse_step_dirname(path.name)
        if step is not None and not path.is_symlink() and path.is_dir():
            folders[step] = path
    return folders


def discard_leftover_step_folders(root: Path) -> list[Path]:
    """Delete the step folders in ``root``, a scratch folder whose persister keeps no local copy: each
    one there when it starts was left by a process that died mid-checkpoint. Returns them.

    Links and other names are left alone.

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> (root / "step-000000004").mkdir(); (root / "notes").mkdir()
        >>> [p.name for p in discard_leftover_step_folders(root)], sorted(p.name for p in root.iterdir())
        (['step-000000004'], ['notes'])
    """
    leftovers = [path for _, path in sorted(_step_folders(root).items())]
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    if leftovers:
        log.info(
            "spot_callbacks: scratch %s: deleted %d folder%s an earlier process left mid-checkpoint (%s)",
            root, len(leftovers), "" if len(leftovers) == 1 else "s", ", ".join(p.name for p in leftovers),
        )  # fmt: skip
    return leftovers


def discard_copies_older_than(root: Path, step: int) -> list[Path]:
    """After a resume from ``step`` (committed, the newest valid): the step folders of ``root`` below it
    are copies no restart here can use; delete them and return them. On every node: the nodes that
    do not write (their pulled copies) have no persister to prune their scratch.

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> for step in (5, 10, 15):
        ...     (root / f"step-{step:09d}").mkdir()
        >>> [p.name for p in discard_copies_older_than(root, 10)], sorted(p.name for p in root.iterdir())
        (['step-000000005'], ['step-000000010', 'step-000000015'])
    """
    older = [path for found, path in sorted(_step_folders(root).items()) if found < step]
    for path in older:
        shutil.rmtree(path, ignore_errors=True)
    if older:
        log.info(
            "spot_callbacks: scratch %s: deleted %d local cop%s older than the resumed step %d (%s)",
            root, len(older), "y" if len(older) == 1 else "ies", step, ", ".join(p.name for p in older),
        )  # fmt: skip
    return older


def prune_scratch(root: Path, in_flight: Iterable[Path], newest_failed: Path | None) -> list[Path]:
    """Delete the step folders of ``root`` that a restart on this machine has no use for; return them.

    Kept: the folders ``in_flight``, the newest committed local copy (a step folder with its
    manifest) and ``newest_failed``; with no failure of this run, the newest folder without a
    manifest if it is newer than that copy (an earlier run's failed copy). Everything else under a
    step folder name goes, an earlier run's copies included; other names are left alone.

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> for step in (1, 2, 3, 4, 5):
        ...     (root / f"step-{step:09d}").mkdir()
        >>> _ = (root / "step-000000002" / MANIFEST_NAME).write_bytes(b"{}")
        >>> _ = (root / "step-000000003" / MANIFEST_NAME).write_bytes(b"{}")
        >>> [p.name for p in prune_scratch(root, [root / "step-000000005"], root / "step-000000001")]
        ['step-000000002', 'step-000000004']
    """
    folders = _step_folders(root)
    keep = {Path(path) for path in in_flight}
    committed = [step for step, path in folders.items() if (path / MANIFEST_NAME).is_file()]
    newest_committed = max(committed, default=-1)
    if newest_committed >= 0:
        keep.add(folders[newest_committed])
    if newest_failed is not None:
        keep.add(Path(newest_failed))
    else:
        uncommitted = [s for s in folders if s not in committed and folders[s] not in keep]
        if uncommitted and max(uncommitted) > newest_committed:
            keep.add(folders[max(uncommitted)])
    deleted = [path for _, path in sorted(folders.items()) if path not in keep]
    for path in deleted:
        shutil.rmtree(path, ignore_errors=True)
    if deleted:
        log.info(
            "spot_callbacks: scratch %s: deleted %d local cop%s a restart here cannot use (%s); kept %s",
            root, len(deleted), "y" if len(deleted) == 1 else "ies", ", ".join(p.name for p in deleted),
            ", ".join(sorted(p.name for p in keep if p.parent == root and p.exists())) or "nothing",
        )  # fmt: skip
    return deleted


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
        >>> (root / "step-3").mkdir(); kept.adopt(root / "step-3"); kept.folder.name
        'step-3'
    """

    def __init__(self) -> None:
        self.folder: Path | None = None

    def keep(self, folder: Path) -> None:
        previous, self.folder = self.folder, folder
        if previous is not None and previous != folder:
            shutil.rmtree(previous, ignore_errors=True)

    def adopt(self, folder: Path) -> None:
        """Hold ``folder`` (a copy made otherwise, e.g. pulled at resume) until the next :meth:`keep`,
        unless one is held already."""
        if self.folder is None:
            self.folder = folder

    def drop(self) -> None:
        """Delete the kept folder too (its copy could not be completed, or no local copy is wanted)."""
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.folder = None
