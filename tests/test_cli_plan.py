"""`spot-callbacks plan`: every argument takes a duration, and an expectation without bound is said in words."""

from __future__ import annotations

from spot_callbacks.cli import main


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
