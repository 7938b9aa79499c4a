"""FSDP1's flat shards, cut by the writer, are the sharded state dicts FSDP1 would have taken at that step.

torchrun runs tests/scripts/fsdp1_flat_run.py on 2 and 3 CPU ranks (gloo), with and without
``use_orig_params``: the plan is built from one checkpoint's state dicts, and at a later step the
cut of the copied flat shards (one all-to-all per flat tensor: each rank receives its chunks'
elements only) must equal FSDP1's own ``SHARDED_STATE_DICT`` model and optimizer
state dicts, bit for bit, on every rank, though training moved on before the cut ran. The plan is
used only once the writer checked it (a cut that differs on one rank fails it on all); a replaced
optimizer state makes it stale on every rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "tests" / "scripts" / "fsdp1_flat_run.py"


@pytest.mark.parametrize(("nproc", "orig_params"), [(2, 0), (2, 1), (3, 0), (3, 1)])
def test_the_cut_of_staged_flat_shards_is_fsdp1s_sharded_state_dict(
    nproc: int, orig_params: int, tmp_path: Path
) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    command += [str(SCRIPT), "--orig-params", str(orig_params), "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)
    paths = [tmp_path / f"rank{rank}.json" for rank in range(nproc)]
    assert all(path.exists() for path in paths), (
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    results = [json.loads(path.read_text()) for path in paths]
    for rank, result in enumerate(results):
        assert result["plan"], f"rank {rank}: no plan"
        # Checked at the step that built it; a replaced optimizer state makes it stale everywhere.
        assert (result["checked"], result["decision"], result["after_reload"]) == (True, "flat", "stale"), (
            result
        )
        # One rank's state dicts differing from its shards, or a parameter misplaced by one element, fail
        # the check on every rank: the state dicts are taken from then on.
        assert (result["wrong_checked"], result["wrong_decision"]) == (False, "failed"), result
        assert result["shifted_checked"] is False, result
        assert result["odd_checked"] is False, result  # one rank's state dicts shaped otherwise
        assert result["model_equal"] and result["optimizer_equal"], f"rank {rank}: {result}"
        assert result["moved"], "training did not move between the two checkpoints: the test proves nothing"
        # The checkpoint that built the plan staged FSDP1's own copies as they were (tied chunks once).
        assert result["adopted"] > 0 and result["adopted"] <= result["chunk_bytes"], result
        assert result["first_buffer_bytes"] < 64, result  # the buffer and the step counts only
        # Later ones: the flat shards in the plan's buffers, the chunks cut into the same memory.
        assert result["in_place"] and result["chunks"] > 0, result
        assert result["staging_buffer_bytes"] < 64, result
        assert (
            result["shard_bytes"] <= result["arena_bytes"] <= result["shard_bytes"] + result["chunk_bytes"]
        ), result
        # The writers exchange what each rank's chunks need, not every rank's whole flat tensors.
        assert result["received"] == result["own_chunk_elements"] > 0, result
        # Every parameter, the tied head and the buffer are in the state dict the cut reproduced.
        assert {"['head.weight']", "['embed.weight']", "['scale']"} <= {str([key]) for key in result["keys"]}
