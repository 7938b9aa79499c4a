"""SpotCheckpointCallback with the Hugging Face Trainer: emergency save, fresh-machine resume, agreement.

The end-to-end runs are subprocesses (tests/scripts/hf_run.py) because a preemption is a real
SIGTERM and the process must end the way a launcher sees it (exit code 143).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import logging
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import transformers

from spot_callbacks import CheckpointStore, ConfigError, SpotConfig
from spot_callbacks.accounting.report import RunHistory
from spot_callbacks.hf import SpotCheckpointCallback
from spot_callbacks.store.writer import CommitWriter

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "tests" / "scripts" / "hf_run.py"
EXAMPLE_YAML = REPO_ROOT / "examples" / "hf_spot.yaml"
MAX_STEPS = 40  # 256 samples / batch 8 = 32 steps per epoch: runs cross an epoch boundary
SIGTERM_AT = 13  # mid-epoch; the emergency checkpoint is taken at the end of the step it lands in
SERVER_FIXTURES = {"s3": "s3_server", "az": "azurite_server", "gs": "gcs_server"}

_spec = importlib.util.spec_from_file_location("hf_run", SCRIPT)
hf_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_run)


def run_script(*args: Any, expect_rc: int | None, torchrun: bool = False) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        *(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"] if torchrun else []),
    ]
    command += [str(SCRIPT), *(str(a) for a in args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)
    if expect_rc is not None:
        assert proc.returncode == expect_rc, (
            f"exit code {proc.returncode}, expected {expect_rc}\n--- stdout\n{proc.stdout[-4000:]}\n"
            f"--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def result_of(out: Path) -> dict[str, Any]:
    return json.loads(Path(f"{out}.json").read_text())


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    different = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert not different, f"{len(different)} of {len(expected)} tensors differ, e.g. {different[:3]}"


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_trainer(output_dir: Path, callbacks: list, max_steps: int, **overrides: Any) -> transformers.Trainer:
    """The in-process twin of hf_run.py's Trainer (same model, data, schedule)."""
    eval_dataset = overrides.pop("eval_dataset", None)
    compute_metrics = overrides.pop("compute_metrics", None)
    model = overrides.pop("model") if "model" in overrides else hf_run.build_model()
    settings = dict(
        output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=8, learning_rate=5e-3,
        lr_scheduler_type="linear", warmup_steps=3, seed=1, data_seed=7, save_strategy="no", logging_steps=5,
        report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    args = transformers.TrainingArguments(**{**settings, **overrides})
    return transformers.Trainer(
        model=model, args=args, train_dataset=hf_run.TokenData(), eval_dataset=eval_dataset,
        compute_metrics=compute_metrics, callbacks=callbacks,
    )  # fmt: skip


@pytest.fixture(scope="module")
def baseline_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """One uninterrupted run without the callback, shared by every resume test."""
    tmp = tmp_path_factory.mktemp("hf-baseline")
    run_script("--out", tmp / "w.pt", "--output-dir", tmp / "out", "--resume", "none", expect_rc=0)
    assert result_of(tmp / "w.pt")["global_step"] == MAX_STEPS
    return torch.load(tmp / "w.pt")


# ------------------------------------------------------------------------------ end to end


@pytest.mark.slow
@pytest.mark.remote_store
@pytest.mark.parametrize("backend", ["s3", "az", "gs"])
def test_sigterm_commits_then_a_fresh_machine_resumes_bit_identical(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path, baseline_weights: dict[str, torch.Tensor]
) -> None:
    server = request.getfixturevalue(SERVER_FIXTURES[backend])
    url = f"{backend}://{server.bucket}/{uuid.uuid4().hex}"
    remote = ("--dirpath", url, "--storage-options", json.dumps(server.storage_options))

    run_script(*remote, "--out", tmp_path / "first.pt", "--output-dir", tmp_path / "machine-a",
               "--sigterm-at-step", SIGTERM_AT, expect_rc=143)  # fmt: skip
    first = result_of(tmp_path / "first.pt")
    stop_step = SIGTERM_AT + 1
    assert first["preempted"] and first["global_step"] == stop_step and first["saves"] == [stop_step]
    store = CheckpointStore(url, storage_options=server.storage_options)
    info = store.latest()
    assert (info.step, info.reason, info.framework) == (stop_step, "preemption", "hf")
    trainer_files = {
        "model.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "rng_state.pth",
        "trainer_state.json",
    }
    assert trainer_files <= set(info.files)
    assert store.verify(stop_step) is True

    fresh = tmp_path / "machine-b"  # an empty output_dir, another seed: nothing local to lean on
    resumed_run = run_script(
        *remote, "--out", tmp_path / "second.pt", "--output-dir", fresh, "--seed", 99, expect_rc=0
    )
    second = result_of(tmp_path / "second.pt")
    assert second["resumed_from"] == str(fresh / f"checkpoint-{stop_step}")
    assert second["global_step"] == MAX_STEPS and not second["preempted"]
    assert "spot/resume_s" in second["log_keys"] and "spot/stall_s" in second["log_keys"]
    assert_same_weights(torch.load(tmp_path / "second.pt"), baseline_weights)
    assert [(c.step, c.reason) for c in store.committed()] == [(stop_step, "preemption"), (MAX_STEPS, "end")]
    history = RunHistory.from_checkpoints(url, store.committed())  # what `spot-callbacks report` reads
    (resume,) = history.ledger.recent_resumes
    assert history.interruptions == 1 and history.ledger.checkpoints == {"preemption": 1, "end": 1}
    assert (resume.from_step, resume.lost_work_s, resume.lost_work_measured) == (stop_step, 0.0, True)
    assert resume.pull_s > 0 and resume.downtime_s is not None and resume.downtime_s >= 0
    assert (
        "checkpoint costs of" in resumed_run.stderr and "1 (1 resumed)" in resumed_run.stderr
    )  # the summary


@pytest.mark.slow
def test_jit_checkpoint_coexists_and_resume_true_skips_uncommitted_local_folders(
    tmp_path: Path, baseline_weights: dict[str, torch.Tensor]
) -> None:
    url = (tmp_path / "store").as_uri()
    run_script("--dirpath", url, "--out", tmp_path / "first.pt", "--output-dir", tmp_path / "a",
               "--sigterm-at-step", 5, "--jit", expect_rc=143)  # fmt: skip
    first = result_of(tmp_path / "first.pt")
    # One save, ours: the Trainer's JIT handler never ran (it would have started a 3 s timer).
    assert first["saves"] == [6] and first["global_step"] == 6 and not first["jit_fired"]
    assert not (tmp_path / "a" / "checkpoint-6" / "checkpoint-is-incomplete.txt").exists()
    assert CheckpointStore(url).latest().step == 6

    fresh = tmp_path / "b"
    half_written = fresh / "checkpoint-30"  # newer than anything committed: HF alone would pick it
    half_written.mkdir(parents=True)
    (half_written / "trainer_state.json").write_text("{")
    run_script("--dirpath", url, "--resume", "true", "--out", tmp_path / "second.pt", "--output-dir", fresh,
               "--seed", 99, expect_rc=0)  # fmt: skip
    assert result_of(tmp_path / "second.pt")["resumed_from"] is True
    assert (fresh / ".spot-uncommitted-checkpoint-30" / "trainer_state.json").read_text() == "{"
    assert_same_weights(torch.load(tmp_path / "second.pt"), baseline_weights)


@pytest.mark.slow
def test_two_processes_agree_on_saves_and_stop_at_the_same_step(tmp_path: Path) -> None:
    url = (tmp_path / "store").as_uri()
    proc = run_script(
        "--dirpath", url, "--out", tmp_path / "w{rank}.pt", "--output-dir", tmp_path / "out",
        "--every-n-steps", 10, "--interval", "0.5s", "--sigterm-at-step", 25, "--sigterm-rank", 1,
        expect_rc=None, torchrun=True,
    )  # fmt: skip
    outputs = [tmp_path / f"w{rank}.pt.json" for rank in (0, 1)]
    assert all(path.exists() for path in outputs), (
        f"a rank wrote no result\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    rank0, rank1 = (json.loads(path.read_text()) for path in outputs)
    assert rank0["global_step"] == rank1["global_step"] == 26  # SIGTERM reached rank 1 only
    assert rank0["preempted"] and rank1["preempted"]
    assert rank0["saves"] == rank1["saves"] and {10, 20, 26} <= set(rank0["saves"])
    info = CheckpointStore(url).latest()
    assert (info.step, info.reason) == (26, "preemption")
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(info.files)  # every rank's files were in the folder


def run_two_nodes(logs: Path, *args: Any) -> list[subprocess.CompletedProcess]:
    """hf_run.py as two torchrun "nodes" on this machine (one process each), both run to the end."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
              "--master-addr", "127.0.0.1", "--master-port", str(port)]  # fmt: skip
    logs.mkdir(parents=True, exist_ok=True)
    nodes = []
    for node in (0, 1):  # output to files: a full pipe would block a node inside a collective
        with open(logs / f"node-{node}.out", "w") as stdout, open(logs / f"node-{node}.err", "w") as stderr:
            command = [*launch, "--node-rank", str(node), str(SCRIPT), *(str(a) for a in args)]
            nodes.append(
                subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True, env=env, cwd=REPO_ROOT)
            )
    done = []
    for node, proc in enumerate(nodes):
        proc.wait(timeout=300)
        output = (logs / f"node-{node}.out").read_text(), (logs / f"node-{node}.err").read_text()
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, *output))
    return done


def explain(procs: list[subprocess.CompletedProcess]) -> str:
    return "\n".join(
        f"--- node {node}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
        for node, proc in enumerate(procs)
    )


@pytest.mark.slow
@pytest.mark.remote_store
def test_two_nodes_with_node_local_output_dirs_commit_every_ranks_files(tmp_path: Path, s3_server) -> None:
    url = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    common = ("--dirpath", url, "--storage-options", json.dumps(s3_server.storage_options),
              "--every-n-steps", 10, "--max-steps", 20, "--record-uploads")  # fmt: skip
    procs = run_two_nodes(
        tmp_path / "logs", *common, "--out", tmp_path / "w{rank}.pt", "--output-dir", tmp_path / "node-{node}"
    )
    assert [proc.returncode for proc in procs] == [0, 0], explain(procs)
    store = CheckpointStore(url, storage_options=s3_server.storage_options)
    assert [(info.step, info.reason) for info in store.committed()] == [(10, "steps"), (20, "steps")]
    info = store.latest()
    assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors", "optimizer.pt"} <= set(info.files)
    # rng_state_1.pth exists only on node 1's disk: node 1 uploaded it, rank 0 committed it.
    node0, node1 = tmp_path / "node-0" / "checkpoint-20", tmp_path / "node-1" / "checkpoint-20"
    assert sorted(p.name for p in node1.iterdir()) == ["rng_state_1.pth"]
    assert not (node0 / "rng_state_1.pth").exists()
    assert store.verify(20, deep=True)
    rank0, rank1 = (result_of(tmp_path / f"w{rank}.pt") for rank in (0, 1))
    assert rank1["uploaded"] == ["10/rng_state_1.pth", "20/rng_state_1.pth"]
    assert sorted(rank0["uploaded"]) == sorted(
        f"{step}/{name}" for step in (10, 20) for name in store.read_manifest(step).files
        if name != "rng_state_1.pth"
    )  # fmt: skip
    # Each node keeps only its newest committed folder (save_strategy="no": the folders are ours).
    assert sorted(p.name for p in (tmp_path / "node-1").glob("checkpoint-*")) == ["checkpoint-20"]


@pytest.mark.slow
@pytest.mark.remote_store
def test_two_nodes_on_a_shared_output_dir_upload_each_file_once(tmp_path: Path, s3_server) -> None:
    url = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    procs = run_two_nodes(
        tmp_path / "logs", "--dirpath", url, "--storage-options", json.dumps(s3_server.storage_options), "--every-n-steps", 10,
        "--max-steps", 10, "--record-uploads", "--out", tmp_path / "w{rank}.pt", "--output-dir", tmp_path / "shared",
    )  # fmt: skip
    assert [proc.returncode for proc in procs] == [0, 0], explain(procs)
    store = CheckpointStore(url, storage_options=s3_server.storage_options)
    info = store.latest()
    assert info.step == 10 and {"rng_state_0.pth", "rng_state_1.pth"} <= set(info.files)
    uploads = [name for rank in (0, 1) for name in result_of(tmp_path / f"w{rank}.pt")["uploaded"]]
    assert sorted(uploads) == sorted(f"10/{name}" for name in info.files)  # each file once
    # Staged: every rank uploads just the files it wrote, even into a folder the nodes share.
    assert result_of(tmp_path / "w1.pt")["uploaded"] == ["10/rng_state_1.pth"]
    assert info.extra["hf_save"] == "staged"
    assert store.verify(10, deep=True)


@pytest.mark.slow
@pytest.mark.remote_store
def test_two_nodes_a_failed_node_commits_nothing_and_is_named(tmp_path: Path, s3_server) -> None:
    url = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    procs = run_two_nodes(
        tmp_path / "logs", "--dirpath", url, "--storage-options", json.dumps(s3_server.storage_options),
        "--every-n-steps", 10, "--max-steps", 10, "--refuse-uploads-rank", 1,
        "--out", tmp_path / "w{rank}.pt", "--output-dir", tmp_path / "node-{node}",
    )  # fmt: skip
    assert procs[0].returncode != 0 and procs[1].returncode != 0, explain(procs)
    errors = procs[0].stderr
    assert "PersistError: checkpoint of step 10 could not be persisted" in errors, explain(procs)
    assert (
        "rank 1: PermissionError: injected: access denied uploading rng_state_1.pth (node 1, host " in errors
    )
    store = CheckpointStore(url, storage_options=s3_server.storage_options)
    assert store.committed() == []  # node 0's files are up, node 1's are not: nothing commits
    assert (tmp_path / "node-1" / "checkpoint-10" / "rng_state_1.pth").exists()  # a failed folder is kept


@pytest.mark.slow
@pytest.mark.remote_store
def test_two_nodes_sigterm_then_resume_on_fresh_disks_is_bit_identical(tmp_path: Path, s3_server) -> None:
    procs = run_two_nodes(
        tmp_path / "logs-plain", "--out", tmp_path / "plain{rank}.pt", "--output-dir", tmp_path / "plain-{node}",
        "--resume", "none",
    )  # fmt: skip
    assert [proc.returncode for proc in procs] == [0, 0], explain(procs)
    url = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    remote = ("--dirpath", url, "--storage-options", json.dumps(s3_server.storage_options))
    procs = run_two_nodes(
        tmp_path / "logs-a", *remote, "--out", tmp_path / "a{rank}.pt", "--output-dir", tmp_path / "a-{node}",
        "--sigterm-at-step", SIGTERM_AT, "--sigterm-rank", 1,
    )  # fmt: skip
    assert all(result_of(tmp_path / f"a{rank}.pt")["preempted"] for rank in (0, 1)), explain(procs)
    staged = "spot_callbacks: checkpoints are staged in RAM and written in the background (every node writes"
    assert all(staged in proc.stderr for proc in procs), explain(procs)  # the two-phase path on both nodes
    store = CheckpointStore(url, storage_options=s3_server.storage_options)
    info = store.latest()
    assert (info.step, info.reason, info.extra["hf_save"]) == (SIGTERM_AT + 1, "preemption", "staged")
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(info.files) and store.verify(info.step, deep=True)
    procs = run_two_nodes(
        tmp_path / "logs-b", *remote, "--out", tmp_path / "b{rank}.pt", "--output-dir", tmp_path / "b-{node}"
    )
    assert [proc.returncode for proc in procs] == [0, 0], explain(procs)
    resumed = result_of(tmp_path / "b1.pt")
    assert resumed["resumed_from"] == str(tmp_path / "b-1" / f"checkpoint-{SIGTERM_AT + 1}")
    assert resumed["global_step"] == MAX_STEPS
    for node in (0, 1):  # every node's pulled copy of the resumed step goes once a newer one commits
        kept = sorted(path.name for path in (tmp_path / f"b-{node}").glob("checkpoint-*"))
        assert kept == [f"checkpoint-{MAX_STEPS}"], (node, kept)
    for rank in (0, 1):
        assert_same_weights(torch.load(tmp_path / f"b{rank}.pt"), torch.load(tmp_path / f"plain{rank}.pt"))


# ------------------------------------------------------------------------------ in process


def test_nothing_committed_trains_exactly_like_a_plain_run(tmp_path: Path) -> None:
    ckpt = SpotCheckpointCallback(
        dirpath=str(tmp_path / "store"), interval=None, every_n_steps=7, preemption=[]
    )
    assert ckpt.latest() is None
    trainer = make_trainer(tmp_path / "out", [ckpt], max_steps=20)
    assert ckpt.latest() is None
    trainer.train(resume_from_checkpoint=ckpt.latest())
    plain = make_trainer(tmp_path / "plain", [], max_steps=20)
    plain.train()

    assert_same_weights(weights(trainer.model), weights(plain.model))  # the callback draws no random numbers
    assert [(c.step, c.reason) for c in ckpt.store.committed()] == [(7, "steps"), (14, "steps"), (20, "end")]
    # save_strategy="no": local copies are cleaned once committed, the newest is kept
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-20"]
    assert any(
        "spot/stall_s" in entry and "spot/persist_lag_s" in entry for entry in trainer.state.log_history
    )


def test_corrupt_newest_remote_checkpoint_is_skipped_with_a_log_line(
    s3_server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url, options = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}", s3_server.storage_options
    ckpt = SpotCheckpointCallback(
        dirpath=url, storage_options=options, interval=None, every_n_steps=5, preemption=[]
    )
    make_trainer(tmp_path / "a", [ckpt], max_steps=10).train()
    assert [c.step for c in ckpt.store.committed()] == [5, 10]
    fs, root = fsspec.core.url_to_fs(url, **options, skip_instance_cache=True)
    payload = f"{root}/step-000000010/model.safetensors"
    fs.pipe_file(payload, fs.cat_file(payload)[:1000])  # truncated, as by an upload cut short

    caplog.set_level(logging.WARNING, logger="spot_callbacks")
    fresh = SpotCheckpointCallback(dirpath=url, storage_options=options, interval=None, preemption=[])
    make_trainer(tmp_path / "b", [fresh], max_steps=10)
    assert fresh.latest() == str(tmp_path / "b" / "checkpoint-5")
    assert (tmp_path / "b" / "checkpoint-5" / "model.safetensors").is_file()
    assert not (tmp_path / "b" / "checkpoint-10").exists()
    skipped = [
        r.getMessage()
        for r in caplog.records
        if "step-000000010" in r.getMessage() and r.levelno >= logging.WARNING  # not the first run's INFO
    ]
    assert skipped and "skipping damaged checkpoint" in skipped[0], [r.getMessage() for r in caplog.records]
    assert [c.step for c in fresh.store.committed()] == [5, 10]  # skipped, never deleted


def test_a_save_dropped_by_save_strategy_best_is_detected_and_persisted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="spot_callbacks")
    ckpt = SpotCheckpointCallback(
        dirpath=str(tmp_path / "store"), interval=None, every_n_steps=4, preemption=[]
    )
    trainer = make_trainer(
        tmp_path / "out", [ckpt], max_steps=10, save_strategy="best", eval_strategy="steps", eval_steps=4,
        metric_for_best_model="const", eval_dataset=hf_run.TokenData(samples=8),
        compute_metrics=lambda prediction: {"const": 1.0},  # new best at step 4 only
    )  # fmt: skip
    trainer.train()
    # Step 8 evaluates with no new best: HF replaces our should_save with False. Saved at step 9.
    assert [(c.step, c.reason) for c in ckpt.store.committed()] == [(4, "steps"), (9, "steps"), (10, "end")]
    assert any("requested at step 8" in r.getMessage() for r in caplog.records)


def test_trainer_saves_for_its_own_save_strategy_are_persisted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="spot_callbacks")
    ckpt = SpotCheckpointCallback(dirpath=str(tmp_path / "store"), interval=None, preemption=[])
    trainer = make_trainer(tmp_path / "out", [ckpt], max_steps=12, save_strategy="steps", save_steps=5)
    trainer.train()
    assert [(c.step, c.reason) for c in ckpt.store.committed()] == [(5, "steps"), (10, "steps"), (12, "end")]
    summaries = [r.getMessage() for r in caplog.records if "checkpoint costs of" in r.getMessage()]
    assert len(summaries) == 1 and "3 taken (2 steps, 1 end)" in summaries[0]  # logged once, at the end
    # The Trainer's folders are the Trainer's: nothing of save_strategy="steps" is deleted by us.
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == [
        "checkpoint-10", "checkpoint-12", "checkpoint-5"
    ]  # fmt: skip


# ------------------------------------------------------------------------------ configuration


def test_hf_argument_parser_reads_the_example_yaml() -> None:
    parser = transformers.HfArgumentParser((transformers.TrainingArguments, SpotConfig))
    training_args, spot_config = parser.parse_yaml_file(str(EXAMPLE_YAML))
    assert isinstance(spot_config, SpotConfig)
    assert spot_config.dirpath == "spot_runs/hf" and spot_config.interval_seconds == 120.0
    assert spot_config.preemption == "auto" and spot_config.storage_options is None
    assert training_args.save_strategy == "no" and training_args.max_steps == 300
    ckpt = SpotCheckpointCallback(**spot_config.to_dict())
    assert ckpt.config == spot_config


def test_arguments_are_exactly_the_spot_config_fields(tmp_path: Path) -> None:
    parameters = inspect.signature(SpotCheckpointCallback).parameters
    fields = {f.name: f for f in dataclasses.fields(SpotConfig)}
    assert list(parameters) == list(fields)
    for name, parameter in parameters.items():
        expected = fields[name].default
        assert parameter.default == (parameter.empty if expected is dataclasses.MISSING else expected), name

    config = tmp_path / "spot.yaml"
    config.write_text("dirpath: runs/exp1\ninterval: 15min\nkeep_last: 5\n")
    ckpt = SpotCheckpointCallback.from_yaml(config)
    assert ckpt.config.interval_seconds == 900 and ckpt.config.keep_last == 5
    assert ckpt.store.url.endswith("runs/exp1")
    config.write_text("dirpath: runs/exp1\nintervall: 15min\n")
    with pytest.raises(ConfigError, match="intervall.*did you mean 'interval'"):
        SpotCheckpointCallback.from_yaml(config)


def test_a_resume_with_another_batch_size_warns_once_naming_old_and_new(tmp_path: Path, caplog) -> None:
    url = str(tmp_path / "run")

    def spot() -> SpotCheckpointCallback:
        return SpotCheckpointCallback(dirpath=url, interval=None, every_n_steps=3, preemption=[],
                                      scratch_dir=str(tmp_path / "scratch"))  # fmt: skip

    make_trainer(tmp_path / "out-a", [spot()], max_steps=3).train()
    info = CheckpointStore(url).latest()
    assert info.step == 3 and info.extra["data_position"]["batch_size"] == [8]

    def resume(batch_size: int) -> list[str]:
        caplog.clear()
        ckpt = spot()
        trainer = make_trainer(tmp_path / f"out-{batch_size}", [ckpt], max_steps=4,
                               per_device_train_batch_size=batch_size)  # fmt: skip
        with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
            trainer.train(resume_from_checkpoint=ckpt.latest())
        return [r.getMessage() for r in caplog.records if "batch size" in r.getMessage()]

    assert resume(8) == []  # the same settings: nothing to say
    (warning,) = resume(4)
    assert "per-device batch size 8 -> 4" in warning and "not exact" in warning


def test_a_checkpoint_naming_our_callback_in_stateful_callbacks_never_rebuilds_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The attack: trainer_state.json asks the Trainer to rebuild our callback with another store."""
    run, attacker = tmp_path / "run", tmp_path / "attacker"
    first = SpotCheckpointCallback(dirpath=str(run), interval=None, every_n_steps=5, preemption=[])
    make_trainer(tmp_path / "a", [first], max_steps=5).train()
    store = CheckpointStore(str(run))
    hostile = store.pull(5, tmp_path / "hostile")
    state = json.loads((hostile / "trainer_state.json").read_text())
    state["stateful_callbacks"]["SpotCheckpointCallback"] = {
        "args": {"dirpath": str(attacker), "interval": None, "every_n_steps": 1, "preemption": []},
        "attributes": {"preempted": True},
    }
    (hostile / "trainer_state.json").write_text(json.dumps(state))
    CommitWriter(store).write_checkpoint(5, hostile, reason="interval", framework="hf")
    assert store.verify(5)  # committed with a valid manifest

    ckpt = SpotCheckpointCallback(dirpath=str(run), interval=None, every_n_steps=5, preemption=[])
    trainer = make_trainer(tmp_path / "b", [ckpt], max_steps=8, restore_callback_states_from_checkpoint=True)
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        trainer.train(resume_from_checkpoint=ckpt.latest())
    assert trainer.state.global_step == 8
    assert not attacker.exists()  # nothing went to the checkpoint's store
    assert ckpt in trainer.callback_handler.callbacks  # the user's object, not a rebuilt one
    assert [c for c in trainer.callback_handler.callbacks if isinstance(c, SpotCheckpointCallback)] == [ckpt]
    assert not ckpt.preempted
    assert [c.step for c in store.committed()][-1] == 8  # the end-of-training save went to the run's store
    warned = [r.getMessage() for r in caplog.records if "stateful_callbacks" in r.getMessage()]
    assert len(warned) == 1 and "SpotCheckpointCallback" in warned[0] and "ignored" in warned[0], warned


def test_the_staged_trainer_state_is_a_snapshot_of_the_log_history(tmp_path: Path) -> None:
    """The copy taken in the blocked window (plain entries copied as dicts, others deep) does not move
    when the Trainer's history changes after it, and equals what deepcopy gives."""
    import copy

    from spot_callbacks.hf._compat import trainer_state_at_save

    trainer = make_trainer(tmp_path / "out", [], max_steps=2)
    nested = {"step": 2, "per_class": [0.5, 0.25]}
    trainer.state.log_history = [{"loss": 1.5, "step": 1, "note": "x", "flag": True, "none": None}, nested]
    expected = copy.deepcopy(trainer.state.log_history)
    staged = trainer_state_at_save(trainer, flush_flos=False)
    assert staged.log_history == expected
    trainer.state.log_history[0]["loss"] = 99.0
    nested["per_class"].append(1.0)
    trainer.state.log_history.append({"loss": 0.1, "step": 3})
    assert staged.log_history == expected
    assert staged.global_step == trainer.state.global_step


def test_the_log_history_copy_reuses_earlier_entries_and_recopies_the_newest_step(tmp_path: Path) -> None:
    """Checkpoints copy only the entries logged since the last one; the newest step's row (which this
    package's metrics are merged into after the append) is copied again; a replaced history whole."""
    import copy

    from spot_callbacks.hf._compat import trainer_state_at_save

    trainer = make_trainer(tmp_path / "out", [], max_steps=2)
    trainer.state.log_history = [{"loss": 1.5, "step": 1}, {"loss": 1.2, "step": 2}]
    first = trainer_state_at_save(trainer, flush_flos=False).log_history
    trainer.state.log_history[-1]["spot/stall_s"] = 0.1  # merged into step 2's row after the copy
    trainer.state.log_history.append({"loss": 1.0, "step": 3, "extra": [1, 2]})
    second = trainer_state_at_save(trainer, flush_flos=False).log_history
    assert second == trainer.state.log_history
    assert second[0] is first[0]  # step 1's row: copied once
    assert second[1] is not first[1] and first[1] == {"loss": 1.2, "step": 2}  # step 2's: again
    assert second[2]["extra"] is not trainer.state.log_history[2]["extra"]  # deep where not plain
    trainer.state.log_history = [{"loss": 9.0, "step": 1}]  # a new history: copied whole
    third = trainer_state_at_save(trainer, flush_flos=False).log_history
    assert third == [{"loss": 9.0, "step": 1}] and third[0] is not second[0]
    del trainer.state.log_history[:]  # cut
    trainer.state.log_history.extend([{"loss": 8.0, "step": 1}, {"loss": 7.0, "step": 2}])
    expected = copy.deepcopy(trainer.state.log_history)
    assert trainer_state_at_save(trainer, flush_flos=False).log_history == expected
