"""Crash consistency: kill -9 a training run that checkpoints every step, at random moments.

The short CI version of ``benchmarks/soak.py`` (same harness, ``tests/crash_harness.py``).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from helpers.crash_harness import CrashHarness
from helpers.reliability_counts import KILLS, record

KILLS_PER_BACKEND = 6  # 12 in CI over file and S3; the soak runs hundreds


def _report(backend: str, harness: CrashHarness) -> None:
    result = harness.result
    print(f"\ncrash harness ({backend}): {result.summary()}")
    assert not result.failures, "\n".join(result.failures)
    assert result.kills == KILLS_PER_BACKEND
    assert result.commits_seen >= result.kills  # the kills landed in runs that were committing
    assert result.resumes >= 1  # later runs resumed from what the killed ones committed
    assert result.completions >= 1  # and a resumed lineage trained to the end
    record(KILLS, result.kills)


@pytest.mark.slow
def test_kill_9_at_random_moments_never_breaks_latest_on_a_local_folder(tmp_path: Path) -> None:
    harness = CrashHarness(str(tmp_path / "store"), {}, tmp_path / "work", seed=7, max_epochs=40)
    harness.run(KILLS_PER_BACKEND)
    _report("file", harness)


@pytest.mark.slow
@pytest.mark.remote_store
def test_kill_9_at_random_moments_never_breaks_latest_on_s3(tmp_path: Path, s3_server) -> None:
    url = f"s3://{s3_server.bucket}/crash-{uuid.uuid4().hex[:8]}"
    harness = CrashHarness(url, dict(s3_server.storage_options), tmp_path / "work", seed=11, max_epochs=20)
    harness.run(KILLS_PER_BACKEND)
    _report("s3", harness)
