"""Which local folder a pull may replace: never anything of the user's, never through a link.

A pull replaces its destination as a whole, so before it starts the destination must be missing,
empty, or the run's own: an earlier pull of a checkpoint still committed in the store (its
``manifest.json`` and only the files it lists, each matching), or a folder holding nothing but
files of the checkpoint being pulled (the run's own staging of that step, a pull cut short, a
cache whose bytes changed); the CLI, which pulls into a user's folder, passes ``info=None`` and
replaces only an earlier pull that still matches.
``force`` allows any other folder. Never allowed: a symbolic link (its target is not ours), what
is not a folder, and the current directory or one above it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from spot_callbacks.errors import UnsafeDestinationError
from spot_callbacks.store.layout import MANIFEST_NAME, is_temporary_name
from spot_callbacks.store.manifest import CheckpointInfo
from spot_callbacks.store.transfer import local_copy_matches

CommittedAt = Callable[
    [int], "CheckpointInfo | None"
]  # the store's manifest of a step, None if not committed

log = logging.getLogger("spot_callbacks")


def check_pull_dest(
    run_url: str, committed_at: CommittedAt, info: CheckpointInfo | None, dest: Path, *, force: bool
) -> None:
    """Raise :class:`UnsafeDestinationError` unless pulling ``info`` of the run at ``run_url`` may
    replace ``dest`` losing nothing; ``committed_at(step)`` is the store's manifest of a step.

    Example:
        >>> import tempfile
        >>> check_pull_dest("memory://doc-dest/pull", lambda step: None, None, Path(tempfile.mkdtemp()), force=False)
    """
    dest = Path(os.path.abspath(dest))
    fix = "pull into a new or empty folder"
    if dest.is_symlink():
        raise UnsafeDestinationError(
            f"{dest} is a symbolic link; nothing was changed: {fix}, or the folder it points to"
        )
    if not dest.exists():
        return
    if not dest.is_dir():
        raise UnsafeDestinationError(f"{dest} exists and is not a folder; nothing was changed: {fix}")
    if Path.cwd().resolve().is_relative_to(dest.resolve()):
        raise UnsafeDestinationError(
            f"{dest} is the current directory or holds it, and pull replaces DEST as a whole; "
            f"nothing was changed: {fix}, e.g. ./resume"
        )
    problem = _not_the_runs(run_url, committed_at, info, dest)
    if problem is None:
        return
    if force:
        log.warning("spot_callbacks: force=True, --force: replacing %s, which %s", dest, problem)
        return
    raise UnsafeDestinationError(
        f"{dest} {problem}; nothing was changed: {fix}, or pass --force (force=True) to replace it"
    )


def _not_the_runs(
    run_url: str, committed_at: CommittedAt, info: CheckpointInfo | None, dest: Path
) -> str | None:
    """Why ``dest`` (a real folder) is not the run's to replace; None when it is (or is empty)."""
    top = sorted(entry.name for entry in os.scandir(dest))
    if not top:
        return None
    if info is not None and _only_files_of(dest, info):
        return None
    step = _pulled_step(dest / MANIFEST_NAME)
    if step is None:
        return f"is not empty ({_some(top)}) and is not an earlier pull of {run_url}"
    pulled = committed_at(step)
    if pulled is None:
        return (
            f"holds a pull of step {step}, which is not committed in {run_url} now "
            "(deleted since, or of another run): it may be the only copy"
        )
    unexpected = _first_unexpected_entry(dest, pulled)
    if unexpected is not None:
        return f"holds a pull of step {step} and {unexpected}"
    if not local_copy_matches(pulled, dest):
        return (
            f"holds a pull of step {step} whose files differ from that checkpoint in {run_url} "
            "(changed since, or of another run): it may be the only copy"
        )
    return None


def _only_files_of(folder: Path, info: CheckpointInfo) -> bool:
    """True when every entry below ``folder`` is a payload file of ``info`` (or its folder, or its
    manifest), or a writer's hidden temporary beside them, and none is a link: the run's own staging
    or cache of that very checkpoint, which the library replaces (the CLI asks first, ``info=None``)."""
    if _first_unexpected_entry(folder, info, allow_temporaries=True) is not None:
        return False
    return any((folder / name).is_file() for name in info.files)


def _first_unexpected_entry(
    folder: Path, info: CheckpointInfo, allow_temporaries: bool = False
) -> str | None:
    """The first entry below ``folder`` that a pull of ``info`` does not write (links are not followed)."""
    expected = {MANIFEST_NAME, *info.files}
    expected |= {parent.as_posix() for name in info.files for parent in Path(name).parents if parent.parts}
    for root, dirs, files in os.walk(folder):
        for name in sorted(dirs + files):
            path = Path(root, name)
            relative = path.relative_to(folder).as_posix()
            if path.is_symlink():
                return f"a symbolic link {relative!r}"
            if relative not in expected and not (allow_temporaries and is_temporary_name(relative)):
                return f"other files (e.g. {relative!r})"
    return None


def _some(names: list[str]) -> str:
    return repr(names[0]) + (f" and {len(names) - 1} more" if len(names) > 1 else "")


def _pulled_step(manifest_file: Path) -> int | None:
    try:
        step = json.loads(manifest_file.read_bytes()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None
