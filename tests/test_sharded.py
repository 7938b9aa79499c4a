"""Sharded (FSDP2 / DCP) checkpoints on real Lightning runs: every rank persists its shards, rank 0 commits.

The runs are gloo process groups on the CPU (ModelParallelStrategy with ``fully_shard``), the
store a moto S3 server; each resume runs on a fresh, empty scratch disk.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import fsspec
import pytest
import torch

from spot_callbacks import CheckpointStore

SCRIPT = Path(__file__).parent / "scripts" / "fsdp_run.py"
RUN_TIMEOUT_S = 300


def run_fsdp(tmp_path: Path, *args: str, scratch: str, torchrun: bool = False, env: dict | None = None):
    environ = {**os.environ, "SPOT_SCRATCH": str(tmp_path / f"scratch-{scratch}"), "PYTHONUNBUFFERED": "1"}
    environ.update(env or {})
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        if torchrun
        else [sys.executable]
    )
    return subprocess.run(
        [*launcher, str(SCRIPT), *args], env=environ, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def shard_files(info) -> list[str]:
    return sorted(name for name in info.files if name.endswith(".distcp"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    folder = tmp_path_factory.mktemp("fsdp-baseline")
    done = run_fsdp(folder, "--out", str(folder / "final.pt"), "--devices", "2", scratch="b")
    assert done.returncode == 0, done.stderr[-4000:]
    return weights(folder / "final.pt")


@pytest.mark.slow
def test_fsdp_sigterm_to_s3_then_resume_on_2_1_and_4_processes(tmp_path, s3_server, uninterrupted):
    options = s3_server.storage_options
    url = f"s3://{s3_server.bucket}/fsdp-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "interrupted.pt"
    common = ["--storage-options", json.dumps(options), "--every-n-steps", "5"]
    done = run_fsdp(
        tmp_path,
        "--dirpath",
        f"{url}/run",
        "--out",
        str(out),
        *common,
        "--sigterm-at-step",
        "12",
        scratch="i",
    )
    assert done.returncode == 143, done.stderr[-4000:]
    store = CheckpointStore(f"{url}/run", storage_options=options)
    latest = store.latest()
    assert latest is not None and latest.step == 13 and latest.reason == "preemption"
    # Every rank's shard, DCP's metadata and the non-tensor rest are in the one manifest.
    assert shard_files(latest) == ["__0_0.distcp", "__1_0.distcp"]
    assert {".metadata", "meta.pt"} <= set(latest.files)
    assert latest.extra["sharded"] == {"world_size": 2, "format": "torch.distributed.checkpoint"}
    assert store.verify(latest.step, deep=True)
    assert [info.step for info in store.committed()] == [5, 10, 13]
    with fsspec.open(f"{store.step_url(13)}/meta.pt", "rb", **options) as handle:
        meta = torch.load(io.BytesIO(handle.read()), weights_only=True)
    [spot] = [state for key, state in meta["callbacks"].items() if key.startswith("SpotCheckpoint")]
    # Every rank's RNG states, gathered onto rank 0 by the writers (off the loop), in rank order.
    assert len(spot["rng"]) == len(spot["epoch_start_rng"]) == 2
    assert all(isinstance(state["torch"], torch.Tensor) for state in spot["rng"] + spot["epoch_start_rng"])

    fs = fsspec.filesystem("s3", **options)
    results = {}
    for devices in (2, 1, 4):
        # Each resume gets its own copy of the run, pulled onto an empty scratch disk.
        fs.cp(f"{url}/run", f"{url}/resume-{devices}", recursive=True)
        final = tmp_path / f"resumed-{devices}.pt"
        done = run_fsdp(
            tmp_path, "--dirpath", f"{url}/resume-{devices}", "--out", str(final), *common,
            "--devices", str(devices), scratch=f"r{devices}",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
        assert "resuming from" in done.stderr and "(step 13, preemption)" in done.stderr, done.stderr[-3000:]
        assert "callbacks used to create the checkpoint need to be provided" not in done.stderr
        results[devices] = weights(final)
        resumed_store = CheckpointStore(f"{url}/resume-{devices}", storage_options=options)
        newest = resumed_store.latest()
        assert newest.reason == "end" and len(shard_files(newest)) == devices
        print("LOG", devices, done.stderr[-3000:])

    print(
        "DIFF",
        {
            d: max((uninterrupted[n] - results[d][n]).abs().max().item() for n in uninterrupted)
            for d in results
        },
    )
    same_world = [name for name in uninterrupted if not torch.equal(uninterrupted[name], results[2][name])]
    assert not same_world, f"2 -> 2 processes is not bit-identical: {same_world}"
    for devices in (1, 4):  # DCP resharded the state; the global batch is the same, the sums' order is not
        for name, expected in uninterrupted.items():
            torch.testing.assert_close(results[devices][name], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_rank_killed_mid_upload_never_leaves_a_committed_checkpoint_with_missing_shards(
    tmp_path, s3_server
):
    options = s3_server.storage_options
    url = f"s3://{s3_server.bucket}/fsdp-kill-{uuid.uuid4().hex[:8]}"
    done = run_fsdp(
        tmp_path, "--dirpath", url, "--out", str(tmp_path / "x.pt"), "--storage-options", json.dumps(options),
        "--every-n-steps", "5", "--devices", "2", scratch="k", torchrun=True,
        env={"SPOT_TEST_UPLOAD_FAULT": "kill:1:10"},
    )  # fmt: skip
    assert done.returncode != 0
    killed = re.search(r"FAULT: rank 1 killed uploading \S+ of step (\d+)", done.stdout)
    assert killed, done.stdout[-2000:] + done.stderr[-2000:]
    killed_step = int(killed.group(1))
    store = CheckpointStore(url, storage_options=options)
    # The checkpoint rank 1 died uploading never committed, whatever rank 0 had uploaded of it.
    fs = fsspec.filesystem("s3", **options)
    assert not fs.exists(f"{store.step_path(killed_step)}/manifest.json")
    committed = store.committed()
    assert committed and all(info.step < killed_step for info in committed)
    for info in committed:
        assert shard_files(info) == ["__0_0.distcp", "__1_0.distcp"]
        assert store.verify(info.step, deep=True)
    assert store.latest().step == committed[-1].step


@pytest.mark.slow
def test_one_rank_failing_its_upload_commits_nothing_and_names_the_rank(tmp_path):
    url = (tmp_path / "store").as_uri()
    done = run_fsdp(
        tmp_path, "--dirpath", url, "--out", str(tmp_path / "x.pt"), "--every-n-steps", "5", "--devices", "2",
        scratch="f", env={"SPOT_TEST_UPLOAD_FAULT": "fail:1:10"},
    )  # fmt: skip
    # Training ran to its end; fit() then raised the persist failure.
    assert done.returncode != 0
    assert "rank 1: PermissionError: injected: access denied" in done.stderr
    store = CheckpointStore(url)
    assert [info.step for info in store.committed()] == [5]
    assert store.verify(5, deep=True)


@pytest.mark.slow
def test_one_rank_failing_to_write_its_shards_fails_that_checkpoint_on_every_rank_and_training_goes_on(
    tmp_path,
):
    url = (tmp_path / "store").as_uri()
    done = run_fsdp(
        tmp_path, "--dirpath", url, "--out", str(tmp_path / "x.pt"), "--every-n-steps", "5", "--devices", "2",
        scratch="s", env={"SPOT_TEST_UPLOAD_FAULT": "scratch:1:10", "SPOT_STRICT": "1"},
    )  # fmt: skip
    # Every rank skipped step 10 (no rank waits in a collective the other never entered), trained
    # to the end and committed; fit() then reports the failure (strict: the newest state committed).
    assert done.returncode != 0
    assert "rank 1 could not prepare its scratch folder" in done.stderr
    assert done.stdout.count('"global_step": 16') == 0  # fit() raised after the last commit
    store = CheckpointStore(url)
    assert store.latest().step == 16 and store.latest().reason == "end"
    assert 10 not in [info.step for info in store.committed()]
    assert store.verify(16, deep=True)


@pytest.mark.slow
def test_lightning_fsdp_strategy_stages_flat_shards_writes_its_own_files_and_resumes_bit_identical(tmp_path):
    """FSDPStrategy(state_dict_type="sharded") is FSDP1: its state dicts (a collective) are taken at the
    first checkpoint only; later ones stage the flat shards, and the writers cut the strategy's chunks.
    The files of such a checkpoint are byte for byte those of the strategy's own save at that step,
    and a SIGTERM's checkpoint (flat too) resumes to the uninterrupted run's weights, bit for bit."""
    store = f"file://{tmp_path}/store"
    common = ["--fsdp1", "--every-n-steps", "3", "--keep-last", "10"]
    baseline = run_fsdp(tmp_path, "--fsdp1", "--out", str(tmp_path / "baseline.pt"), scratch="b")
    assert baseline.returncode == 0, baseline.stderr[-4000:]
    first_dir = tmp_path / "first"
    first_dir.mkdir()
    first = run_fsdp(
        tmp_path, "--dirpath", store, "--out", str(first_dir / "final.pt"), *common,
        "--own-save-at-step", "9", "--sigterm-at-step", "11", scratch="f",
    )  # fmt: skip
    assert first.returncode == 143, first.stderr[-4000:]
    reports = [json.loads(line) for line in first.stdout.splitlines() if line.startswith("{")]
    # Steps 3, 6 and 9 before the SIGTERM: the state dicts at step 3 only.
    assert [report.get("state_dict_builds_before_sigterm") for report in reports] == [1], reports
    checkpoints = CheckpointStore(store)
    assert [info.step for info in checkpoints.committed()] == [3, 6, 9, 12]
    for name in ("__0_0.distcp", "__1_0.distcp"):  # step 9: flat shards staged, cut by the writers
        with fsspec.open(f"{checkpoints.step_url(9)}/{name}", "rb") as handle:
            staged = handle.read()
        assert staged == (first_dir / "own-9" / name).read_bytes(), (
            f"{name} of step 9 differs from the strategy's"
        )
    resumed = run_fsdp(
        tmp_path, "--dirpath", store, "--out", str(tmp_path / "resumed.pt"), *common, scratch="r"
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "(step 12, preemption)" in resumed.stderr, resumed.stderr[-3000:]
    reports = [json.loads(line) for line in resumed.stdout.splitlines() if line.startswith("{")]
    assert sorted(report["state_dict_builds"] for report in reports) == [1, 1], reports  # steps 15, 16
    expected, got = weights(tmp_path / "baseline.pt"), weights(tmp_path / "resumed.pt")
    assert expected.keys() == got.keys() and expected
    differ = [name for name in expected if not torch.equal(expected[name], got[name])]
    assert not differ, f"not bit-identical after the resume: {differ}"
