"""`spot-callbacks plan`: every argument takes a duration, an expectation without bound is said in words, and
`--from DIRPATH` takes its inputs from a real run's ledger (local folder and moto)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from spot_callbacks import CheckpointStore
from spot_callbacks._format import format_seconds
from spot_callbacks.accounting import report
from spot_callbacks.accounting.costs import plan_job
from spot_callbacks.accounting.plan_inputs import shown_rate, shown_seconds
from spot_callbacks.accounting.report import RunHistory
from spot_callbacks.cli import main
from spot_callbacks.lightning import SpotCheckpoint


def plan_rows(out: str) -> dict[str, str]:
    return {
        line.split("  ", 1)[0]: line.split("  ", 1)[1].strip() for line in out.splitlines() if "  " in line
    }


ARGS = ["--spot-price", "1", "--on-demand-price", "3", "--checkpoint-seconds", "5min"]


def test_work_hours_take_a_duration_like_every_other_argument(capsys) -> None:
    base = [*ARGS, "--interruptions-per-hour", "0.1", "--resume-seconds", "10min"]
    assert main(["plan", "--work-hours", "100", *base]) == 0
    as_number = capsys.readouterr().out
    assert main(["plan", "--work-hours", "100h", *base]) == 0
    assert capsys.readouterr().out == as_number
    assert main(["plan", "--work-hours", "6000min", *base]) == 0
    assert capsys.readouterr().out == as_number
    assert main(["plan", "--work-hours", "100 hours please", *base]) == 2
    assert "is not a duration" in capsys.readouterr().err


def test_a_job_that_never_finishes_on_spot_is_said_so_not_priced(capsys) -> None:
    argv = [
        "plan",
        "--work-hours",
        "100h",
        *ARGS,
        "--interruptions-per-hour",
        "20",
        "--resume-seconds",
        "10min",
    ]
    assert main(argv) == 0
    spot = plan_rows(capsys.readouterr().out)["spot"]
    assert spot.startswith("this job effectively never finishes on spot: an interruption comes every 3.0 min")
    assert "checkpoint (5.0 min) plus a resume (10.0 min)" in spot and "$" not in spot


# ------------------------------------------------------------------------------------ plan --from
SCRIPT = Path(__file__).parent / "scripts" / "lightning_run.py"
JOB = ["--work-hours", "100", "--spot-price", "1", "--on-demand-price", "3"]


def train(tmp_path: Path, url: str, options: dict, *args: str, scratch: str) -> subprocess.CompletedProcess:
    """A real Lightning run of tests/scripts/lightning_run.py on a fresh machine (its own scratch)."""
    env = {**os.environ, "SPOT_SCRATCH": str(tmp_path / f"scratch-{scratch}"), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--dirpath", url, "--storage-options", json.dumps(options),
         "--out", str(tmp_path / f"{scratch}.pt"), *args],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def plan_from(capsys, url: str, options: dict, *extra: str) -> tuple[int, dict[str, str], str]:
    code = main(["--storage-options", json.dumps(options), "plan", "--from", url, *JOB, *extra])
    out, err = capsys.readouterr()
    return code, plan_rows(out), err


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.remote_store)])
def run_url(request, tmp_path) -> tuple[str, dict]:
    if request.param == "file":
        return str(tmp_path / "run"), {}
    s3 = request.getfixturevalue("s3_server")
    return f"s3://{s3.bucket}/plan-from-{tmp_path.name}", dict(s3.storage_options)


@pytest.mark.slow
def test_plan_from_a_sigterm_and_resume_takes_delta_r_and_the_rate_from_the_runs_ledger(
    tmp_path, capsys, run_url
) -> None:
    url, options = run_url
    first = train(tmp_path, url, options, "--sigterm-at-step", "7", scratch="first")
    assert first.returncode == 143, first.stderr[-3000:]

    # Preempted, not resumed yet: the interruption is counted, but no resume measured R.
    code, rows, err = plan_from(capsys, url, options)
    assert code == 1 and rows == {}
    [line] = err.splitlines()
    assert line.startswith(
        f"spot-callbacks: error: the ledger of {CheckpointStore(url, storage_options=options).url} lacks"
    )
    assert (
        "the resume cost (no resume yet: no pull, load or downtime measured): pass --resume-seconds" in line
    )
    assert "--interruptions-per-hour" not in line and "--checkpoint-seconds" not in line
    code, rows, err = plan_from(capsys, url, options, "--resume-seconds", "4min")
    assert code == 0, err
    assert rows["resume cost"] == "4.0 min, given (--resume-seconds)"
    assert rows["interruption rate"].split(", from the run: ")[1].startswith("1 interruption in ")

    second = train(tmp_path, url, options, "--seed", "5", scratch="second")
    assert second.returncode == 0, second.stderr[-3000:]
    store = CheckpointStore(url, storage_options=options)
    history = RunHistory.from_checkpoints(store.url, store.committed())
    ledger = history.ledger
    assert (ledger.resumes, ledger.interruptions, history.interruptions) == (1, 1, 1)
    assert ledger.downtime_unknown == 0 and ledger.downtime_s > 0  # after an emergency checkpoint
    delta_s = (ledger.stall_s + ledger.slowdown_s) / ledger.checkpoint_count
    resume_s = ledger.pull_s + ledger.load_s + ledger.downtime_s
    rate = history.interruptions / (ledger.billed_s / 3600)

    code, rows, err = plan_from(capsys, url, options)
    assert code == 0, err
    count = ledger.checkpoint_count
    assert rows["checkpoint cost"].startswith(
        f"{shown_seconds(delta_s)}, from the run: {count} checkpoints blocked training"
    )
    assert rows["resume cost"].startswith(
        f"{shown_seconds(resume_s)}, from the run: pull {shown_seconds(ledger.pull_s)} + load "
        f"{shown_seconds(ledger.load_s)} on average over 1 resume + downtime {format_seconds(ledger.downtime_s)}"
    )
    assert rows["interruption rate"].startswith(f"{shown_rate(rate)}, from the run: 1 interruption in ")
    expected = dict(report.plan_rows(plan_job(100, 1, 3, rate, delta_s, resume_s)))
    assert {label: rows[label] for label in expected} == expected  # the plan of exactly those numbers

    # What `report` printed for the same run is what plan read.
    assert main(["--storage-options", json.dumps(options), "report", url]) == 0
    report_out = capsys.readouterr().out
    assert (
        f"1: pull {format_seconds(ledger.pull_s)}, load {format_seconds(ledger.load_s)} on average"
        in report_out
    )

    # An explicit argument overrides what the run measured, and says so.
    code, rows, err = plan_from(
        capsys, url, options, "--checkpoint-seconds", "30", "--interruptions-per-hour", "0.2"
    )
    assert code == 0, err
    assert rows["checkpoint cost"].startswith("30.0 s, given (--checkpoint-seconds); the run measured ")
    assert (
        rows["interruption rate"]
        == f"0.2 interruptions/h, given (--interruptions-per-hour); the run measured {shown_rate(rate)}"
    )
    assert rows["resume cost"].startswith(f"{shown_seconds(resume_s)}, from the run")
    assert (
        rows["job"].startswith("100 h of training; checkpoint 30.0 s, ")
        and "0.2 interruptions/h" in rows["job"]
    )


def test_plan_from_an_uninterrupted_run_names_each_flag_the_ledger_cannot_give(tmp_path, capsys) -> None:
    url = str(tmp_path / "run")
    spot = SpotCheckpoint(
        dirpath=url, scratch_dir=str(tmp_path / "scratch"), interval=None, every_n_steps=2, preemption=[]
    )
    trainer = pl.Trainer(
        callbacks=[spot], max_steps=4, logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.fit(BoringModel())
    capsys.readouterr()  # what training printed
    taken = RunHistory.from_checkpoints(url, CheckpointStore(url).committed()).ledger.checkpoint_count
    assert taken >= 2
    code, rows, err = plan_from(capsys, url, {})
    assert code == 1 and rows == {}
    [line] = err.splitlines()
    assert (
        "the resume cost (no resume yet: no pull, load or downtime measured): pass --resume-seconds" in line
    )
    assert (
        "the interruption rate (no interruption yet in " in line and "pass --interruptions-per-hour" in line
    )
    assert "--checkpoint-seconds" not in line  # the checkpoints measured it
    code, rows, err = plan_from(
        capsys, url, {}, "--resume-seconds", "5min", "--interruptions-per-hour", "0.1"
    )
    assert code == 0, err
    assert (
        rows["checkpoint cost"]
        .split(", ", 1)[1]
        .startswith(f"from the run: {taken} checkpoints blocked training")
    )


def test_plan_from_a_missing_dirpath_or_one_without_a_committed_checkpoint_fails_naming_it(
    tmp_path, capsys
) -> None:
    missing = tmp_path / "no-such-run"
    code, rows, err = plan_from(capsys, str(missing), {})
    assert code == 1 and rows == {}
    [line] = err.splitlines()
    assert f"nothing is stored under {CheckpointStore(str(missing)).url}" in line

    uncommitted = tmp_path / "run" / "step-000000003"
    uncommitted.mkdir(parents=True)
    (uncommitted / "state.pt").write_bytes(b"an upload that never committed")
    code, rows, err = plan_from(capsys, str(tmp_path / "run"), {}, "--resume-seconds", "1min")
    assert code == 1 and rows == {}
    [line] = err.splitlines()
    assert (
        f"no committed checkpoints in {CheckpointStore(str(tmp_path / 'run')).url}, so no ledger to plan from"
        in line
    )


@pytest.mark.remote_store
def test_plan_from_a_missing_s3_prefix_fails_naming_it(s3_server, capsys) -> None:
    url = f"s3://{s3_server.bucket}/no-such-run-{os.getpid()}"
    code, rows, err = plan_from(capsys, url, dict(s3_server.storage_options))
    assert code == 1 and rows == {}
    [line] = err.splitlines()
    assert f"nothing is stored under {url}" in line


def test_plan_without_from_still_requires_the_three_inputs(capsys) -> None:
    assert main(["plan", *JOB, "--resume-seconds", "5min"]) == 2
    err = capsys.readouterr().err
    assert "the following arguments are required: --checkpoint-seconds, --interruptions-per-hour" in err
    assert "(or --from DIRPATH, to take them from a run's ledger)" in err
