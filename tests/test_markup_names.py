"""Names from a store are plain text in every UI: a payload named like Rich markup (``[/]``, a
``[link=...]``), or carrying ANSI / OSC 8 escapes, never breaks a progress bar, a table or a log line
and never reaches the terminal as markup or a hyperlink."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_bar_lines import REPO, on_a_terminal

from spot_callbacks import CheckpointStore
from spot_callbacks.cli import commands as cli
from spot_callbacks.store.manifest import CheckpointInfo
from spot_callbacks.store.writer import CommitWriter

# Control characters in a payload name are refused by the manifest's reader already (store/manifest.py).
NAMES = ["[/]", "[link=https://evil.example]w.bin[/link]", "[bold red]x[/bold red].bin", "[/x]"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def hostile_run(tmp_path: Path) -> CheckpointStore:
    folder = tmp_path / "src"
    for index, name in enumerate(NAMES):
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes([index]) * 300_000)
    store = CheckpointStore(str(tmp_path / "run"))
    CommitWriter(store).write_checkpoint(3, folder, reason="interval", framework="test")
    return store


def _no_escapes(text: str) -> None:
    assert "\x1b]8" not in text, "a hyperlink reached the terminal"


def a_slow_link(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Each file a local store pulls or reads stays in flight ``seconds`` (the bars, redrawn every 0.2 s,
    draw a bar named after it), as on a far-away bucket."""
    from fsspec.implementations.local import LocalFileSystem

    real_get_file, real_open = LocalFileSystem.get_file, LocalFileSystem._open

    def get_file(self: LocalFileSystem, *args: Any, **kwargs: Any) -> Any:
        real_get_file(self, *args, **kwargs)
        time.sleep(seconds)  # the link's pace, not a synchronisation

    def open_file(self: LocalFileSystem, *args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)  # the link's pace, not a synchronisation
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "get_file", get_file)
    monkeypatch.setattr(LocalFileSystem, "_open", open_file)


@pytest.mark.parametrize("command", ["verify", "pull", "ls"])
def test_store_names_never_act_as_markup_or_escapes_on_a_terminal(
    command: str, hostile_run: CheckpointStore, tmp_path: Path, monkeypatch, capsys
) -> None:
    a_slow_link(monkeypatch, 0.5)
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(sys, "stdout", terminal)
    argv = {"verify": ["verify", hostile_run.url], "pull": ["pull", hostile_run.url, str(tmp_path / "dest")],
            "ls": ["ls", hostile_run.url]}[command]  # fmt: skip
    assert cli.main(argv) == 0, terminal.getvalue()
    shown = terminal.getvalue()
    assert "MarkupError" not in shown and "Traceback" not in shown
    _no_escapes(shown)
    if command != "ls":
        assert "[bold red]x[/bold red].bin" in shown  # a file in flight, its bar named literally
    if command == "pull":
        for name in NAMES:
            assert (tmp_path / "dest" / name).is_file()  # the bytes arrive under their real names


def test_the_pull_bars_show_markup_named_files_in_flight_as_plain_text() -> None:
    from spot_callbacks.progress import RichProgress
    from spot_callbacks.store.meter import TransferMeter

    meter = TransferMeter("pull")
    meter.expect({name: 1000 for name in NAMES})
    for name in NAMES:
        meter.attempt(name)(10)  # each file in flight, 10 bytes in
    terminal = Terminal()
    bars = RichProgress(
        meter, "pull [link=https://evil.example]run[/link]", terminal, transient=False, verb="pulled"
    )
    try:
        bars.redraw()  # a bar per file in flight, named by the store
        bars.bars.refresh()
    finally:
        bars.close(completed=False)
    shown = terminal.getvalue()
    _no_escapes(shown)
    assert "[link=https://evil.example]w.bin[/link]" in shown and "[/]" in shown  # shown literally


# What a terminal would act on, written with C1 controls (the manifest refuses C0, ESC included, in a
# name; a one-byte CSI or OSC is a valid one): a colour and a screen-clear, and an OSC 8 hyperlink.
ANSI_NAME = "\x9b31m\x9b2Jred.bin"
OSC8_NAME = "\x9d8;;mailto:x@evil.example\x9cw.bin\x9d8;;\x9c"  # no "//": a name is a path
TERMINAL_NAMES = ["[/]", "[link=mailto:x@evil.example]w.bin[/link]", ANSI_NAME, OSC8_NAME]
HOSTILE_TEXT = "[/]\x9b2J[link=https://e.x]f[/link]"  # short: ls keeps room for its VALID column
RESUME_SCRIPT = Path(__file__).parent / "scripts" / "markup_resume.py"


def _terminal_env(tmp_path: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                SPOT_SCRATCH=str(tmp_path / "scratch"), TERM="xterm", PYTHONUNBUFFERED="1")  # fmt: skip


def _nothing_a_terminal_acts_on(screen: str) -> None:
    """No hyperlink, and no escape from a store's names: rich's own cursor moves are the only ESCs."""
    assert "\x1b]8;" not in screen and "\x9d" not in screen and "\x9b" not in screen, screen[-3000:]
    assert "evil.example\x1b" not in screen and "\x1b[2J" not in screen, screen[-3000:]
    assert "MarkupError" not in screen and "Traceback" not in screen, screen[-3000:]


def _with_hostile_files(
    info: CheckpointInfo, store: CheckpointStore, into: CheckpointStore, tmp_path: Path
) -> None:
    """``info`` of ``store`` committed again into ``into`` by the real writer, with files named like
    markup and terminal escapes next to the framework's own."""
    folder = store.pull(info.step, tmp_path / "hostile-payload")
    for index, name in enumerate(TERMINAL_NAMES):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(bytes([index]) * 300_000)
    CommitWriter(into).write_checkpoint(
        info.step, folder, reason=info.reason, framework=info.framework, epoch=info.epoch,
        metrics=info.metrics, extra=info.extra,
    )  # fmt: skip


@pytest.mark.slow
def test_a_terminal_resume_from_files_named_like_markup_and_escapes_resumes_and_shows_them_as_text(
    tmp_path: Path,
) -> None:
    env = _terminal_env(tmp_path)
    first = subprocess.run(
        [sys.executable, str(RESUME_SCRIPT), str(tmp_path / "first"), "4", "0"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert first.returncode == 0 and "done at step 4" in first.stdout, (
        first.stdout[-2000:] + first.stderr[-3000:]
    )
    written = CheckpointStore(str(tmp_path / "first"))
    newest = written.latest()
    assert newest is not None and newest.step == 4
    hostile = CheckpointStore(str(tmp_path / "run"))
    _with_hostile_files(newest, written, hostile, tmp_path)
    assert set(TERMINAL_NAMES) <= set(hostile.committed()[-1].files)

    # Each file stays in flight 0.6 s: the pull bars (redrawn every 0.2 s) draw one per name.
    code, screen = on_a_terminal([sys.executable, str(RESUME_SCRIPT), str(tmp_path / "run"), "8", "0.6"], env)
    assert code == 0, screen[-3000:]
    assert "markup_resume: starting at step 4" in screen and "markup_resume: done at step 8" in screen, (
        screen[-3000:]
    )
    _nothing_a_terminal_acts_on(screen)
    assert "\\x9d8;;mailto:x@evil.example\\x9cw.bin" in screen, screen[
        -3000:
    ]  # the name, escaped, in its bar


def _hostile_store(tmp_path: Path) -> CheckpointStore:
    """Two checkpoints with markup and escapes in their names and framework; step 2 lost a file."""
    folder = tmp_path / "src"
    for index, name in enumerate(TERMINAL_NAMES):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(bytes([index]) * 1000)
    store = CheckpointStore(str(tmp_path / "run"))
    for step in (2, 4):
        CommitWriter(store).write_checkpoint(step, folder, reason="interval", framework=HOSTILE_TEXT)
    (tmp_path / "run" / "step-000000002" / OSC8_NAME).unlink()  # ls names the missing file
    return store


@pytest.mark.parametrize("command", ["ls", "report"])
def test_ls_and_report_on_a_terminal_show_the_stores_names_as_text(command: str, tmp_path: Path) -> None:
    store = _hostile_store(tmp_path)
    argv = [sys.executable, "-m", "spot_callbacks.cli", command, store.url]
    code, screen = on_a_terminal(argv, _terminal_env(tmp_path))
    assert code == 0, screen[-3000:]
    _nothing_a_terminal_acts_on(screen)
    assert "[/]\\x9b2J[link=https://e.x]f[/link]" in screen.replace("\r\n", "")  # the framework, literally
    if command == "ls":
        assert "\\x9d8;;mailto:" in screen and "is missing" in screen, screen  # the lost file, escaped
