"""Names from a store are plain text in every UI: a payload named like Rich markup (``[/]``, a
``[link=...]``), or carrying ANSI / OSC 8 escapes, never breaks a progress bar, a table or a log line
and never reaches the terminal as markup or a hyperlink."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from spot_callbacks import CheckpointStore
from spot_callbacks.cli import commands as cli
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


@pytest.mark.parametrize("command", ["verify", "pull", "ls"])
def test_store_names_never_act_as_markup_or_escapes_on_a_terminal(
    command: str, hostile_run: CheckpointStore, tmp_path: Path, monkeypatch, capsys
) -> None:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(sys, "stdout", terminal)
    argv = {"verify": ["verify", hostile_run.url], "pull": ["pull", hostile_run.url, str(tmp_path / "dest")],
            "ls": ["ls", hostile_run.url]}[command]  # fmt: skip
    assert cli.main(argv) == 0, terminal.getvalue()
    shown = terminal.getvalue()
    assert "MarkupError" not in shown and "Traceback" not in shown
    _no_escapes(shown)
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
