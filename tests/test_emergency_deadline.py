"""An emergency checkpoint the store is too slow for ends inside the notice's deadline, and the
run's last line is the truth about the store: which step is the resume point, and that the newest
checkpoint was abandoned. Moto behind a throttling proxy slowed to a trickle after the resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.throttle import throttled

from spot_callbacks import CheckpointStore

SCRIPT = Path(__file__).parent / "scripts" / "lightning_run.py"
GRACE_S = 30.0


@pytest.mark.slow
def test_an_emergency_upload_too_slow_for_the_grace_exits_in_time_and_says_the_true_resume_point(
    s3_server, tmp_path
) -> None:
    url = f"s3://{s3_server.bucket}/deadline-{tmp_path.name}"
    direct = dict(s3_server.storage_options)
    base = [sys.executable, str(SCRIPT), "--dirpath", url, "--out", str(tmp_path / "w.pt")]
    first = subprocess.run(
        [*base, "--storage-options", json.dumps(direct), "--sigterm-at-step", "5"],
        env={**os.environ, "SPOT_SCRATCH": str(tmp_path / "scratch-1")}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert first.returncode == 143, first.stderr[-3000:]
    resume_point = CheckpointStore(url, storage_options=direct).latest()
    assert resume_point is not None

    with throttled(s3_server.port, 50e6) as proxy:
        options = {**direct, "endpoint_url": proxy.url}
        env = {**os.environ, "SPOT_SCRATCH": str(tmp_path / "scratch-2"), "PRINT_BATCHES": "1",
               "SPOT_SIGNAL_GRACE_S": f"{GRACE_S:g}"}  # fmt: skip
        second = subprocess.Popen(
            [*base, "--storage-options", json.dumps(options)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert second.stdout is not None
        for line in second.stdout:
            if line.startswith("BATCH") and f" g={resume_point.step + 4} " in line:
                break
        proxy._bucket.bytes_per_s = 300.0  # the store slows to a trickle: the upload cannot make it
        sent = time.monotonic()
        second.send_signal(signal.SIGTERM)
        _, stderr = second.communicate(timeout=GRACE_S + 60)
        took_s = time.monotonic() - sent
    assert second.returncode == 143, stderr[-3000:]
    assert took_s <= GRACE_S, (
        f"exited {took_s:.1f}s after SIGTERM, past the {GRACE_S:.0f}s deadline",
        stderr[-2500:],
    )
    after = CheckpointStore(url, storage_options=direct).latest()
    assert after is not None and after.step == resume_point.step  # nothing newer committed
    last = [line for line in stderr.splitlines() if line.strip()][-1]
    assert "did not commit in time and was abandoned" in last, stderr[-3000:]
    assert f"the resume point is step {resume_point.step}, committed in {url}" in last, stderr[-3000:]
