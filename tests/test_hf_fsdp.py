"""SpotCheckpointCallback with the HF Trainer under accelerate's FSDP2 plugin (SHARDED_STATE_DICT), 2 processes.

The checkpoint is staged: at the step every rank copies its own DTensor shards into the staging
buffers, and in the background every rank writes its ``__{rank}_0.distcp`` of both DCP folders
and its RNG file, rank 0 the ``.metadata`` indexes and the rest, and uploads them; rank 0 commits.
The folder must be the Trainer's own: the same files and DCP metadata as ``SPOT_HF_SAVE=trainer``
writes, loaded unchanged by ``trainer.train(resume_from_checkpoint=...)`` on 2 processes
(bit-identical), 1 and 4 (accelerate reshards). The runs are torchrun subprocesses
(tests/scripts/hf_fsdp_run.py, which explains the one line that lets accelerate use its FSDP path
on CPU).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from spot_callbacks import CheckpointStore
from spot_callbacks.persist.dcp_safety import check_sharded_folder

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "tests" / "scripts" / "hf_fsdp_run.py"
MAX_STEPS = 20
SIGTERM_AT = 8  # the emergency checkpoint is of the step the signal lands in
STOP_STEP = SIGTERM_AT + 1
DCP_FOLDERS = ("pytorch_model_fsdp_0", "optimizer_0")
SHARD_FILES = {
    f"{folder}/{name}" for folder in DCP_FOLDERS for name in (".metadata", "__0_0.distcp", "__1_0.distcp")
}
# What Trainer._save_checkpoint writes under FSDP SHARDED_STATE_DICT (save_model writes nothing).
TRAINER_FILES = SHARD_FILES | {"rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "trainer_state.json"}
STAGED_LINE = "checkpoints are staged in RAM and written in the background (every rank writes its own shards)"


def torchrun(nproc: int, *args: Any, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    command += [str(SCRIPT), *(str(a) for a in args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, timeout=400, env=env, cwd=REPO_ROOT)


def ranks_results(proc: subprocess.CompletedProcess, out: Path, nproc: int) -> list[dict[str, Any]]:
    paths = [Path(f"{out}".format(rank=rank) + ".json") for rank in range(nproc)]
    assert all(path.exists() for path in paths), (
        f"a rank wrote no result (exit code {proc.returncode})\n--- stdout\n{proc.stdout[-3000:]}\n"
        f"--- stderr\n{proc.stderr[-6000:]}"
    )
    results = [json.loads(path.read_text()) for path in paths]
    for result in results:  # the sharded path really ran: accelerate's FSDP wrapper, not DDP
        fsdp_wrapped = result["wrapped"].startswith("FSDP") or result["wrapped"] == "FullyShardedDataParallel"
        assert result["fsdp"] and fsdp_wrapped, result
    return results


def train(
    tmp_path: Path,
    name: str,
    nproc: int,
    *args: Any,
    expect_rc: int | None,
    env: dict[str, str] | None = None,
) -> tuple[list[dict[str, Any]], str]:
    out = tmp_path / f"{name}{{rank}}.pt"
    proc = torchrun(nproc, "--out", out, "--output-dir", tmp_path / name, *args, env=env)
    results = ranks_results(proc, out, nproc)
    if expect_rc is not None:
        assert proc.returncode == expect_rc, f"exit code {proc.returncode}\n{proc.stderr[-6000:]}"
    return results, proc.stderr


def weights(tmp_path: Path, name: str, rank: int = 0) -> dict[str, torch.Tensor]:
    return torch.load(tmp_path / f"{name}{rank}.pt")


def assert_same_weights(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str
) -> None:
    assert actual.keys() == expected.keys()
    different = [key for key in expected if not torch.equal(actual[key], expected[key])]
    assert not different, f"{what}: {len(different)} of {len(expected)} tensors differ: {different[:3]}"


def dcp_index(folder: Path) -> tuple[Any, Any]:
    """What a DCP folder's .metadata says of its tensors (not where it was written: checkpoint_id)."""
    with (folder / ".metadata").open("rb") as stream:
        metadata = pickle.load(stream)  # our own file, written by this test's runs
    return metadata.state_dict_metadata, metadata.storage_data


@pytest.mark.slow
@pytest.mark.remote_store
def test_staged_fsdp_checkpoint_is_the_trainers_folder_commits_on_sigterm_and_resumes_anywhere(
    s3_server: Any, tmp_path: Path
) -> None:
    # The uninterrupted run, checkpointed through the Trainer's own save (the reference folders).
    reference = CheckpointStore(os.fspath(tmp_path / "reference-store"))
    results, log = train(
        tmp_path, "baseline", 2, "--max-steps", MAX_STEPS, "--dirpath", reference.url, "--every-n-steps", 5,
        expect_rc=0, env={"SPOT_HF_SAVE": "trainer"},
    )  # fmt: skip
    assert "the Trainer writes each checkpoint" in log and STAGED_LINE not in log
    # The folders span the ranks: their persister (its gloo groups) is made after the first step, not
    # by the first checkpoint, on every rank.
    assert [result["persister_after_first_step"] for result in results] == [True, True]
    baseline = weights(tmp_path, "baseline")

    # Staged on S3, SIGTERM to rank 1 inside step 8: the emergency checkpoint of step 9 commits.
    url = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    remote = ("--dirpath", url, "--storage-options", json.dumps(s3_server.storage_options))
    results, log = train(
        tmp_path, "machine-a", 2, *remote, "--every-n-steps", 5, "--sigterm-at-step", SIGTERM_AT,
        "--sigterm-rank", 1, expect_rc=None,
    )  # fmt: skip
    assert log.count(STAGED_LINE) == 1, log[-4000:]  # said once (by rank 0) for the node
    for result in results:
        assert result["persister_after_first_step"] is True, result  # not made by the first checkpoint
        assert result["preempted"] and result["global_step"] == STOP_STEP, result
        assert result["saves"] == [5, STOP_STEP], result  # both staged: the Trainer saved nothing
    store = CheckpointStore(url, storage_options=s3_server.storage_options)
    info = store.latest()
    assert (info.step, info.reason, info.framework) == (STOP_STEP, "preemption", "hf")
    assert info.extra["hf_save"] == "staged" and store.read_manifest(5).extra["hf_save"] == "staged"
    assert set(info.files) == TRAINER_FILES  # exactly the Trainer's files: no safetensors, no optimizer.pt
    assert set(store.read_manifest(5).files) == set(reference.read_manifest(5).files)
    assert store.verify(STOP_STEP, deep=True) is True

    # Step 5 was staged by one run and saved by the Trainer in the other, from the same state.
    staged_5, trainer_5 = store.pull(5, tmp_path / "staged-5"), reference.pull(5, tmp_path / "trainer-5")
    assert [p.name for p in check_sharded_folder(staged_5)] == sorted(DCP_FOLDERS)  # dcp_safety passes it
    for folder in DCP_FOLDERS:
        assert dcp_index(staged_5 / folder) == dcp_index(trainer_5 / folder), folder  # global tensors alike
        for shard in ("__0_0.distcp", "__1_0.distcp"):
            assert (staged_5 / folder / shard).read_bytes() == (trainer_5 / folder / shard).read_bytes()
    for name in ("scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):
        assert (staged_5 / name).read_bytes() == (trainer_5 / name).read_bytes(), name
    # The ranks' flos, gathered by the writers rather than in the loop, add up as the Trainer's save counts them.
    staged_state, trainer_state = (
        json.loads((f / "trainer_state.json").read_text()) for f in (staged_5, trainer_5)
    )
    assert staged_state["total_flos"] == trainer_state["total_flos"] > 0

    # 2 processes on a fresh output_dir, another seed: bit-identical to the uninterrupted run.
    results, _ = train(tmp_path, "machine-b", 2, *remote, "--every-n-steps", 5, "--seed", 99, expect_rc=0)
    for result in results:
        assert result["resumed_from"] == str(tmp_path / "machine-b" / f"checkpoint-{STOP_STEP}")
        assert result["global_step"] == MAX_STEPS and not result["preempted"]
    for rank in (0, 1):
        assert_same_weights(weights(tmp_path, "machine-b", rank), baseline, f"rank {rank}")
    assert [c.step for c in store.committed()] == [5, STOP_STEP, 10, 15, MAX_STEPS]
    # Step 15 is machine-b's second checkpoint, staged from the shards kept since step 10 (the state
    # dicts are not taken again): the same bytes as the Trainer's own save of the uninterrupted run.
    staged_15, trainer_15 = (
        store.pull(15, tmp_path / "staged-15"),
        reference.pull(15, tmp_path / "trainer-15"),
    )
    for folder in DCP_FOLDERS:
        for shard in ("__0_0.distcp", "__1_0.distcp"):
            assert (staged_15 / folder / shard).read_bytes() == (trainer_15 / folder / shard).read_bytes()

    # The emergency checkpoint on 1 and on 4 processes: accelerate reshards it, training ends.
    emergency = store.pull(STOP_STEP, tmp_path / f"checkpoint-{STOP_STEP}")
    at_step_9 = weights(tmp_path, "machine-a")  # where the preempted run stopped
    for nproc, batch_size in ((1, 16), (4, 4)):
        results, _ = train(
            tmp_path, f"world-{nproc}", nproc, "--resume-from", emergency, "--batch-size", batch_size,
            expect_rc=0,
        )  # fmt: skip
        assert [(r["world_size"], r["global_step"]) for r in results] == [(nproc, MAX_STEPS)] * nproc
        resumed = weights(tmp_path, f"world-{nproc}")
        assert resumed.keys() == baseline.keys()
        # Trained on from step 9 (accelerate resharded the shards): finite weights that moved from
        # where step 9 stood. Not compared with the 2-process run: other dropout streams and
        # summation orders make 11 steps differ by about as much as they move the weights.
        assert all(torch.isfinite(value).all() for value in resumed.values()), nproc
        moved = max((resumed[key] - at_step_9[key]).abs().max().item() for key in baseline)
        assert moved > 0, f"{nproc} processes: the weights did not move from step 9's"


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["fsdp1", "fsdp2-lora"])
def test_fsdp1_and_lora_checkpoints_are_staged_as_the_trainers_folder_and_resume_from_it(
    variant: str, tmp_path: Path
) -> None:
    # FSDP1's sharded state is ShardedTensor (each parameter's dim-0 chunk, cut from the gathered
    # flat parameter): staged as its local shards, rebuilt over the staged buffers for DCP. A PEFT
    # model under FSDP2: the model folder holds the active adapter's DTensor shards (adapter_only).
    if variant == "fsdp2-lora":
        pytest.importorskip("peft")
    kind = ("--fsdp-version", 1) if variant == "fsdp1" else ("--lora",)
    run = (*kind, "--max-steps", 10)
    reference = CheckpointStore(os.fspath(tmp_path / "reference-store"))
    _, log = train(
        tmp_path, "baseline", 2, *run, "--every-n-steps", 5, "--dirpath", reference.url, expect_rc=0,
        env={"SPOT_HF_SAVE": "trainer"},
    )  # fmt: skip
    assert "the Trainer writes each checkpoint" in log and STAGED_LINE not in log
    store = CheckpointStore(os.fspath(tmp_path / "store"))
    # Step 5's writers have checked FSDP1's flat-shard plan before step 10 stages through it (else step
    # 10 would take the state dicts again, as it should, and this test would not see the flat path).
    results, log = train(
        tmp_path, "staged", 2, *run, "--every-n-steps", 5, "--dirpath", store.url, "--settle-at-step", 9,
        expect_rc=0,
    )  # fmt: skip
    assert log.count(STAGED_LINE) == 1, log[-4000:]
    wrapper = "FullyShardedDataParallel" if variant == "fsdp1" else "FSDPPeftModel"
    # Their staging buffers wait for the first checkpoint; the persister does not.
    assert [result["persister_after_first_step"] for result in results] == [True, True]
    assert [result["wrapped"] for result in results] == [wrapper] * 2
    if variant == "fsdp1":  # the state dicts (a collective) at the first checkpoint only; flat shards after
        assert [(r["state_dict_builds"], r["fsdp1_flat_plan"]) for r in results] == [(1, True)] * 2
    assert [(c.step, store.read_manifest(c.step).extra["hf_save"]) for c in store.committed()] == [
        (5, "staged"), (10, "staged"),
    ]  # fmt: skip
    assert set(store.read_manifest(5).files) == set(reference.read_manifest(5).files) == TRAINER_FILES

    staged_5, trainer_5 = store.pull(5, tmp_path / "staged-5"), reference.pull(5, tmp_path / "trainer-5")
    # Step 10 too: under FSDP1 the first checkpoint takes FSDP1's state dicts, later ones stage the
    # flat shards and the writer cuts the same chunks from them (persist/fsdp1_flat.py).
    staged_10, trainer_10 = (
        store.pull(10, tmp_path / "staged-10"),
        reference.pull(10, tmp_path / "trainer-10"),
    )
    for staged, trainer in ((staged_5, trainer_5), (staged_10, trainer_10)):
        for folder in DCP_FOLDERS:
            assert dcp_index(staged / folder) == dcp_index(trainer / folder), (staged.name, folder)
            for shard in ("__0_0.distcp", "__1_0.distcp"):
                assert (staged / folder / shard).read_bytes() == (trainer / folder / shard).read_bytes(), (
                    staged.name, folder, shard,
                )  # fmt: skip
    if variant == "fsdp2-lora":  # the model folder is the adapter's: LoRA tensors only
        assert all("lora_" in key for key in dcp_index(staged_5 / "pytorch_model_fsdp_0")[0])
    for name in ("scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):
        assert (staged_5 / name).read_bytes() == (trainer_5 / name).read_bytes(), name
    # The ranks' flos, gathered by the writers rather than in the loop, add up as the Trainer's save counts them.
    staged_state, trainer_state = (
        json.loads((f / "trainer_state.json").read_text()) for f in (staged_5, trainer_5)
    )
    assert staged_state["total_flos"] == trainer_state["total_flos"] > 0

    # Staging changed nothing in training, and the Trainer alone resumes from the staged step 5 on
    # 2 processes exactly as from its own folder: with LoRA under FSDP2 bit-identically to the
    # uninterrupted run. (FSDP1's own resume on CPU is not: README, "What does not hold".)
    resumed = {}
    for name, folder in (("from-staged", staged_5), ("from-trainer", trainer_5)):
        results, _ = train(tmp_path, name, 2, *run, "--resume-from", folder, expect_rc=0)
        assert [result["global_step"] for result in results] == [10, 10]
        resumed[name] = [weights(tmp_path, name, rank) for rank in (0, 1)]
    for rank in (0, 1):
        baseline = weights(tmp_path, "baseline", rank)
        assert_same_weights(weights(tmp_path, "staged", rank), baseline, f"rank {rank}: staged run")
        assert_same_weights(resumed["from-staged"][rank], resumed["from-trainer"][rank], f"rank {rank}")
        if variant == "fsdp2-lora":
            assert_same_weights(resumed["from-staged"][rank], baseline, f"rank {rank}: resumed")


def test_full_state_dict_keeps_the_trainers_save_and_says_why() -> None:
    """FULL_STATE_DICT gathers on rank 0 at the step: the Trainer writes it, and the log says why.

    (End to end on CPU, torch 2.13's FSDP2 FULL_STATE_DICT gather over gloo aborts a rank inside the
    Trainer's own save, so the choice is tested on the plugin itself.)
    """
    from types import SimpleNamespace

    from torch.distributed.fsdp import StateDictType

    from spot_callbacks.hf.fsdp import fsdp_blocker

    def trainer_with(kind: StateDictType, version: int = 2) -> SimpleNamespace:
        plugin = SimpleNamespace(state_dict_type=kind, fsdp_version=version)
        return SimpleNamespace(accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)))

    assert fsdp_blocker(trainer_with(StateDictType.SHARDED_STATE_DICT)) is None
    full = fsdp_blocker(trainer_with(StateDictType.FULL_STATE_DICT))
    assert (
        "FULL_STATE_DICT gathers every parameter on rank 0" in full and "SHARDED_STATE_DICT is staged" in full
    )
    assert fsdp_blocker(trainer_with(StateDictType.SHARDED_STATE_DICT, version=1)) is None  # FSDP1 too
