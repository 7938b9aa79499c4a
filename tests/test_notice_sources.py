"""Notice sources: the one table of their names, the file source, and a bad name in the config.

The file source is driven through a real tiny Lightning run on CPU (the helper callback of
tests/test_preemption.py writes the file at a step); the table's claim, that it is the only place
the names are spelled, is checked on the package's source with ``ast``.
"""

from __future__ import annotations

import ast
import logging
import os
import time
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel
from test_preemption import _Announce

from spot_callbacks import SpotConfig
from spot_callbacks.errors import ConfigError
from spot_callbacks.lightning import SpotCheckpoint
from spot_callbacks.preemption import NOTICE_SOURCES, NoticeSource, PreemptionWatcher
from spot_callbacks.preemption.notice_file import MAX_NOTICE_FILE_BYTES, NoticeFileSource
from spot_callbacks.preemption.signals import ChainedSignalHandlers
from spot_callbacks.preemption.sources import SourceContext

PACKAGE = Path(__file__).resolve().parent.parent / "spot_callbacks"
FAST = {"poll_interval_s": 0.05, "request_timeout_s": 0.3}


@pytest.fixture
def notice_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``$SPOT_NOTICE_FILE`` set to a path in ``tmp_path`` (nothing there yet); polls every 50 ms."""
    path = tmp_path / "notice" / "preempted"
    path.parent.mkdir()
    monkeypatch.setenv("SPOT_NOTICE_FILE", str(path))
    monkeypatch.setenv("SPOT_METADATA_POLL_S", "0.05")
    return path


def watching(sources: list[str]) -> PreemptionWatcher:
    watcher = PreemptionWatcher(sources, **FAST)
    watcher.start()
    return watcher


# ------------------------------------------------------------------------------ the file source


def test_the_notice_file_appearing_mid_run_makes_an_emergency_checkpoint_and_exits_143(notice_file, tmp_path):
    ckpt = SpotCheckpoint(
        dirpath=str(tmp_path / "run"), interval=None, preemption=["file"], scratch_dir=str(tmp_path)
    )
    announced_at: list[float] = []

    def announce() -> None:  # what a Kubernetes preStop hook does: the file, with the time left
        announced_at.append(time.time())
        notice_file.write_text("120\n")

    trainer = pl.Trainer(
        callbacks=[ckpt, _Announce(3, announce, ckpt.engine.watcher)], max_steps=20, logger=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    assert ckpt.engine.watcher.sources == ["file"]
    with pytest.raises(SystemExit) as stopped:
        trainer.fit(BoringModel())
    assert stopped.value.code == 143 and ckpt.preempted and trainer.global_step == 4
    latest = ckpt.store.latest()
    assert latest.step == 4 and latest.reason == "preemption"
    record = latest.extra["preemption"]
    assert record["source"] == "file" and str(notice_file) in record["detail"]
    assert "120s announced in the file" in record["detail"]
    assert not ckpt.engine.watcher.polling


def test_the_file_content_is_the_time_left_and_an_empty_file_the_signal_grace(notice_file, monkeypatch):
    monkeypatch.setenv("SPOT_SIGNAL_GRACE_S", "45")
    watcher = watching(["file"])
    try:
        assert watcher.detected(timeout=5) == ["file"]
        notice_file.write_text("2min")
        notice = watcher.wait(timeout=5)
        assert notice is not None and notice.source == "file"
        assert 118 < notice.seconds_left() <= 120
    finally:
        watcher.stop()
    notice_file.unlink()
    watcher = watching(["file"])
    try:
        notice_file.touch()  # empty: the deadline is the signal grace
        notice = watcher.wait(timeout=5)
        assert notice is not None and 43 < notice.seconds_left() <= 45
        assert "the signal grace, 45s" in notice.detail
    finally:
        watcher.stop()


def test_a_notice_file_is_one_notice_until_removed_and_its_next_appearance_another(notice_file):
    source = NoticeFileSource("file")  # polled here, in turn, rather than by the watcher's thread
    assert source.poll(0.0).notice is None
    notice_file.write_text("60")
    first = source.poll(0.0).notice
    assert first is not None and 58 < first.seconds_left() <= 60
    assert source.poll(0.0).notice is None  # still there: the same notice, not reported again
    notice_file.unlink()
    assert source.poll(0.0).notice is None  # gone: re-armed
    notice_file.write_text("30")
    second = source.poll(0.0).notice
    assert second is not None and 28 < second.seconds_left() <= 30


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"soon, maybe", "'soon, maybe', which is not a time left"),
        (b"-5", "'-5', which is not a time left"),
        (b"\xff\xfe garbage \x00", "which is not a time left"),
        (b"9" * (MAX_NOTICE_FILE_BYTES * 1000), f"more than {MAX_NOTICE_FILE_BYTES} bytes"),
    ],
    ids=["words", "negative", "binary", "huge"],
)
def test_untrusted_content_is_the_signal_grace_with_one_warning(
    notice_file, monkeypatch, caplog, content, says
):
    caplog.set_level(logging.WARNING, logger="spot_callbacks")
    monkeypatch.setenv("SPOT_SIGNAL_GRACE_S", "30")
    notice_file.write_bytes(content)
    watcher = watching(["file"])
    try:
        notice = watcher.wait(timeout=5)
    finally:
        watcher.stop()
    assert notice is not None and 28 < notice.seconds_left() <= 30
    warnings = [r.getMessage() for r in caplog.records if "notice file" in r.getMessage()]
    assert len(warnings) == 1 and says in warnings[0]


def test_auto_watches_the_notice_file_when_one_is_set_and_not_otherwise(
    notice_file, metadata_env, monkeypatch
):
    metadata_env()  # every cloud at a closed port: off-cloud
    watcher = PreemptionWatcher.from_setting("auto", **FAST)
    watcher.start()
    try:
        assert watcher.sources[-1] == "file" and watcher.detected(timeout=5) == ["file"]
        notice_file.touch()
        notice = watcher.wait(timeout=5)
        assert notice is not None and notice.source == "file"
    finally:
        watcher.stop()
    monkeypatch.delenv("SPOT_NOTICE_FILE")
    assert "file" not in PreemptionWatcher.from_setting("auto").sources


# ------------------------------------------------------------------------------------ the table


def test_every_source_in_the_table_is_a_notice_source(notice_file, metadata_env):
    metadata_env()
    handlers = ChainedSignalHandlers(on_notice=lambda notice: None)
    context = SourceContext(request_timeout_s=0.3, signals=handlers)
    try:
        for name, kind in NOTICE_SOURCES.items():
            source = kind.make(name, context)
            assert isinstance(source, NoticeSource) and source.name == name
            if kind.cloud is None:  # the clouds are at closed ports: their poll fails (logged once)
                assert source.poll(0.0).notice is None
    finally:
        handlers.restore()


def _spelled_names(path: Path) -> tuple[Counter[str], list[list[str]]]:
    """The source names ``path`` spells as string constants (docstrings aside), and the literal
    collections (tuples, lists, sets, dict keys) holding two or more of them."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))

    def name_of(node: ast.AST | None) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            return node.value if node.value in NOTICE_SOURCES else None
        return None

    spelled: Counter[str] = Counter(name for node in ast.walk(tree) if (name := name_of(node)) is not None)
    tables = []
    for node in ast.walk(tree):
        members = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
        if isinstance(node, (ast.Dict, ast.Tuple, ast.List, ast.Set)) and members is not None:
            names = [name for member in members if (name := name_of(member)) is not None]
            if len(names) >= 2:
                tables.append(names)
    return spelled, tables


# Outside the table no module spells a signal's name: one that answers to a signal by name (the
# Trainer's own SIGTERM checkpoint, Lightning's signal connector, Ctrl-C always stopping) asks
# sources.py's TERMINATION or INTERRUPT. (Homonyms, fsspec's "file" protocol and a placement's
# "aws", are no source names: only the no-second-table rule covers them.)


def test_the_table_is_the_only_place_the_source_names_are_spelled():
    per_module = {
        str(path.relative_to(PACKAGE)): _spelled_names(path) for path in sorted(PACKAGE.rglob("*.py"))
    }
    table = "preemption/sources.py"
    assert per_module[table][0] == Counter(list(NOTICE_SOURCES))  # each name once, in the table
    # The modules that read the table, config's validation and the watcher's construction among
    # them, spell none of the names.
    readers = [m for m in per_module if (m.startswith("preemption/") or m == "config.py") and m != table]
    assert "config.py" in readers and "preemption/watcher.py" in readers
    assert {m: dict(per_module[m][0]) for m in readers if per_module[m][0]} == {}
    # No module holds a second table of them.
    assert {m: tables for m, (_, tables) in per_module.items() if tables and m != table} == {}
    signal_names = {name for name, kind in NOTICE_SOURCES.items() if kind.signal}
    elsewhere = {
        (m, name): count
        for m, (spelled, _) in per_module.items()
        if m != table
        for name, count in spelled.items()
        if name in signal_names
    }
    assert elsewhere == {}


# ----------------------------------------------------------------------------------- the config


@pytest.mark.parametrize("how", ["argument", "yaml"])
def test_a_bad_source_name_fails_before_training_listing_the_tables_names(tmp_path, how):
    if how == "argument":
        with pytest.raises(ConfigError) as refused:
            SpotCheckpoint(dirpath=str(tmp_path / "run"), preemption=["SIGTERM", "notice-file"])
    else:
        config = tmp_path / "spot.yaml"
        config.write_text(f"dirpath: {tmp_path / 'run'}\npreemption: [SIGTERM, notice-file]\n")
        with pytest.raises(ConfigError) as refused:
            SpotConfig.from_yaml(config)
    message = str(refused.value)
    assert "'notice-file' is not known" in message
    assert str(list(NOTICE_SOURCES)) in message
    assert not (tmp_path / "run").exists()  # nothing was made: it failed before the run began


def test_the_file_source_without_its_setting_fails_before_training(tmp_path, monkeypatch):
    monkeypatch.delenv("SPOT_NOTICE_FILE", raising=False)
    with pytest.raises(ConfigError, match="SPOT_NOTICE_FILE is not set"):
        SpotCheckpoint(dirpath=str(tmp_path / "run"), preemption="SIGTERM,file")
    monkeypatch.setenv("SPOT_NOTICE_FILE", os.fspath(tmp_path / "preempted"))
    assert SpotConfig(dirpath=str(tmp_path / "run"), preemption="SIGTERM,file").preemption == [
        "SIGTERM",
        "file",
    ]
