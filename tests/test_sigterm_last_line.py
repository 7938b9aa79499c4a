"""After SIGTERM, the run's last line says what happens next, and it is the truth about the store."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spot_callbacks import CheckpointStore

SCRIPT = Path(__file__).parent / "scripts" / "lightning_run.py"


@pytest.mark.slow
def test_the_last_line_after_sigterm_names_the_committed_resume_point_and_the_rerun(tmp_path) -> None:
    url = str(tmp_path / "run")
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--dirpath", url, "--out", str(tmp_path / "w.pt"), "--sigterm-at-step", "7"],
        env={**os.environ, "SPOT_SCRATCH": str(tmp_path / "scratch")}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 143, run.stderr[-3000:]
    last = [line for line in run.stderr.splitlines() if line.strip()][-1]
    resume_point = CheckpointStore(url).latest()
    assert resume_point is not None and resume_point.reason == "preemption"
    assert last == (
        f"spot_callbacks: stopped for the SIGTERM notice; the resume point is step {resume_point.step}, "
        f"committed in {CheckpointStore(url).url}: rerun the same command to continue from it"
    ), run.stderr[-2000:]
