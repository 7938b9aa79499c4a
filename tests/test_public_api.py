"""The public API, pinned: the root's names, the store's small face, and one writer of the commit sequence.

A name added to ``spot_callbacks.__all__`` or to :class:`CheckpointStore` is a promise to users: it
fails here until this file (and the docs) say so. The steps of the commit sequence are
:class:`~spot_callbacks.store.writer.CommitWriter`'s; no module outside ``spot_callbacks/store/``
names them, so no persister can take a step of its own in its own order.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import spot_callbacks
from spot_callbacks import CheckpointStore
from spot_callbacks.store.writer import CommitWriter

PACKAGE = Path(spot_callbacks.__file__).parent
STORE = PACKAGE / "store"
DOCS = PACKAGE.parent / "docs"

ROOT_NAMES = {
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
}
# What users call on a run's checkpoints (DESIGN.md: committed, latest, verify, pull, prune; the
# CLI's ls, rm; docs/storage.md: warm_data_plane). Writing is CommitWriter's.
STORE_FACE = {
    "committed",
    "damage",
    "delete",
    "fs",  # the fsspec filesystem (always reachable; a property since its first use waits for the warm-up)
    "latest",
    "prune",
    "pull",
    "read_manifest",
    "step_folders",
    "step_path",
    "step_url",
    "url",
    "url_of",
    "verify",
    "warm_data_plane",
}
MAX_STORE_FACE = 15
# The I/O steps of writing a checkpoint, and the names they had before CommitWriter owned them.
COMMIT_STEP_NAMES = {
    "clear_stale_step",
    "new_manifest",
    "settle_commit",
    "commit",
    "upload_file",
    "upload_files",
}
# What the persisters call (``settle`` runs retention; ``prune`` stays a user's call, never a persister's).
WRITER_STEPS = {"begin", "upload", "commit_files", "settle", "write_checkpoint"}


def public_members(cls: type) -> set[str]:
    """The methods and properties ``cls`` defines itself whose names do not start with ``_``."""
    return {
        name
        for name, value in vars(cls).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }


def names_used(tree: ast.AST) -> set[str]:
    """Every identifier the code of ``tree`` uses or defines (comments and strings are no code)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.add(node.asname or node.name.split(".")[0])  # what the import binds
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.keyword) and node.arg is not None:
            found.add(node.arg)
    return found


def test_the_root_exports_exactly_the_public_contract():
    assert set(spot_callbacks.__all__) == ROOT_NAMES
    assert len(spot_callbacks.__all__) == len(ROOT_NAMES)  # no name listed twice
    for name in ROOT_NAMES:
        assert getattr(spot_callbacks, name) is not None


def test_checkpoint_store_keeps_a_small_face():
    assert public_members(CheckpointStore) == STORE_FACE
    assert len(STORE_FACE) <= MAX_STORE_FACE < 16
    assert isinstance(vars(CheckpointStore)["url"], property)


def test_the_writer_offers_every_step_of_the_commit_sequence():
    assert public_members(CommitWriter) >= WRITER_STEPS
    assert not (public_members(CommitWriter) & public_members(CheckpointStore))  # one owner per step


def test_no_module_outside_the_store_takes_a_commit_step_of_its_own():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if STORE in path.parents:
            continue
        used = names_used(ast.parse(path.read_text(), filename=str(path)))
        if used & COMMIT_STEP_NAMES:
            offenders[path.relative_to(PACKAGE).as_posix()] = sorted(used & COMMIT_STEP_NAMES)
    assert offenders == {}, "call CommitWriter's steps (begin, upload, commit_files, settle) instead"


def test_no_module_outside_the_store_prunes():
    # CheckpointStore.prune is the user's (DESIGN.md); after a commit a persister settles, never prunes.
    offenders = [
        path.relative_to(PACKAGE).as_posix()
        for path in sorted(PACKAGE.rglob("*.py"))
        if STORE not in path.parents
        and any(
            isinstance(node, ast.Attribute) and node.attr == "prune"
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        )
    ]
    assert offenders == []


def test_both_kinds_of_persister_write_through_the_one_writer():
    for module in ("persist/pipeline.py", "persist/rank_group.py"):
        used = names_used(ast.parse((PACKAGE / module).read_text()))
        assert "CommitWriter" in used, module
        assert used & WRITER_STEPS, module


def test_every_root_export_appears_in_the_docs():
    pages = {path: path.read_text() for path in DOCS.rglob("*.md")}
    missing = [
        name
        for name in sorted(ROOT_NAMES)
        if not any(
            re.search(rf"(?<![\w.]){re.escape(name)}\b|spot_callbacks\.{name}\b", text)
            for text in pages.values()
        )
    ]
    assert missing == []


def test_the_checks_above_can_fail():
    # The ast scan sees a call in code, not a word in a comment or a docstring.
    code = '"""we commit here"""\n# store.settle_commit(info)\nstore.settle_commit(info)\n'
    assert names_used(ast.parse(code)) & COMMIT_STEP_NAMES == {"settle_commit"}
    assert names_used(ast.parse('"""settle_commit, upload_files"""\n')) & COMMIT_STEP_NAMES == set()

    class Wider(CheckpointStore):
        def upload_files(self) -> None:
            """A writer's step put back on the face."""

    assert public_members(Wider) == {"upload_files"}


ENGINE_PARTS = {"watcher", "saves", "store", "lease", "trigger", "accounts", "emergency", "attempt", "watch"}


def reaches_past_the_engine(tree: ast.AST) -> list[str]:
    """``engine.<part>.<anything>`` (``self.engine`` too): an adapter using a part of the engine directly."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            inner = node.value
            owner = inner.value
            owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
            if owner_name == "engine" and inner.attr in ENGINE_PARTS:
                found.append(f"engine.{inner.attr}.{node.attr}")
    return found


def test_adapters_go_through_the_engine_only():
    adapters = [
        *(PACKAGE / "lightning").glob("*.py"),
        *(PACKAGE / "hf").glob("*.py"),
        PACKAGE / "pytorch_lightning.py",
    ]
    reaching = {
        str(path.relative_to(PACKAGE)): used
        for path in adapters
        if (used := reaches_past_the_engine(ast.parse(path.read_text())))
    }
    assert reaching == {}
    assert reaches_past_the_engine(ast.parse("self.engine.watcher.notice")) == ["engine.watcher.notice"]
