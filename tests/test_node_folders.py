"""NodeFolderPersister across two real processes, each its own node with a node-local folder (gloo).

Each process is its node's local main process (``LOCAL_RANK=0``) and has its own copy of the
framework's ``checkpoint-N`` folder: its ``rng_state_{rank}.pth`` plus one name both nodes hold
(``trainer_state.json``, as on a shared disk). One manifest must list every node's files once;
a node whose upload fails, or whose folder is missing, is named and nothing commits.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.faultfs import FaultyFileSystem

from spot_callbacks import CheckpointStore
from spot_callbacks.config import SpotConfig
from spot_callbacks.engine import SpotEngine
from spot_callbacks.persist import CheckpointPersister
from spot_callbacks.persist.folders import NodeFolderPersister
from spot_callbacks.store.retry import RetryPolicy

FAST_RETRY = RetryPolicy(attempts=2, initial_backoff_s=0.001, max_backoff_s=0.01)
WORLD_SIZE = 2
RUN_TIMEOUT_S = 240
SHARED_NAME = "trainer_state.json"
# step -> what happens to it: 5 and 8 commit (the run owns those folders), 6: node 1's uploads
# fail, 7: node 1's folder is missing.
STEPS = (5, 6, 7, 8)
OWNED_STEPS = (5, 8)


def node_folder(root: Path, rank: int, step: int) -> Path:
    return root / f"node-{rank}" / f"checkpoint-{step}"


def write_node_folder(root: Path, rank: int, step: int) -> Path:
    folder = node_folder(root, rank, step)
    folder.mkdir(parents=True)
    (folder / f"rng_state_{rank}.pth").write_bytes(bytes([rank, step]) * 512)
    (folder / SHARED_NAME).write_text(json.dumps({"written_on_node": rank, "step": step}))
    return folder


def run_node(rank: int, init_file: str, store_url: str, storage_options: dict[str, Any], root: str) -> None:
    """One node's local main process: persist every step of STEPS, write what it saw to a JSON file."""
    os.environ["LOCAL_RANK"] = "0"  # every process is its own node
    os.environ["NODE_RANK"] = str(rank)
    os.environ.pop("GROUP_RANK", None)
    root_dir = Path(root)
    dist.init_process_group("gloo", init_method=init_file, rank=rank, world_size=WORLD_SIZE)
    try:
        store = CheckpointStore(store_url, storage_options=storage_options, retry=FAST_RETRY)
        persister = NodeFolderPersister(store, keep_last=0)
        committed: dict[int, bool] = {}
        for step in STEPS:
            missing = step == 7 and rank == 1
            folder = node_folder(root_dir, rank, step) if missing else write_node_folder(root_dir, rank, step)
            if step == 6 and rank == 1:
                faulty = FaultyFileSystem(store.fs)
                faulty.permanent = True
                store.fs = faulty
            job = persister.job(
                step, "steps", "hf", folder, lists_folder=True, owns_folder=step in OWNED_STEPS
            )
            persister.submit(job)
            committed[step] = persister.wait_for_step(step, timeout=RUN_TIMEOUT_S / 2)
            if step == 6 and rank == 1:
                store.fs = faulty.inner
        result = {
            "committed": committed,
            "new_failures": [str(failure) for failure in persister.new_failures()],
            "failed_steps": [failure.step for failure in persister.failures],
            "follows_protocol": isinstance(persister, CheckpointPersister),
            "closed": persister.close(timeout=RUN_TIMEOUT_S / 2),
        }
        (root_dir / f"rank-{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_nodes(tmp_path: Path, store_url: str, storage_options: dict[str, Any]) -> list[dict[str, Any]]:
    args = ((tmp_path / "pg").as_uri(), store_url, storage_options, str(tmp_path))
    context = mp.start_processes(run_node, args=args, nprocs=WORLD_SIZE, join=False, start_method="spawn")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while not context.join(timeout=5):  # raises with the child's traceback if one failed
            assert time.monotonic() < deadline, "the node processes did not finish"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(WORLD_SIZE)]


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_every_node_uploads_its_folder_and_a_failing_node_is_named(backend, request, tmp_path):
    if backend == "s3":
        server = request.getfixturevalue("s3_server")
        store_url, options = f"s3://{server.bucket}/nodes-{uuid.uuid4().hex[:8]}/run", server.storage_options
    else:
        store_url, options = (tmp_path / "store").as_uri(), {}
    ranks = run_nodes(tmp_path, store_url, options)

    expected = {str(step): step in OWNED_STEPS for step in STEPS}
    assert [rank["committed"] for rank in ranks] == [expected, expected]  # every rank settles alike
    assert all(rank["closed"] and rank["follows_protocol"] for rank in ranks)
    assert [rank["failed_steps"] for rank in ranks] == [[6, 7], [6, 7]]
    upload_failure, missing_folder = ranks[0]["new_failures"]
    assert ranks[1]["new_failures"] == []  # one report per checkpoint: rank 0's
    assert "step 6" in upload_failure and "rank 1: PermissionError" in upload_failure
    assert "node 1, host" in upload_failure
    assert "step 7" in missing_folder and "rank 1 could not list" in missing_folder
    assert "FileNotFoundError" in missing_folder and "node 1, host" in missing_folder
    assert str(node_folder(tmp_path, 1, 7)) in missing_folder

    store = CheckpointStore(store_url, storage_options=options)
    committed = store.committed()
    assert [info.step for info in committed] == [5, 8]  # nothing of 6 or 7 commits
    for info in committed:
        # One manifest, every node's files once; the shared name from the lowest rank that lists it.
        assert sorted(info.files) == ["rng_state_0.pth", "rng_state_1.pth", SHARED_NAME]
        assert store.verify(info.step, deep=True)
    pulled = store.pull(8, tmp_path / "pulled")
    assert json.loads((pulled / SHARED_NAME).read_text()) == {"written_on_node": 0, "step": 8}
    assert (pulled / "rng_state_1.pth").read_bytes() == bytes([1, 8]) * 512

    # Owned folders: only the newest committed one stays on each node; a failed one is kept.
    for rank in range(WORLD_SIZE):
        assert not node_folder(tmp_path, rank, 5).exists() and node_folder(tmp_path, rank, 8).is_dir()
    assert (node_folder(tmp_path, 1, 6) / "rng_state_1.pth").exists()


def test_the_digests_a_writer_hands_over_are_not_hashed_again_at_upload(one_rank, tmp_path, monkeypatch):
    from spot_callbacks.store import transfer
    from spot_callbacks.store.checksums import digest_local_file

    hashed_at_upload: list[str] = []
    real = transfer.digest_mapped
    monkeypatch.setattr(
        transfer, "digest_mapped", lambda path: hashed_at_upload.append(Path(path).name) or real(path)
    )

    def write(folder: Path, group: Any) -> dict[str, Any]:
        folder.mkdir(parents=True)
        (folder / "optimizer.pt").write_bytes(bytes(range(256)) * 4096)
        (folder / SHARED_NAME).write_text("{}")
        return {"optimizer.pt": digest_local_file(folder / "optimizer.pt"), SHARED_NAME: None}

    store = CheckpointStore((tmp_path / "store").as_uri(), retry=FAST_RETRY)
    persister = NodeFolderPersister(store, keep_last=0)
    try:
        folder = tmp_path / "checkpoint-3"
        persister.submit(persister.job(3, "steps", "hf", folder, lists_folder=True, write=write))
        assert persister.wait_for_step(3, timeout=60)
    finally:
        assert persister.close(timeout=60)
    info = store.latest()
    assert info is not None and sorted(info.files) == ["optimizer.pt", SHARED_NAME]
    assert hashed_at_upload == [SHARED_NAME]  # the written one came with its digest
    assert store.verify(3, deep=True)


def test_the_every_rank_persister_is_made_ahead_and_adopts_the_copy_resumed_from(one_rank, tmp_path):
    config = SpotConfig(dirpath=str(tmp_path / "run"), interval=None, preemption=[], keep_last=0,
                        scratch_dir=str(tmp_path / "scratch"))  # fmt: skip
    engine = SpotEngine(config, "hf")
    engine.start()
    # The local copy a resume pulled, adopted before the first step.
    resumed = write_node_folder(tmp_path, 0, 2)
    engine.adopt_local_copy(resumed)

    def write(folder: Path, group: Any) -> dict[str, Any]:
        written = write_node_folder(tmp_path, 0, 3)
        assert written == folder
        return {"rng_state_0.pth": None, SHARED_NAME: None}

    try:
        assert engine.saves.persister is None
        engine.prepare_rank_files()  # at the first step boundary: the gloo groups are made here
        persister = engine.saves.persister
        assert isinstance(persister, NodeFolderPersister)
        folder = node_folder(tmp_path, 0, 3)
        assert engine.save_rank_files(3, 0, folder, "steps", write, owns_folder=True)
        assert engine.saves.persister is persister  # the first checkpoint made none
        assert engine.wait_for_commit(timeout=60)
    finally:
        engine.finish()
    assert sorted(engine.store.latest().files) == ["rng_state_0.pth", SHARED_NAME]
    assert folder.is_dir() and not resumed.exists()  # the adopted copy went once a newer one committed
