"""What `spot-callbacks pull` / `verify` and a resume's pull show while they download: plain lines (or nothing) when
piped, bars on a terminal, a line with size and rate for a slow resume pull (both adapters)."""

from __future__ import annotations

import io
import logging
import posixpath
import re
import subprocess
import sys
from datetime import datetime, timezone

import pytest

from spot_callbacks import CheckpointStore, CorruptCheckpointError
from spot_callbacks.accounting import throughput
from spot_callbacks.accounting.throughput import SLOW_PULL_S, slow_pull_line
from spot_callbacks.cli import commands as cli
from spot_callbacks.progress import PlainPullProgress, RichPullProgress, pull_progress, reporting_pull
from spot_callbacks.resume import pull_latest
from spot_callbacks.store.checksums import FileDigest
from spot_callbacks.store.manifest import CheckpointInfo

SIZES = {"state.pt": 3_000_000, "extra/rng.bin": 1_000, "optimizer.pt": 2_000_000}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


# human_duration's forms: "42s", "3m07s", "1h02m". An ETA taken after the first small file of a
# loaded machine can run to minutes (CI once printed "ETA 2m28s" after a 1 kB file).
DURATION = r"(?:\d+s|\d+m\d\ds|\d+h\d\dm)"


def info_with(sizes: dict[str, int]) -> CheckpointInfo:
    files = {name: FileDigest(size, "xxh3_64:00") for name, size in sizes.items()}
    return CheckpointInfo(1, "memory://run/step-1", datetime.now(timezone.utc), "end", sum(sizes.values()), "t",
                          files=files)  # fmt: skip


def test_the_eta_counts_from_the_first_file_not_from_the_setup_before_it() -> None:
    # 10 s of manifest reads and listing, then the first 1 MB of 5 MB takes 1 s: 4 MB left at 1 MB/s.
    sink, now = io.StringIO(), iter([0.0, 10.0, 11.0]).__next__
    progress = PlainPullProgress({"a.pt": 1_000_000, "b.pt": 4_000_000}, sink, clock=now)
    progress.file_reading("a.pt", lambda: 0)
    progress.file_done("a.pt")
    assert sink.getvalue().endswith(", ETA 4s\n"), sink.getvalue()


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
        rf"^(?P<name>\S+): (?P<size>[\d.]+ k?M?B) in {DURATION} \((?:-|[\d.]+ k?M?G?B/s)\); "
        rf"(?P<n>\d)/3 files, [\d.]+ k?M?B of 5\.0 MB, ETA (?:{DURATION}|\?)$"
    )
    matches = [file_line.match(line) for line in lines[:-1]]
    assert all(matches), lines
    assert sorted(m["name"] for m in matches) == sorted(SIZES) and [m["n"] for m in matches] == [
        "1",
        "2",
        "3",
    ]
    assert {m["name"]: m["size"] for m in matches}["state.pt"] == "3.0 MB"
    assert re.match(rf"^pulled 3 files, 5\.0 MB in {DURATION} \(", lines[-1]), lines
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


def committed_store(tmp_path, step: int = 8) -> CheckpointStore:
    store = CheckpointStore(str(tmp_path / "run"))
    payload = tmp_path / "payload"
    payload.mkdir()
    (payload / "state.ckpt").write_bytes(b"\x01" * 2_000_000)
    store.write_checkpoint(step, payload, reason="interval", framework="test")
    return store


def test_a_resume_pull_on_a_terminal_shows_bars_and_leaves_the_resume_line(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="spot_callbacks")
    store = committed_store(tmp_path)
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    resumed = pull_latest(store, lambda step: tmp_path / "local" / f"step-{step}", rank=0, local_rank=0)
    assert resumed.info.step == 8 and (resumed.local_dir / "state.ckpt").stat().st_size == 2_000_000
    assert "checkpoint" in terminal.getvalue() and "MB" in terminal.getvalue()
    assert any("resuming from" in r.getMessage() for r in caplog.records)


def test_a_resume_pull_to_a_log_file_shows_no_bars(tmp_path, monkeypatch):
    store = committed_store(tmp_path)
    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    pull_latest(store, lambda step: tmp_path / "local" / f"step-{step}", rank=0, local_rank=0)
    assert piped.getvalue() == ""


@pytest.mark.slow
def test_a_slow_hf_resume_pull_is_logged_with_its_size_and_rate(tmp_path, monkeypatch, caplog):
    # The line comes from the shared resume path: Lightning's resume logs it the same way.
    from test_hf import make_trainer

    from spot_callbacks.hf import SpotCheckpointCallback

    caplog.set_level(logging.INFO, logger="spot_callbacks")
    monkeypatch.setattr(throughput, "SLOW_PULL_S", 0.0)  # every pull counts as slow here
    options = dict(dirpath=str(tmp_path / "store"), interval=None, every_n_steps=4, preemption=[])
    make_trainer(tmp_path / "a", [SpotCheckpointCallback(**options)], max_steps=4).train()
    caplog.clear()
    ckpt = SpotCheckpointCallback(**options)
    make_trainer(tmp_path / "b", [ckpt], max_steps=6).train(resume_from_checkpoint=ckpt.latest())
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("spot_callbacks: pulled ")]
    assert re.fullmatch(
        r"spot_callbacks: pulled [\d.]+ [kM]B of step 4 in [\d.]+s \(.+/s\) from .*step-0+4", line
    )


def test_verify_on_a_terminal_shows_the_bytes_read_and_piped_keeps_stderr_for_errors(
    tmp_path, monkeypatch, capsys
):
    store = committed_store(tmp_path)
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main(["verify", store.url]) == 0
    assert capsys.readouterr().out == "OK step 8: 1 file, 2.0 MB verified\n"
    assert "checkpoint" in terminal.getvalue() and "2.0/2.0 MB" in terminal.getvalue()

    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    assert cli.main(["verify", store.url]) == 0
    assert piped.getvalue() == ""


def test_a_verify_that_finds_damage_gives_no_closing_total(tmp_path):
    store = committed_store(tmp_path)
    info = store.latest()
    path = posixpath.join(store.step_path(8), "state.ckpt")
    store.fs.pipe_file(path, b"\x02" * 2_000_000)  # same size, other bytes
    piped = io.StringIO()
    with pytest.raises(CorruptCheckpointError), reporting_pull(store, info, piped, verb="verified"):
        store.verify(8, deep=True)
    lines = piped.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("state.ckpt: 2.0 MB in "), lines  # read to its end
    assert not any(line.startswith("verified") for line in lines)
