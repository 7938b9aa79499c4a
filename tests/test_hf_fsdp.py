"""SpotCheckpointCallback with the HF Trainer under accelerate's FSDP2 plugin (SHARDED_STATE_DICT), 2 processes.

The Trainer writes each rank's DCP shards and the hidden ``.metadata`` index into ``checkpoint-N``;
the callback must commit all of them, and a resume from the committed checkpoint on a fresh
output_dir must continue exactly. The runs are torchrun subprocesses (tests/scripts/hf_fsdp_run.py,
which explains the one line that lets accelerate use its FSDP path on CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from spot_callbacks import CheckpointStore

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "tests" / "scripts" / "hf_fsdp_run.py"
MAX_STEPS = 20
SIGTERM_AT = 8  # the emergency checkpoint is of the step the signal lands in
STOP_STEP = SIGTERM_AT + 1
SHARD_FILES = {
    f"{folder}/{name}"
    for folder in ("pytorch_model_fsdp_0", "optimizer_0")
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp")
}


def torchrun(nproc: int, *args: Any) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    command += [str(SCRIPT), *(str(a) for a in args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)


def ranks_results(proc: subprocess.CompletedProcess, out: Path, nproc: int) -> list[dict[str, Any]]:
    paths = [Path(f"{out}".format(rank=rank) + ".json") for rank in range(nproc)]
    assert all(path.exists() for path in paths), (
        f"a rank wrote no result (exit code {proc.returncode})\n--- stdout\n{proc.stdout[-3000:]}\n"
        f"--- stderr\n{proc.stderr[-6000:]}"
    )
    results = [json.loads(path.read_text()) for path in paths]
    for result in results:  # the sharded path really ran: accelerate's FSDP2 wrapper, not DDP
        assert result["fsdp"] and result["wrapped"].startswith("FSDP"), result
    return results


def train(tmp_path: Path, name: str, nproc: int, *args: Any, expect_rc: int | None) -> list[dict[str, Any]]:
    out = tmp_path / f"{name}{{rank}}.pt"
    proc = torchrun(nproc, "--out", out, "--output-dir", tmp_path / name, *args)
    results = ranks_results(proc, out, nproc)
    if expect_rc is not None:
        assert proc.returncode == expect_rc, f"exit code {proc.returncode}\n{proc.stderr[-6000:]}"
    return results


def weights(tmp_path: Path, name: str, rank: int = 0) -> dict[str, torch.Tensor]:
    return torch.load(tmp_path / f"{name}{rank}.pt")


def preempt(tmp_path: Path, remote: tuple[str, ...], dropout: float) -> CheckpointStore:
    """A 2-process FSDP run that checkpoints every 5 steps and gets SIGTERM inside step SIGTERM_AT."""
    results = train(
        tmp_path, "machine-a", 2, *remote, "--every-n-steps", 5, "--sigterm-at-step", SIGTERM_AT,
        "--sigterm-rank", 1, "--dropout", dropout, expect_rc=None,
    )  # fmt: skip
    for result in results:
        assert (
            result["preempted"] and result["global_step"] == STOP_STEP and result["saves"] == [5, STOP_STEP]
        )
    return CheckpointStore(remote[1], storage_options=json.loads(remote[3]))


@pytest.mark.slow
def test_fsdp_shards_and_metadata_are_committed_and_a_two_process_resume_is_bit_identical(
    s3_server: Any, tmp_path: Path
) -> None:
    url = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    remote = ("--dirpath", url, "--storage-options", json.dumps(s3_server.storage_options))
    train(tmp_path, "baseline", 2, "--max-steps", MAX_STEPS, expect_rc=0)
    baseline = weights(tmp_path, "baseline")

    store = preempt(tmp_path, remote, dropout=0.1)
    info = store.latest()
    assert (info.step, info.reason, info.framework) == (STOP_STEP, "preemption", "hf")
    assert SHARD_FILES | {"rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "trainer_state.json"} <= set(
        info.files
    )
    assert not {"model.safetensors", "optimizer.pt"} & set(info.files)  # no single-file state with FSDP
    local = tmp_path / "machine-a" / f"checkpoint-{STOP_STEP}"
    written = {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(info.files) == written  # every file the Trainer wrote, hidden or not, is committed
    assert store.verify(STOP_STEP, deep=True) is True

    fresh = tmp_path / "machine-b"  # an empty output_dir, another seed
    resumed = train(tmp_path, "machine-b", 2, *remote, "--every-n-steps", 5, "--seed", 99, expect_rc=0)
    for result in resumed:
        assert result["resumed_from"] == str(fresh / f"checkpoint-{STOP_STEP}")
        assert result["global_step"] == MAX_STEPS and not result["preempted"]
    for rank in (0, 1):
        actual = weights(tmp_path, "machine-b", rank)
        assert actual.keys() == baseline.keys()
        different = [key for key in baseline if not torch.equal(actual[key], baseline[key])]
        assert not different, (
            f"rank {rank}: {len(different)} of {len(baseline)} tensors differ: {different[:3]}"
        )
    assert [c.step for c in store.committed()] == [5, STOP_STEP, 10, 15, MAX_STEPS]


@pytest.mark.slow
def test_a_two_process_fsdp_checkpoint_resumes_on_one_process(s3_server: Any, tmp_path: Path) -> None:
    # Dropout off: one process draws one RNG stream where two ranks drew two, so dropout masks
    # cannot match. What remains differs only in float summation order (one batch of 16 against two
    # of 8 whose gradients are averaged): measured 2e-5 at most on weights of magnitude ~1.
    url = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    remote = ("--dirpath", url, "--storage-options", json.dumps(s3_server.storage_options))
    train(tmp_path, "baseline", 2, "--max-steps", MAX_STEPS, "--dropout", 0, expect_rc=0)
    baseline = weights(tmp_path, "baseline")
    store = preempt(tmp_path, remote, dropout=0.0)
    assert set(store.latest().files) >= SHARD_FILES

    (resumed,) = train(
        tmp_path, "one", 1, *remote, "--batch-size", 16, "--dropout", 0, "--every-n-steps", 5, expect_rc=0
    )
    assert resumed["world_size"] == 1 and resumed["resumed_from"] == str(
        tmp_path / "one" / f"checkpoint-{STOP_STEP}"
    )
    assert resumed["global_step"] == MAX_STEPS
    actual = weights(tmp_path, "one")
    assert actual.keys() == baseline.keys()
    worst = max((actual[key] - baseline[key]).abs().max().item() for key in baseline)
    assert worst < 1e-4, f"weights differ by up to {worst} from the uninterrupted 2-process run"
    info = store.latest()
    assert info.step == MAX_STEPS and {
        "pytorch_model_fsdp_0/.metadata",
        "pytorch_model_fsdp_0/__0_0.distcp",
    } <= set(info.files)
