"""Sharded (DCP) checkpoints whose pickles would run code: nothing runs, the resume falls back.

The attacker can write the bucket, so they also recompute the manifest: each attack here is
re-committed through the store's own ``write_checkpoint`` (sizes and xxh3 checksums match, ``verify``
passes). Two attacks, each a command (``touch <marker>``) that then hands the loader the genuine
value, so nothing looks wrong to it:

- ``.metadata``: a pickle that runs the command, then unpickles into the checkpoint's own
  ``Metadata`` (DCP's ``FileSystemReader.read_metadata`` is ``pickle.load``);
- a byte item (a non-tensor value, here an optimizer's ``lr``) pointed at a ``torch.save`` pickle
  that runs the command, then evaluates to the genuine ``lr`` (DCP's ``DefaultLoadPlanner`` loads
  byte items with ``weights_only=False``).

Resumed through ``load_sharded_state``, the resume path itself, Lightning's ``ModelParallelStrategy``
and the Trainer's FSDP path (subprocesses: tests/scripts/fsdp_run.py, hf_fsdp_run.py).
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import operator
import os
import pickle
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.reliability_counts import DAMAGED, record
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from spot_callbacks import CheckpointStore, CorruptCheckpointError, UnsafeCheckpointError, load_sharded_state
from spot_callbacks.persist.dcp_safety import (
    MetadataUnpickler,
    SafeFileSystemReader,
    SafeLoadPlanner,
    check_dcp_folder,
    check_sharded_folder,
    read_metadata,
)
from spot_callbacks.resume import pull_newest_valid
from spot_callbacks.store import step_dirname
from spot_callbacks.store.writer import CommitWriter

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = REPO_ROOT / "tests" / "scripts"
RUN_TIMEOUT_S = 300

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


# ------------------------------------------------------------------------ the attack
def _matches(pattern: str, text: str) -> bool:
    return re.search(pattern, text) is not None


class _Command:
    """Unpickled by a full unpickler: runs ``command`` in a shell (and evaluates to its exit status)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (self.command,))


class _RunsThenReturns:
    """Unpickled: runs ``command``, then evaluates to ``value`` (``itemgetter(1)((status, value))``)."""

    def __init__(self, command: str, value: Any) -> None:
        self.command, self.value = command, value

    def __reduce__(self):  # noqa: ANN204
        return (operator.itemgetter(1), ((_Command(self.command), self.value),))


def touch(marker: Path) -> str:
    return f"touch {shlex.quote(str(marker))}"


def plant_hostile_metadata(dcp_folder: Path, marker: Path) -> None:
    """``.metadata`` becomes a pickle that runs ``touch marker``, then unpickles into the genuine Metadata."""
    index_file = dcp_folder / ".metadata"
    genuine = pickle.loads(index_file.read_bytes())  # the test's own checkpoint: DCP's bytes
    index_file.write_bytes(pickle.dumps(_RunsThenReturns(touch(marker), genuine)))


def plant_hostile_byte_item(dcp_folder: Path, marker: Path) -> str:
    """Point the first ``...lr`` byte item at a ``torch.save`` pickle that runs ``touch marker``, then
    evaluates to the genuine lr (appended to the shard file; ``.metadata`` stays DCP's own classes)."""
    index_file = dcp_folder / ".metadata"
    metadata = pickle.loads(index_file.read_bytes())
    fqn = next(
        name
        for name, kind in metadata.state_dict_metadata.items()
        if isinstance(kind, BytesStorageMetadata) and name.endswith(".lr")
    )
    entry = metadata.storage_data[MetadataIndex(fqn)]
    shard = dcp_folder / entry.relative_path
    with shard.open("rb") as stream:
        stream.seek(entry.offset)
        genuine = torch.load(io.BytesIO(stream.read(entry.length)), weights_only=True)
    payload = io.BytesIO()
    torch.save(_RunsThenReturns(touch(marker), genuine), payload)
    offset = shard.stat().st_size
    with shard.open("ab") as stream:
        stream.write(payload.getvalue())
    metadata.storage_data[MetadataIndex(fqn)] = dataclasses.replace(
        entry, offset=offset, length=len(payload.getvalue())
    )
    index_file.write_bytes(pickle.dumps(metadata))
    return fqn


def recommit(store: CheckpointStore, step: int, work: Path, tamper: Callable[[Path], Any]) -> None:
    """Pull ``step``, ``tamper`` with the local copy, commit it again as ``step`` with a valid manifest."""
    info = store.read_manifest(step)
    local = store.pull(step, work / f"forged-{step_dirname(step)}")
    tamper(local)
    CommitWriter(store).write_checkpoint(
        step, local, reason=info.reason, framework=info.framework, epoch=info.epoch, extra=info.extra
    )
    assert store.verify(step, deep=True) is True  # every size and xxh3 checksum matches


ATTACKS = {
    "metadata": (plant_hostile_metadata, r"\.metadata: the pickle names 'operator\.itemgetter'"),
    "byte item": (
        plant_hostile_byte_item,
        r"__0_0\.distcp: byte item 'optimizer\.param_groups\.0\.lr' holds objects that weights_only "
        r"loading refuses.*GLOBAL operator\.itemgetter was not an allowed global",
    ),
}


# --------------------------------------------------------------- in-process checkpoints
def state_of(step: int) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((4,), float(step)), "b": torch.arange(3, dtype=torch.bfloat16)},
        "optimizer": {
            "param_groups": [{"lr": 0.001 * step, "betas": (0.9, 0.99), "params": [0]}],
            "state": {0: {"step": torch.tensor(float(step))}},
        },
    }


def blank_state() -> dict[str, Any]:
    state = state_of(0)
    state["optimizer"]["param_groups"][0]["lr"] = -1.0
    return state


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    """Three committed DCP checkpoints (steps 5, 10, 15) in a local store."""
    store = CheckpointStore(str(tmp_path / "run"))
    for step in (5, 10, 15):
        written = tmp_path / "written" / step_dirname(step)
        dcp.save(state_of(step), checkpoint_id=written, no_dist=True)
        CommitWriter(store).write_checkpoint(step, written, reason="steps", framework="demo")
    return store


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_the_attack_runs_its_command_through_dcps_own_reader(store, tmp_path, attack):
    # The control: DCP's own FileSystemReader and DefaultLoadPlanner run the planted command.
    marker = tmp_path / "ran"
    plant, _ = ATTACKS[attack]
    recommit(store, 15, tmp_path, lambda folder: plant(folder, marker))
    pulled = store.pull(15, tmp_path / "pulled")
    state = blank_state()
    dcp.load(state, checkpoint_id=pulled, no_dist=True)
    assert marker.exists()
    assert state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.015)  # the loader saw nothing wrong


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_load_sharded_state_refuses_a_hostile_checkpoint_and_runs_nothing(store, tmp_path, attack):
    marker = tmp_path / "ran"
    plant, expected = ATTACKS[attack]
    recommit(store, 15, tmp_path, lambda folder: plant(folder, marker))
    pulled = store.pull(15, tmp_path / "pulled")
    state = blank_state()
    with pytest.raises(CorruptCheckpointError, match=expected) as failure:
        load_sharded_state(pulled, state)
    assert "nothing of it was run" in str(failure.value)
    assert not marker.exists()
    assert state["optimizer"]["param_groups"][0]["lr"] == -1.0 and torch.equal(
        state["model"]["w"], torch.zeros(4)
    )
    record(DAMAGED)


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_the_safe_reader_and_planner_refuse_on_their_own(store, tmp_path, attack):
    # Without the folder check in front: what DCP hands them is refused as it is read.
    marker = tmp_path / "ran"
    plant, _ = ATTACKS[attack]
    recommit(store, 15, tmp_path, lambda folder: plant(folder, marker))
    pulled = store.pull(15, tmp_path / "pulled")
    # DCP reports a rank's failure as a CheckpointException (a BaseException) carrying its message.
    refused = "which DCP never writes" if attack == "metadata" else "weights_only loading refuses"
    with pytest.raises(BaseException, match=f"operator.itemgetter.*{refused}|{refused}.*operator.itemgetter"):
        dcp.load(
            blank_state(),
            storage_reader=SafeFileSystemReader(pulled),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
    assert not marker.exists()


def test_the_resume_skips_hostile_checkpoints_for_the_previous_one_and_deletes_nothing(
    store, tmp_path, caplog
):
    markers = {attack: tmp_path / f"ran-{attack.replace(' ', '-')}" for attack in ATTACKS}
    recommit(store, 15, tmp_path, lambda folder: plant_hostile_metadata(folder, markers["metadata"]))
    recommit(store, 10, tmp_path, lambda folder: plant_hostile_byte_item(folder, markers["byte item"]))
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        resumed = pull_newest_valid(store, lambda step: tmp_path / "scratch" / step_dirname(step))
    assert resumed is not None and resumed.step == 5
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    for step, attack in ((15, "metadata"), (10, "byte item")):
        lines = [w for w in warnings if f"{step_dirname(step)}:" in w]
        assert len(lines) == 1 and "skipping damaged checkpoint" in lines[0], warnings
        assert _matches(ATTACKS[attack][1], lines[0]), lines[0]
    assert not any(marker.exists() for marker in markers.values())
    assert [info.step for info in store.committed()] == [5, 10, 15]  # damaged, never deleted
    state = blank_state()
    load_sharded_state(tmp_path / "scratch" / step_dirname(5), state)
    assert state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.005)
    record(DAMAGED, 2)


# ------------------------------------------------------------------ the allowlists
@pytest.mark.parametrize("where", ["planner_data", "storage_meta.checkpoint_id", "a tensor's dtype"])
def test_a_hostile_object_anywhere_inside_genuine_metadata_is_refused(store, tmp_path, where):
    marker = tmp_path / "ran"
    pulled = store.pull(15, tmp_path / "pulled")
    metadata = pickle.loads((pulled / ".metadata").read_bytes())
    if where == "planner_data":
        metadata.planner_data["model.w"] = _Command(touch(marker))
    elif where == "storage_meta.checkpoint_id":
        metadata.storage_meta.checkpoint_id = _Command(touch(marker))
    else:
        metadata.state_dict_metadata["model.w"].properties.dtype = _Command(touch(marker))
    (pulled / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match="'posix.system', which DCP never writes"):
        read_metadata(io.BytesIO((pulled / ".metadata").read_bytes()))
    with pytest.raises(CorruptCheckpointError, match="nothing of it was run"):
        check_sharded_folder(pulled)
    assert not marker.exists()


def test_the_metadata_unpickler_refuses_a_name_before_importing_its_module():
    assert "this" not in sys.modules
    global_opcode = b"\x80\x04cthis\nzen\n."  # GLOBAL this.zen: importing `this` prints the Zen of Python
    with pytest.raises(UnsafeCheckpointError, match="'this.zen'"):
        MetadataUnpickler(io.BytesIO(global_opcode)).load()
    assert "this" not in sys.modules


def test_genuine_checkpoints_of_many_dtypes_pass_and_load_exactly(tmp_path):
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
              torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]  # fmt: skip
    saved = {
        "tensors": {str(dtype): (torch.arange(6) % 2).to(dtype).reshape(2, 3) for dtype in dtypes},
        "values": {"epoch": 3, "name": "run", "betas": (0.9, 0.99), "flags": [True, None], "lr": 1e-3},
        "tail": {"channels_last": torch.ones(1, 2, 2, 2).to(memory_format=torch.channels_last)},
    }
    folder = tmp_path / "genuine"
    dcp.save(saved, checkpoint_id=folder, no_dist=True)
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    byte_items = [k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
    assert check_dcp_folder(folder) == len(byte_items) > 0  # every non-tensor value was read, loaded safely
    state = {
        "tensors": {name: torch.zeros_like(value) for name, value in saved["tensors"].items()},
        "values": {name: None for name in saved["values"]},
        "tail": {"channels_last": torch.zeros(1, 2, 2, 2)},
    }
    load_sharded_state(folder, state)
    for name, value in saved["tensors"].items():
        assert torch.equal(state["tensors"][name], value) and state["tensors"][name].dtype == value.dtype
    assert state["values"] == {
        "epoch": 3,
        "name": "run",
        "betas": (0.9, 0.99),
        "flags": [True, None],
        "lr": 1e-3,
    }


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            {"relative_path": "../escape.distcp"},
            r"is stored in '\.\./escape\.distcp', not a file of its folder",
        ),
        ({"relative_path": "__0_0.distcp\x1b[2J"}, r"not a file of its folder"),
        ({"offset": 10**9}, r"lies at bytes 1000000000-\d+ of __0_0\.distcp, which holds \d+"),
        ({"length": -1}, r"has offset \d+ and length -1"),
        ({"transform_descriptors": ["stream.evil/1"]}, r"cannot be loaded: ValueError: Unknown extension"),
        ({"transform_descriptors": 7}, r"has transform descriptors 7"),
    ],
)
def test_a_byte_items_storage_entry_that_dcp_would_misread_is_damage(store, tmp_path, change, expected):
    pulled = store.pull(15, tmp_path / "pulled")
    metadata = pickle.loads((pulled / ".metadata").read_bytes())
    index = MetadataIndex("optimizer.param_groups.0.lr")
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], **change)
    (pulled / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CorruptCheckpointError, match=expected) as failure:
        check_sharded_folder(pulled)
    assert "\x1b" not in str(failure.value)  # what the file names is escaped before it reaches a log line


def test_a_byte_item_that_is_not_a_torch_save_payload_is_damage(store, tmp_path):
    pulled = store.pull(15, tmp_path / "pulled")
    metadata = pickle.loads((pulled / ".metadata").read_bytes())
    index = MetadataIndex("optimizer.param_groups.0.lr")
    entry = metadata.storage_data[index]
    offset = (pulled / entry.relative_path).stat().st_size
    with (pulled / entry.relative_path).open("ab") as shard:
        shard.write(b"not a torch.save archive")
    metadata.storage_data[index] = dataclasses.replace(entry, offset=offset, length=24)
    (pulled / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(
        CorruptCheckpointError, match=r"__0_0\.distcp: byte item 'optimizer\.param_groups\.0\.lr'"
    ):
        check_sharded_folder(pulled)


def test_a_metadata_file_that_is_not_dcps_is_damage(tmp_path):
    folder = tmp_path / "ckpt" / "optimizer_0"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}})[:-3])
    with pytest.raises(
        CorruptCheckpointError, match=r"^optimizer_0/\.metadata cannot be read: UnpicklingError"
    ):
        check_sharded_folder(tmp_path / "ckpt")
    (folder / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(
        CorruptCheckpointError, match=r"optimizer_0/\.metadata is not DCP metadata: it holds a dict"
    ):
        check_sharded_folder(tmp_path / "ckpt")


# --------------------------------------------------------- through the frameworks
def run_script(*args: Any, scratch: Path, timeout: int = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPOT_SCRATCH": str(scratch), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *(str(arg) for arg in args)],
        env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT,
    )  # fmt: skip


def damaged_lines(stderr: str) -> dict[int, str]:
    """The "skipping damaged checkpoint" lines of a run, by the step they name."""
    found = {}
    for line in stderr.splitlines():
        named = re.search(r"skipping damaged checkpoint \S*step-(\d+)", line)
        if named:
            found[int(named.group(1))] = line
    return found


@pytest.mark.slow
def test_a_lightning_sharded_resume_runs_no_planted_command_and_falls_back(tmp_path):
    store_dir = tmp_path / "run"
    common = ["--dirpath", store_dir, "--devices", "1", "--keep-last", "0"]
    first = run_script(
        SCRIPTS / "fsdp_run.py", *common, "--out", tmp_path / "a.pt", "--max-epochs", 1,
        "--every-n-steps", 3, scratch=tmp_path / "scratch-a",
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-4000:]
    store = CheckpointStore(str(store_dir))
    assert [info.step for info in store.committed()] == [3, 6, 8]
    markers = {attack: tmp_path / f"ran-{attack.replace(' ', '-')}" for attack in ATTACKS}
    recommit(store, 8, tmp_path, lambda folder: plant_hostile_byte_item(folder, markers["byte item"]))
    recommit(store, 6, tmp_path, lambda folder: plant_hostile_metadata(folder, markers["metadata"]))

    resumed = run_script(
        SCRIPTS / "fsdp_run.py", *common, "--out", tmp_path / "b.pt", "--max-epochs", 2,
        scratch=tmp_path / "scratch-b",
    )  # fmt: skip
    assert not [attack for attack, marker in markers.items() if marker.exists()]
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    damaged = damaged_lines(resumed.stderr)
    assert sorted(damaged) == [6, 8], resumed.stderr[-4000:]
    assert _matches(ATTACKS["byte item"][1].replace("optimizer", "optimizer_0"), damaged[8]), damaged[8]
    assert _matches(ATTACKS["metadata"][1], damaged[6]), damaged[6]
    assert "(step 3, steps)" in resumed.stderr and '"global_step": 16' in resumed.stdout
    assert [info.step for info in store.committed()] == [3, 6, 8, 16]  # the damaged ones are kept
    record(DAMAGED, 2)


@pytest.mark.slow
def test_an_hf_fsdp_resume_runs_no_planted_command_and_falls_back(tmp_path):
    store_dir = tmp_path / "run"
    torchrun = [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "1",
        SCRIPTS / "hf_fsdp_run.py",
    ]

    def train(name: str, *args: Any) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
        out = tmp_path / f"{name}.pt"
        done = run_script(
            *torchrun, "--dirpath", store_dir, "--out", out, "--output-dir", tmp_path / name, *args,
            scratch=tmp_path / f"scratch-{name}",
        )  # fmt: skip
        result = Path(f"{out}.json")
        assert done.returncode == 0 and result.exists(), done.stderr[-6000:]
        return done, json.loads(result.read_text())

    _, first = train("machine-a", "--max-steps", 15, "--every-n-steps", 5)
    assert first["fsdp"] and first["saves"] == [5, 10, 15]
    store = CheckpointStore(str(store_dir))
    assert [info.step for info in store.committed()] == [5, 10, 15]
    markers = {attack: tmp_path / f"ran-{attack.replace(' ', '-')}" for attack in ATTACKS}
    recommit(
        store,
        15,
        tmp_path,
        lambda ckpt: plant_hostile_metadata(ckpt / "pytorch_model_fsdp_0", markers["metadata"]),
    )
    recommit(
        store, 10, tmp_path, lambda ckpt: plant_hostile_byte_item(ckpt / "optimizer_0", markers["byte item"])
    )

    resumed, result = train("machine-b", "--max-steps", 17)
    assert not [attack for attack, marker in markers.items() if marker.exists()]
    assert result["resumed_from"] == str(tmp_path / "machine-b" / "checkpoint-5")
    assert result["global_step"] == 17
    damaged = damaged_lines(resumed.stderr)
    assert sorted(damaged) == [10, 15], resumed.stderr[-4000:]
    assert _matches(r"pytorch_model_fsdp_0/" + ATTACKS["metadata"][1], damaged[15]), damaged[15]
    assert _matches(r"optimizer_0/" + ATTACKS["byte item"][1], damaged[10]), damaged[10]
    assert [info.step for info in store.committed()] == [5, 10, 15, 17]
    record(DAMAGED, 2)
