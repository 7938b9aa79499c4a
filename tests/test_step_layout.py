"""The layout owns a step folder: every file name in store/layout.py, and the persister taken from it.

A step folder's kind (:class:`~spot_callbacks.store.layout.StepLayout`) says who writes its files;
saving.py's ``PERSISTERS`` maps that to the persister, so no save picks a persister by name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from helpers.code_strings import code_strings

import spot_callbacks
import spot_callbacks.saving as saving
from spot_callbacks import SpotConfig
from spot_callbacks.engine import SpotEngine
from spot_callbacks.persist import Persister
from spot_callbacks.store import layout
from spot_callbacks.store.layout import (
    EVERY_RANK,
    FOLDER_LAYOUT,
    ONE_WRITER,
    RANK_FOLDER_LAYOUT,
    RANK_SHARDS,
    SHARDED_LAYOUT,
    STATE_LAYOUT,
)

PACKAGE = Path(spot_callbacks.__file__).parent
# The file names of a step folder, each defined once in store/layout.py.
STEP_FILE_NAMES = {
    layout.STATE_FILE,
    layout.MANIFEST_NAME,
    layout.DCP_METADATA_FILE,
    layout.HF_TRAINER_STATE_FILE,
    layout.SHARDED_META_FILE,
}
# errors.py is the bottom layer (it may import nothing of the store): it says the manifest's name itself.
BELOW_THE_STORE = {"errors.py": {layout.MANIFEST_NAME}}


def spelled_names(source: str) -> set[str]:
    return {node.value for node in code_strings(source)} & STEP_FILE_NAMES


def test_every_step_file_name_is_spelled_in_the_layout_module_only():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name == "store/layout.py":
            continue
        spelled = spelled_names(path.read_text()) - BELOW_THE_STORE.get(name, set())
        if spelled:
            offenders[name] = sorted(spelled)
    assert offenders == {}, "import the name from spot_callbacks.store.layout"
    assert spelled_names('"""state.ckpt"""\nx = "state.ckpt"\n') == {"state.ckpt"}


def test_every_writer_of_a_layout_has_its_persister():
    layouts = [STATE_LAYOUT, SHARDED_LAYOUT, FOLDER_LAYOUT, RANK_FOLDER_LAYOUT]
    assert set(saving.PERSISTERS) == {ONE_WRITER, RANK_SHARDS, EVERY_RANK}
    assert {item.written_by for item in layouts} == set(saving.PERSISTERS)
    # A layout with a file per rank is written by every rank, never by the writer alone.
    assert all(item.written_by != ONE_WRITER for item in layouts if item.rank_files(2))
    assert SHARDED_LAYOUT.rank_files(3) == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]


def test_the_saves_take_their_persister_from_the_layout_not_by_name():
    tree = ast.parse(Path(saving.__file__).read_text())
    named = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "persister_for"
        and not (isinstance(node.args[0], ast.Name) and node.args[0].id.lower().endswith("layout"))
    ]
    assert named == []


def test_a_run_that_mixes_layouts_of_two_writers_is_refused(tmp_path: Path):
    engine = SpotEngine(SpotConfig(dirpath=str(tmp_path / "run"), interval=None, preemption=[]), "test")
    engine.start()
    try:
        engine.save_state(step=1, epoch=0, state={"w": torch.ones(1)}, reason="steps")
        assert isinstance(
            engine.saves.persister_for(FOLDER_LAYOUT), Persister
        )  # the same writer: one persister
        with pytest.raises(
            RuntimeError, match="this run saves single-file checkpoints .* cannot mix in sharded ones"
        ):
            engine.saves.persister_for(SHARDED_LAYOUT)
    finally:
        engine.finish()
