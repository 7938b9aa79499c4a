"""HF: TrainingArguments that ask for FSDP where accelerate does not enable it (CPU, no launcher) get a
warning before the first step that says why and what the callback checkpoints instead."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_hf import make_trainer

from spot_callbacks.hf import SpotCheckpointCallback
from spot_callbacks.hf.callback import warn_if_sharding_ignored


@pytest.fixture
def one_process_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A world of one CPU process, as ``torchrun --nproc_per_node 1`` makes it: the Trainer accepts
    ``fsdp=`` (it asks for a distributed run) and accelerate, on CPU, does not enable it."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, PartialState
    from conftest import free_port

    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        PartialState._reset_state()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_fsdp_asked_on_cpu_is_said_before_the_first_step(tmp_path: Path, caplog, one_process_group) -> None:
    import transformers

    seen_at_first_step: list[list[str]] = []

    class AtFirstStep(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 0:
                seen_at_first_step.append(
                    [r.getMessage() for r in caplog.records if r.name == "spot_callbacks"]
                )

    spot = SpotCheckpointCallback(dirpath=str(tmp_path / "run"), interval=None, preemption=[],
                                  scratch_dir=str(tmp_path / "scratch"))  # fmt: skip
    trainer = make_trainer(tmp_path / "out", [spot, AtFirstStep()], max_steps=2, fsdp="full_shard")
    assert trainer.args.fsdp and not trainer.is_fsdp_enabled  # what this machine does with the request
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        trainer.train()
    [before_first_step] = seen_at_first_step
    [line] = [message for message in before_first_step if "ask for FSDP" in message]
    assert "accelerate did not enable it (device cpu" in line  # the cause: no GPU for FSDP here
    assert "in one process, unsharded" in line and "no shards" in line and "torchrun" in line
    assert spot.store.latest() is not None and spot.store.latest().step == 2  # and it checkpointed that state


def test_nothing_is_said_when_nothing_sharded_was_asked(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path / "out", [], max_steps=1)
    assert warn_if_sharding_ignored(trainer, trainer.args) is None


@pytest.mark.parametrize("enabled", [True, False])
def test_deepspeed_asked_and_not_enabled_is_said_too(tmp_path: Path, enabled: bool) -> None:
    trainer = make_trainer(tmp_path / "out", [], max_steps=1)

    class Asked:  # DeepSpeed itself is not installed here: the arguments as a DeepSpeed run has them
        fsdp, deepspeed, device, process_index = None, "ds_config.json", "cpu", 0

    trainer.is_deepspeed_enabled = enabled
    line = warn_if_sharding_ignored(trainer, Asked())
    assert (line is None) if enabled else ("ask for DeepSpeed" in line and "device cpu" in line)
