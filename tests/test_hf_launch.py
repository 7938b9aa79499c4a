"""examples/hf_spot.py in several processes, started by the launchers README shows, on CPU.

Two processes really train one run: the committed checkpoint holds the Trainer's
``rng_state_0.pth`` and ``rng_state_1.pth`` (one per process; a single process writes
``rng_state.pth``). A SIGTERM to the launcher (what a spot reclaim sends) commits an emergency
checkpoint, and the same command run again resumes from it to ``--max-steps``. The naive
``accelerate launch --cpu --num_processes 2`` starts one process: the example must say so.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_examples import sigterm_after_first_commit

from spot_callbacks import CheckpointStore

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "hf_spot.py"
MAX_STEPS = 120  # 64 steps per epoch with 2 processes: the resume crosses an epoch boundary
EVERY_N_STEPS = 10
RUN_TIMEOUT_S = 120
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
# Everything on the command line: no `accelerate config` file is read (HF_HOME is the test's own).
ACCELERATE_MULTI = [*ACCELERATE, "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                    "--mixed_precision", "no", "--dynamo_backend", "no",
                    "--main_process_port", "0"]  # fmt: skip
SINGLE_PROCESS_WARNING = (
    "spot_callbacks: accelerate launch was asked for several processes but started only this one"
)
LAUNCHER_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PMI_SIZE")


def launch_env(tmp_path: Path) -> dict[str, str]:
    """CPU processes on any machine, one thread each (the CI box is shared), no user accelerate config."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("ACCELERATE_", "TORCHELASTIC_", "OMPI_")) and name not in LAUNCHER_VARIABLES
    }
    return {**env, "HF_HOME": str(tmp_path / "hf-home"), "SPOT_SCRATCH": str(tmp_path / "scratch"),
            "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip


def example_args(tmp_path: Path, max_steps: int = MAX_STEPS) -> list[str]:
    return [str(EXAMPLE), "--dirpath", str(tmp_path / "run"), "--output-dir", str(tmp_path / "output"),
            "--max-steps", str(max_steps), "--every-n-steps", str(EVERY_N_STEPS)]  # fmt: skip


def assert_two_processes_train_and_the_same_command_resumes(command: list[str], tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "run"))
    launcher, _, printed = sigterm_after_first_commit(
        command, store, launch_env(tmp_path), tmp_path / "first.log"
    )
    # Each worker exits 143; the launcher reports a failed worker (torchrun's exit 1), not 143.
    assert launcher.returncode != 0, f"finished before the SIGTERM landed:\n{printed[-4000:]}"
    emergency = store.latest()
    assert emergency.reason == "preemption" and emergency.step < MAX_STEPS, printed[-4000:]
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(emergency.files), emergency.files

    second = subprocess.run(
        command, capture_output=True, text=True, env=launch_env(tmp_path), timeout=RUN_TIMEOUT_S
    )
    printed = second.stdout + second.stderr
    assert second.returncode == 0, printed[-4000:]
    assert f"resuming from {emergency.url} (step {emergency.step}, preemption)" in printed, printed[-4000:]
    assert f"finished at step {MAX_STEPS} (2 processes)" in second.stdout, printed[-4000:]
    end = store.latest()
    assert end.step == MAX_STEPS and {"rng_state_0.pth", "rng_state_1.pth"} <= set(end.files), end.files


@pytest.mark.slow
def test_torchrun_two_cpu_processes_train_one_run_and_the_same_command_resumes(tmp_path: Path) -> None:
    assert_two_processes_train_and_the_same_command_resumes([*TORCHRUN, *example_args(tmp_path)], tmp_path)


@pytest.mark.slow
def test_accelerate_multi_gpu_two_cpu_processes_train_one_run_and_the_same_command_resumes(
    tmp_path: Path,
) -> None:
    # --multi_gpu is accelerate's torchrun launcher whatever the device: without a GPU, CPU processes.
    assert_two_processes_train_and_the_same_command_resumes(
        [*ACCELERATE_MULTI, *example_args(tmp_path)], tmp_path
    )


@pytest.mark.slow
def test_accelerate_cpu_with_two_processes_runs_two_or_says_it_runs_one(tmp_path: Path) -> None:
    # accelerate's --cpu launcher starts one process and leaves the others to mpirun.
    command = [*ACCELERATE, "--cpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", *example_args(tmp_path, max_steps=EVERY_N_STEPS)]  # fmt: skip
    proc = subprocess.run(
        command, capture_output=True, text=True, env=launch_env(tmp_path), timeout=RUN_TIMEOUT_S
    )
    printed = proc.stdout + proc.stderr
    assert proc.returncode == 0, printed[-4000:]
    files = set(CheckpointStore(str(tmp_path / "run")).latest().files)
    if {"rng_state_0.pth", "rng_state_1.pth"} <= files:
        assert f"finished at step {EVERY_N_STEPS} (2 processes)" in proc.stdout
    else:
        assert "rng_state.pth" in files and f"finished at step {EVERY_N_STEPS} (1 process)" in proc.stdout
        warnings = [line for line in proc.stderr.splitlines() if SINGLE_PROCESS_WARNING in line]
        assert len(warnings) == 1, printed[-4000:]  # one line, naming both commands that do run two
        assert "accelerate launch --multi_gpu --num_processes N" in warnings[0], warnings[0]
        assert "torchrun --standalone --nproc_per_node N" in warnings[0], warnings[0]


@pytest.mark.slow
def test_a_trainer_that_trains_alone_in_a_process_group_of_two_is_refused_before_its_first_step(
    tmp_path: Path,
) -> None:
    # use_cpu: false on a machine without a GPU: each torchrun worker would train its own copy.
    settings = yaml.safe_load((EXAMPLE.parent / "hf_spot.yaml").read_text())
    settings.update(
        use_cpu=False, dirpath=str(tmp_path / "run"), output_dir=str(tmp_path / "output"), max_steps=4
    )
    config = tmp_path / "hf_spot.yaml"
    config.write_text(yaml.safe_dump(settings))
    proc = subprocess.run(
        [*TORCHRUN, str(EXAMPLE), "--config", str(config)],
        capture_output=True, text=True, env=launch_env(tmp_path), timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    printed = proc.stdout + proc.stderr
    assert proc.returncode != 0, printed[-4000:]
    # The example prints the error's one line (no traceback without -v): the cause and the fix.
    assert "error: the process group has 2 processes but the Trainer trains as one" in printed, printed[
        -4000:
    ]
    assert "pass TrainingArguments(use_cpu=True)" in printed
    assert CheckpointStore(str(tmp_path / "run")).latest() is None
    assert not list((tmp_path / "output").glob("checkpoint-*"))
