"""What a wait on a transfer shows while bytes move: `spot-callbacks pull` / `verify`, a resume's pull, the
end-of-fit and emergency waits. Piped (or into a log): a line every ``$SPOT_PROGRESS_EVERY_S`` with bytes,
rate and ETA, read here while a throttled transfer runs through the fast clients against moto; on a
terminal: bars.
"""

from __future__ import annotations

import io
import logging
import os
import posixpath
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch
from helpers.throttle import throttled

from spot_callbacks import CheckpointStore, CorruptCheckpointError
from spot_callbacks.accounting import throughput
from spot_callbacks.accounting.throughput import SLOW_PULL_S, slow_pull_line
from spot_callbacks.cli import commands as cli
from spot_callbacks.persist import Persister, PersistJob
from spot_callbacks.preemption.emergency import Emergency
from spot_callbacks.preemption.notice import Notice
from spot_callbacks.progress import showing_progress
from spot_callbacks.resume import pull_latest
from spot_callbacks.store.checksums import FileDigest
from spot_callbacks.store.manifest import CheckpointInfo
from spot_callbacks.store.meter import TransferMeter
from spot_callbacks.store.writer import CommitWriter

SIZES = {"state.pt": 3_000_000, "extra/rng.bin": 1_000, "optimizer.pt": 2_000_000}
LOGGER = "spot_callbacks"
EVERY_S = "0.25"  # the test's progress interval (default 10 s)
RATE = 2_000_000  # bytes/s through the throttling proxy, both directions together
# A small transfer budget makes ranges of 1 MiB, so one file of a few MB moves as several ranges.
SMALL_BUDGET = {"SPOT_TRANSFER_BUFFER_MB": "8", "SPOT_PROGRESS_EVERY_S": EVERY_S}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


# human_duration's forms: "42s", "3m07s", "1h02m".
DURATION = r"(?:\d+s|\d+m\d\ds|\d+h\d\dm)"
SIZE = r"[\d.]+ (?:B|kB|MB|GB)"


def info_with(sizes: dict[str, int]) -> CheckpointInfo:
    files = {name: FileDigest(size, "xxh3_64:00") for name, size in sizes.items()}
    return CheckpointInfo(1, "memory://run/step-1", datetime.now(timezone.utc), "end", sum(sizes.values()), "t",
                          files=files)  # fmt: skip


def random_file(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(torch.randint(0, 256, (size,), dtype=torch.uint8).numpy().tobytes())


def progress_bytes(lines: list[str], label: str) -> list[float]:
    """The bytes done of each progress line of ``label`` (in MB)."""
    found = []
    for line in lines:
        match = re.search(rf"{re.escape(label)}.*?: ({SIZE}) of ({SIZE}) \((\d+)%\), \d+/\d+ files?, ", line)
        if match:
            number, unit = match[1].split()
            found.append(float(number) * {"B": 1e-6, "kB": 1e-3, "MB": 1.0, "GB": 1e3}[unit])
    return found


def s3_store_through(proxy_url: str, server, tmp_path: Path, name: str) -> CheckpointStore:
    """A store on moto behind the throttling proxy, its clients built (as training's preflight does)."""
    options = {**server.storage_options, "endpoint_url": proxy_url}
    store = CheckpointStore(f"s3://{server.bucket}/{name}-{tmp_path.name}", storage_options=options)
    warming = store.warm_data_plane()
    assert warming is not None
    warming.join(timeout=60)
    return store


# ----------------------------------------------------------------- the CLI, piped
@pytest.mark.parametrize("command", ["pull", "verify"])
def test_piped_pull_and_verify_print_a_line_every_interval_while_one_file_moves(
    s3_server, tmp_path, command, caplog
):
    # One 5 MB file through a 2 MB/s link: lines while it moves (not only when it ends), bytes rising.
    random_file(tmp_path / "src" / "state.ckpt", 5_000_000)
    piped = CheckpointStore(
        f"s3://{s3_server.bucket}/cli-{tmp_path.name}", storage_options=s3_server.storage_options
    )
    CommitWriter(piped).write_checkpoint(3, tmp_path / "src", reason="end", framework="test")
    url = f"s3://{s3_server.bucket}/cli-{tmp_path.name}"
    dest = tmp_path / "pulled"
    with throttled(s3_server.port, RATE) as proxy:
        env = {**os.environ, **SMALL_BUDGET, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_ENDPOINT_URL": proxy.url}  # fmt: skip
        arguments = [url, str(dest)] if command == "pull" else [url]
        done = subprocess.run(
            [sys.executable, "-m", "spot_callbacks.cli", "-v", command, *arguments],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    label = f"{command} {url}/step-"
    moved = progress_bytes(lines, label)
    # Lines while the file moves; a periodic line may also land on the full size just before the last
    # line on a loaded box (CI saw it once): not counted as one while it moves.
    rising = [mb for mb in moved if mb < 5.0]
    assert len(rising) >= 3 and moved == sorted(moved) and rising[0] < rising[-1], lines
    assert any("obstore" in line and "payload bytes" in line for line in lines), (
        lines
    )  # the fast path moved them
    verb = {"pull": "pulled", "verify": "verified"}[command]
    [total] = [line for line in lines if line.startswith(f"{verb} ")]
    assert re.match(rf"^{verb} 1 file, 5\.0 MB in {DURATION} \(", total), lines
    if command == "pull":
        assert done.stdout == f"{dest}\n" and (dest / "state.ckpt").stat().st_size == 5_000_000
    else:
        assert done.stdout.startswith("OK step 3: 1 file, 5.0 MB verified")


def test_a_pull_already_done_downloads_nothing_and_prints_no_total(tmp_path):
    source = tmp_path / "src"
    for name, size in SIZES.items():
        random_file(source / name, size)
    store = CheckpointStore((tmp_path / "run").as_uri())
    CommitWriter(store).write_checkpoint(1, source, reason="end", framework="test")
    dest = tmp_path / "pulled"
    first = subprocess.run(
        [sys.executable, "-m", "spot_callbacks.cli", "pull", store.url, str(dest)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert first.returncode == 0 and first.stdout == f"{dest}\n", first.stderr
    assert re.search(rf"^pulled 3 files, 5\.0 MB in {DURATION} \(", first.stderr, re.M), first.stderr
    again = subprocess.run(
        [sys.executable, "-m", "spot_callbacks.cli", "pull", store.url, str(dest)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert again.returncode == 0 and "pulled 3 files" not in again.stderr, again.stderr


def test_bars_only_on_a_terminal():
    shown = {}
    for name, stream in (("piped", io.StringIO()), ("terminal", Terminal())):
        meter = TransferMeter("pull")
        with showing_progress(meter, "pull x", stream=stream, verb="pulled"):
            meter.expect(SIZES)
            meter.attempt("state.pt")(3_000_000)
            meter.file_done("state.pt")
        shown[name] = stream.getvalue()
    assert "3.0/5.0 MB" in shown["terminal"] and "pull x" in shown["terminal"], shown
    assert "3.0/5.0 MB" not in shown["piped"] and shown["piped"].startswith("pulled 1 file, 3.0 MB in "), (
        shown
    )


def test_a_file_retried_counts_from_zero_and_a_late_report_of_its_first_attempt_is_ignored():
    meter = TransferMeter("upload")
    meter.expect({"a.pt": 100})
    first = meter.attempt("a.pt")
    first(80)
    second = meter.attempt("a.pt")  # the first attempt timed out and is retried
    first(20)  # ... but runs on for a while
    second(10)
    assert meter.reading().done_bytes == 10
    meter.file_done("a.pt")
    first(50)
    assert meter.reading().done_bytes == 100 and meter.reading().complete


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
    CommitWriter(store).write_checkpoint(step, payload, reason="interval", framework="test")
    return store


def test_a_resume_pull_on_a_terminal_shows_bars_and_leaves_the_resume_line(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="spot_callbacks")
    store = committed_store(tmp_path)
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    resumed = pull_latest(store, lambda step: tmp_path / "local" / f"step-{step}", rank=0, local_rank=0)
    assert resumed.info.step == 8 and (resumed.local_dir / "state.ckpt").stat().st_size == 2_000_000
    assert "pulling" in terminal.getvalue() and "MB" in terminal.getvalue()
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


def test_a_throttled_resume_pull_into_a_log_gets_a_line_every_interval(
    s3_server, tmp_path, monkeypatch, caplog
):
    for knob, value in SMALL_BUDGET.items():
        monkeypatch.setenv(knob, value)
    caplog.set_level(logging.INFO, logger=LOGGER)
    random_file(tmp_path / "src" / "state.ckpt", 4_000_000)
    with throttled(s3_server.port, RATE) as proxy:
        store = s3_store_through(proxy.url, s3_server, tmp_path, "resume")
        CommitWriter(store).write_checkpoint(6, tmp_path / "src", reason="end", framework="test")
        monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file's stderr: no bars
        pulled = pull_latest(store, lambda step: tmp_path / "local" / f"step-{step}", rank=0, local_rank=0)
    assert pulled.info.step == 6 and (pulled.local_dir / "state.ckpt").stat().st_size == 4_000_000
    moved = progress_bytes([r.getMessage() for r in caplog.records], "pulling s3://")
    assert len([mb for mb in moved if mb < 4.0]) >= 2 and moved == sorted(moved), (
        caplog.text
    )  # while it moves


def upload_job(tmp_path: Path, step: int, size: int) -> PersistJob:
    folder = tmp_path / f"step-{step}"
    random_file(folder / "state.ckpt", size)
    return PersistJob(step=step, reason="end", framework="test", local_dir=folder, owns_local_dir=False)


class NoNotice:
    notice = None
    interrupted_twice = False


def test_the_end_of_fit_wait_on_a_throttled_upload_says_bytes_rate_and_eta_every_interval(
    s3_server, tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("SPOT_PROGRESS_EVERY_S", EVERY_S)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    caplog.set_level(logging.INFO, logger=LOGGER)
    with throttled(s3_server.port, RATE) as proxy:
        persister = Persister(s3_store_through(proxy.url, s3_server, tmp_path, "end-wait"), keep_last=0)
        persister.submit(upload_job(tmp_path, 5, 7_000_000))  # ~3.5 s through the proxy
        try:
            assert Emergency(NoNotice()).wait_at_exit(persister, 5, None, say=True)  # type: ignore[arg-type]
        finally:
            persister.close()
    assert persister.last_committed is not None and persister.last_committed.step == 5
    messages = [r.getMessage() for r in caplog.records]
    [said] = [
        m
        for m in messages
        if m.startswith("spot_callbacks: waiting for the upload of the checkpoint of step 5")
    ]
    assert re.search(rf"\(no limit but the store's upload timeouts\): {SIZE} of 7\.0 MB \(\d+%\)", said), said
    still = [m for m in messages if m.startswith("spot_callbacks: still waiting for the upload of step 5 (")]
    moved = progress_bytes(still, "upload of step 5")
    # Non-decreasing, not rising: the client counts bytes as sent once its socket buffer (megabytes
    # on loopback) took them, so the last seconds can show the same count.
    assert len([mb for mb in moved if mb < 7.0]) >= 2 and moved == sorted(moved), messages  # while it moves
    assert all(re.search(r", ETA " + DURATION + "$", line) for line in still), still


def test_an_emergency_wait_on_a_throttled_upload_says_how_far_it_got(
    s3_server, tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("SPOT_PROGRESS_EVERY_S", EVERY_S)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    caplog.set_level(logging.INFO, logger=LOGGER)
    notice = Notice("SIGTERM", None)
    with throttled(s3_server.port, RATE) as proxy:
        persister = Persister(s3_store_through(proxy.url, s3_server, tmp_path, "emergency"), keep_last=0)
        persister.submit(upload_job(tmp_path, 9, 5_000_000))
        try:
            assert Emergency(NoNotice()).wait_for_checkpoint(persister, 9, notice, None, True)  # type: ignore[arg-type]
        finally:
            persister.close()
    messages = [r.getMessage() for r in caplog.records]
    moved = progress_bytes(messages, "spot_callbacks: emergency checkpoint of step 9")
    assert len(moved) >= 2 and moved == sorted(moved) and moved[-1] <= 5.0, messages
    assert any(m.startswith("spot_callbacks: emergency checkpoint committed") for m in messages), messages


def test_verify_on_a_terminal_shows_the_bytes_read_and_piped_prints_its_total_on_stderr(
    tmp_path, monkeypatch, capsys
):
    store = committed_store(tmp_path)
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main(["verify", store.url]) == 0
    assert capsys.readouterr().out == "OK step 8: 1 file, 2.0 MB verified\n"
    assert "verify" in terminal.getvalue() and "2.0/2.0 MB" in terminal.getvalue()

    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    assert cli.main(["verify", store.url]) == 0
    assert capsys.readouterr().out == "OK step 8: 1 file, 2.0 MB verified\n"  # stdout stays for scripts
    assert re.fullmatch(rf"verified 1 file, 2\.0 MB in {DURATION} \(.+/s\)\n", piped.getvalue()), (
        piped.getvalue()
    )


def test_a_verify_that_finds_damage_gives_no_closing_total(tmp_path):
    store = committed_store(tmp_path)
    path = posixpath.join(store.step_path(8), "state.ckpt")
    store.fs.pipe_file(path, b"\x02" * 2_000_000)  # same size, other bytes
    piped, meter = io.StringIO(), TransferMeter("verify")
    with (
        pytest.raises(CorruptCheckpointError),
        showing_progress(meter, "verify", stream=piped, verb="verified"),
    ):
        store.verify(8, deep=True, meter=meter)
    assert meter.reading().files_done == 0  # read, but not counted as verified
    assert not any(line.startswith("verified") for line in piped.getvalue().splitlines()), piped.getvalue()


@pytest.mark.parametrize("shape", ["stream", "segments"])
def test_piped_pull_counts_a_streams_bytes_as_they_land_not_when_its_chunk_or_segment_completes(
    s3_server, tmp_path, shape
):
    # The default budget (96 MiB: 6 MiB ranges) and one 8 MB file through a 1 MB/s link, as one stream
    # or as 4 segments of 2 MiB: the piped lines move a MiB at a time while the file moves (a count
    # per completed 6 MiB chunk or segment read 0 B, then jumped).
    random_file(tmp_path / "src" / "state.ckpt", 8_000_000)
    url = f"s3://{s3_server.bucket}/landing-{shape}-{tmp_path.name}"
    store = CheckpointStore(url, storage_options=s3_server.storage_options)
    CommitWriter(store).write_checkpoint(3, tmp_path / "src", reason="end", framework="test")
    with throttled(s3_server.port, RATE // 2) as proxy:
        env = {**os.environ, "SPOT_PROGRESS_EVERY_S": EVERY_S, "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_ENDPOINT_URL": proxy.url,
               "SPOT_PULL_SEGMENT_MB": "128" if shape == "stream" else "2"}  # fmt: skip
        env.pop("SPOT_TRANSFER_BUFFER_MB", None)
        done = subprocess.run(
            [sys.executable, "-m", "spot_callbacks.cli", "-v", "pull", url, str(tmp_path / "dest")],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert any("obstore" in line and "payload bytes" in line for line in lines), lines
    moving = sorted(set(progress_bytes(lines, f"pull {url}/step-")) - {0.0})
    # Counts no completed 6 MiB range could give (a periodic line may also land on the full 8.0 MB
    # just before the pull's last line, on a loaded box: that says nothing either way).
    below_a_range = [mb for mb in moving if mb < 6.0]
    assert len(below_a_range) >= 3, lines
    assert (tmp_path / "dest" / "state.ckpt").stat().st_size == 8_000_000
