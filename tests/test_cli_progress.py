"""What `spot-callbacks pull` shows while it downloads: plain lines when piped, bars on a terminal."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from datetime import datetime, timezone

from spot_callbacks import CheckpointStore
from spot_callbacks.accounting.throughput import SLOW_PULL_S, slow_pull_line
from spot_callbacks.cli_progress import PlainPullProgress, RichPullProgress, pull_progress
from spot_callbacks.store.checksums import FileDigest
from spot_callbacks.store.manifest import CheckpointInfo

SIZES = {"state.pt": 3_000_000, "extra/rng.bin": 1_000, "optimizer.pt": 2_000_000}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def info_with(sizes: dict[str, int]) -> CheckpointInfo:
    files = {name: FileDigest(size, "xxh3_64:00") for name, size in sizes.items()}
    return CheckpointInfo(1, "memory://run/step-1", datetime.now(timezone.utc), "end", sum(sizes.values()), "t",
                          files=files)  # fmt: skip


def test_the_pull_piped_prints_one_line_per_file_with_size_rate_and_eta_then_the_total(tmp_path):
    source = tmp_path / "src"
    for name, size in SIZES.items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes(bytes(size))
    store = CheckpointStore((tmp_path / "run").as_uri())
    store.write_checkpoint(1, source, reason="end", framework="test")
    dest = tmp_path / "pulled"
    done = subprocess.run(
        [sys.executable, "-m", "spot_callbacks.cli", "pull", store.url, str(dest)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{dest}\n"  # stdout stays the path alone, for scripts
    lines = [line for line in done.stderr.splitlines() if not line.startswith("spot-callbacks:")]
    file_line = re.compile(
        r"^(?P<name>\S+): (?P<size>[\d.]+ k?M?B) in \d+s \((?:-|[\d.]+ k?M?G?B/s)\); "
        r"(?P<n>\d)/3 files, [\d.]+ k?M?B of 5\.0 MB, ETA (?:\d+s|\?)$"
    )
    matches = [file_line.match(line) for line in lines[:-1]]
    assert all(matches), lines
    assert sorted(m["name"] for m in matches) == sorted(SIZES) and [m["n"] for m in matches] == [
        "1",
        "2",
        "3",
    ]
    assert {m["name"]: m["size"] for m in matches}["state.pt"] == "3.0 MB"
    assert re.match(r"^pulled 3 files, 5\.0 MB in \d+s \(", lines[-1]), lines
    assert (dest / "state.pt").stat().st_size == SIZES["state.pt"]

    again = subprocess.run(
        [sys.executable, "-m", "spot_callbacks.cli", "pull", store.url, str(dest)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert again.returncode == 0 and "pulled 3 files" not in again.stderr  # nothing downloaded again


def test_bars_only_on_a_terminal():
    info = info_with(SIZES)
    assert type(pull_progress(info, io.StringIO())) is PlainPullProgress
    terminal = Terminal()
    bars = pull_progress(info, terminal)
    try:
        assert isinstance(bars, RichPullProgress) and bars.total == 5_001_000
        bars.file_started("state.pt", "/nonexistent/state.pt")
        bars.file_done("state.pt")
    finally:
        bars.close()
    shown = terminal.getvalue()
    assert "checkpoint" in shown and "3.0/5.0 MB" in shown


def test_a_slow_resume_pull_gets_a_line_with_its_size_and_rate():
    info = info_with(SIZES)
    assert slow_pull_line(info, SLOW_PULL_S - 0.1) is None  # the resume line's time says enough
    line = slow_pull_line(info, 10.0)
    assert line == "spot_callbacks: pulled 5.0 MB of step 1 in 10.0s (500.1 kB/s) from memory://run/step-1"
