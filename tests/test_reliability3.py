"""Reliability, round 3 (issue 21 items 4-11): what a run holds is released on every exit, a lost
lock fails the run, retention follows the lineage, damage has one verdict, the ledger sees every
interruption, and URLs that cannot be what the user meant are refused before training."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spot_callbacks import ConfigError, SpotConfig
from spot_callbacks.cli import main as cli_main

# ------------------------------------------------------------------ item 4: misread URLs


@pytest.mark.parametrize(
    ("dirpath", "fix"),
    [
        ("s3:/bucket/run", "'s3://bucket/run'"),
        ("gs:/bucket/run", "'gs://bucket/run'"),
        ("az:/container/run", "'az://container/run'"),
        ("abfs:/container/run", "'abfs://container/run'"),
        ("s3:bucket/run", "'s3://bucket/run'"),
        ("file:/tmp/run", "'file:///tmp/run'"),
    ],
)
def test_a_url_with_one_slash_after_its_scheme_is_refused_before_anything_is_written(
    dirpath: str, fix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from spot_callbacks.hf import SpotCheckpointCallback
    from spot_callbacks.lightning import SpotCheckpoint

    monkeypatch.chdir(tmp_path)  # where fsspec would have made the folder "s3:"
    for build in (SpotConfig, SpotCheckpoint, SpotCheckpointCallback):
        with pytest.raises(ConfigError) as refused:
            build(dirpath=dirpath, preemption=[])
        message = str(refused.value)
        assert f"dirpath={dirpath!r}" in message and fix in message and "local folder" in message
    assert cli_main(["ls", dirpath]) != 0
    assert list(tmp_path.iterdir()) == []  # no folder named "s3:" (or anything else)


def test_urls_that_are_fine_are_not_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for dirpath in (
        "runs/exp:1",
        "C:/runs/a",
        "./s3:/bucket",
        "s3://bucket/run",
        "memory://x/run",
        "file:///tmp/r",
    ):
        assert SpotConfig(dirpath=dirpath).dirpath == dirpath


@pytest.mark.parametrize("dirpath", ["runs/exp1", "{tmp}/run", "file://{tmp}/run"])
def test_storage_options_for_a_local_path_are_refused_naming_the_fix(dirpath: str, tmp_path: Path) -> None:
    dirpath = dirpath.format(tmp=tmp_path)
    with pytest.raises(ConfigError) as refused:
        SpotConfig(dirpath=dirpath, storage_options={"key": "AKIA-hunter2", "endpoint_url": "http://x"})
    message = str(refused.value)
    assert "local folder" in message and "s3://bucket/run" in message and "drop storage_options" in message
    assert "endpoint_url" in message and "hunter2" not in message  # names the keys, never a value
    assert SpotConfig(dirpath=dirpath, storage_options={}).storage_options == {}
    assert not os.path.exists(tmp_path / "run")
