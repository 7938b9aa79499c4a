"""A quiet log that never breaks a progress bar: per-checkpoint lines only when ``verbose``, and every
line printed through the bar's own writer (Lightning's TQDM and Rich bars, the HF Trainer's tqdm)."""

from __future__ import annotations

import fcntl
import io
import logging
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import jsonargparse
import pytest
import tqdm

from spot_callbacks import SpotConfig
from spot_callbacks.hf import SpotCheckpointCallback
from spot_callbacks.lightning import SpotCheckpoint
from spot_callbacks.log import BarAwareHandler, checkpoint_line, set_verbose

SCRIPT = Path(__file__).parent / "scripts" / "bar_run.py"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
REPO = Path(__file__).resolve().parent.parent


def on_a_terminal(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run ``argv`` with stdout and stderr on one pseudo-terminal (120x40), as a user's shell shows it."""
    # The terminal's own size decides the width, as in a user's shell, not a COLUMNS a CI runner exports.
    env = {key: value for key, value in env.items() if key not in ("COLUMNS", "LINES")}
    master, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(argv, stdin=terminal, stdout=terminal, stderr=terminal, env=env, close_fds=True)
    os.close(terminal)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=300), b"".join(chunks).decode(errors="replace")


def glued_lines(screen: str) -> list[str]:
    """What stands before each ``spot_callbacks:`` that does not start a terminal line (a bar's text)."""
    text = ANSI.sub("", screen)
    return [
        text[max(found.start() - 60, 0) : found.start()]
        for found in re.finditer("spot_callbacks:", text)
        if found.start() > 0 and text[found.start() - 1] not in "\r\n"
    ]


def bar_run(tmp_path: Path, bar: str, loudness: str) -> str:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               SPOT_SCRATCH=str(tmp_path / "scratch"), TERM="xterm", PYTHONUNBUFFERED="1")  # fmt: skip
    code, screen = on_a_terminal([sys.executable, str(SCRIPT), str(tmp_path / "run"), bar, loudness], env)
    assert code == 0 and "bar_run: done" in screen, screen[-3000:]
    return ANSI.sub("", screen)


@pytest.mark.slow
@pytest.mark.parametrize("bar", ["tqdm", "rich"])
def test_verbose_lines_start_their_own_line_under_lightnings_bar(tmp_path: Path, bar: str) -> None:
    screen = bar_run(tmp_path, bar, "verbose")
    assert ("Epoch 0" in screen) and screen.count("spot_callbacks: committed ") >= 2, screen[-3000:]
    assert glued_lines(screen) == []


@pytest.mark.slow
def test_a_default_run_prints_no_per_checkpoint_line(tmp_path: Path) -> None:
    screen = bar_run(tmp_path, "tqdm", "quiet")
    assert "Epoch 0" in screen and "checkpoints" in screen  # the bar, and the cost summary at the end
    assert "spot_callbacks: committed " not in screen and "retention deleted" not in screen
    assert screen.count("dropping checkpoint of step") <= 1  # the first, with its cause; not one per step
    assert glued_lines(screen) == []


def test_a_line_logged_under_a_tqdm_bar_goes_through_tqdm_write(monkeypatch) -> None:
    """The HF Trainer's bar is a plain tqdm: the line is printed above it, never after its text."""
    screen = io.StringIO()
    monkeypatch.setattr(sys, "stderr", screen)
    record = logging.makeLogRecord({"msg": "spot_callbacks: committed step 4", "levelno": logging.INFO})
    handler = BarAwareHandler()
    with tqdm.tqdm(total=10, file=sys.stderr, ncols=80, mininterval=0) as bar:
        bar.update(3)
        handler.emit(record)
        bar.update(3)
    assert "spot_callbacks: committed step 4\n" in screen.getvalue()
    assert glued_lines(screen.getvalue()) == []
    handler.emit(record)  # no bar: a plain line on stderr as it is now
    assert screen.getvalue().endswith("spot_callbacks: committed step 4\n")


def test_checkpoint_lines_are_debug_lines_unless_verbose(caplog) -> None:
    try:
        with caplog.at_level(logging.DEBUG, logger="spot_callbacks"):
            checkpoint_line("spot_callbacks: committed %s", "step 2")
            set_verbose(True)
            checkpoint_line("spot_callbacks: committed %s", "step 4")
    finally:
        set_verbose(False)
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "spot_callbacks"] == [
        (logging.DEBUG, "spot_callbacks: committed step 2"),
        (logging.INFO, "spot_callbacks: committed step 4"),
    ]


def test_verbose_true_in_yaml_and_lightning_cli_reaches_the_adapters(tmp_path: Path) -> None:
    path = tmp_path / "spot.yaml"
    path.write_text(f"dirpath: {tmp_path / 'run'}\npreemption: []\nverbose: true\n")
    assert SpotCheckpoint.from_yaml(path).config.verbose is True
    assert SpotCheckpointCallback.from_yaml(path).config.verbose is True
    assert SpotConfig(dirpath=str(tmp_path / "run")).verbose is False
    # LightningCLI reads the callback's signature through jsonargparse, as here.
    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(SpotCheckpoint, "spot")
    parsed = parser.parse_args(
        [f"--spot.dirpath={tmp_path / 'run'}", "--spot.preemption=[]", "--spot.verbose=true"]
    )
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # v4.49 renamed it
    assert instantiate(parsed).spot.config.verbose is True
