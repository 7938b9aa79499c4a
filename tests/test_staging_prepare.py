"""Staging buffers allocated off the loop: StagingArea.prepare, and the trainers that call it after the first step."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import transformers
from lightning.pytorch.demos.boring_classes import BoringModel

from spot_callbacks import staging
from spot_callbacks.hf import SpotCheckpointCallback
from spot_callbacks.lightning import SpotCheckpoint
from spot_callbacks.persist import host_buffers
from spot_callbacks.staging import StagingArea, load_state, write_state


def training_state() -> dict[str, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "rng": torch.get_rng_state()}


def tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, dict):
        return [leaf for value in state.values() for leaf in tensors(value)]
    if isinstance(state, (list, tuple)):
        return [leaf for value in state for leaf in tensors(value)]
    return [state] if isinstance(state, torch.Tensor) else []


def assert_same(actual: Any, expected: Any) -> None:
    got, want = tensors(actual), tensors(expected)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_first_stage_copies_into_the_prepared_buffers_and_the_state_file_is_exact(tmp_path: Path) -> None:
    state = training_state()
    area = StagingArea()
    assert area.prepare(state)
    assert area.wait_prepared(timeout=60)
    prepared = area.buffer_bytes
    staged = area.stage(state)
    copies = sum(1 for tensor in tensors(state) if tensor.numel())
    assert area.prepared_buffers_used == copies  # the stage allocated no buffer of its own
    assert area.buffer_bytes == prepared == staged.nbytes
    write_state(staged, tmp_path / "state.pt")
    staged.release()
    assert_same(load_state(tmp_path / "state.pt"), state)
    assert not area.prepare(state)  # planned now: a later call does nothing


def test_prepare_reads_shapes_only_and_allocates_each_tied_tensor_once() -> None:
    weight = torch.empty(64, 32, device="meta")  # no data: a read of it would fail
    area = StagingArea()
    area.prepare({"encoder": weight, "decoder": weight, "bias": torch.empty(32, device="meta"), "step": 3})
    assert area.wait_prepared(timeout=60)
    assert area.buffer_bytes == (64 * 32 + 32) * 4  # the tie is one buffer, as the stage makes it
    live = torch.randn(64, 32)
    staged = area.stage({"encoder": live, "decoder": live, "bias": torch.randn(32), "step": 3})
    assert staged.state["encoder"] is staged.state["decoder"] and torch.equal(staged.state["encoder"], live)
    assert area.prepared_buffers_used == 2
    staged.release()


def test_a_stage_during_the_allocation_stops_it_and_allocates_the_rest_itself(monkeypatch) -> None:
    state = training_state()
    area = StagingArea()
    in_first_buffer = threading.Event()
    faulted: list[int] = []

    def fault_in_until_cancelled(buffer: torch.Tensor, cancel: threading.Event) -> None:
        # cancel: set by the stage below, while this thread is on its first buffer
        faulted.append(buffer.numel())
        in_first_buffer.set()
        assert cancel.wait(timeout=60)

    monkeypatch.setattr(staging, "fault_in", fault_in_until_cancelled)
    area.prepare(state)
    assert in_first_buffer.wait(timeout=60)
    staged = area.stage(state)  # stops the thread after the buffer in hand; it allocates the others
    assert len(faulted) == 1 and area.prepared_buffers_used == 1
    assert_same(staged.state, state)
    assert staged.nbytes == area.buffer_bytes == sum(t.numel() * t.element_size() for t in tensors(state))
    staged.release()


class WaitForStagingBuffers(transformers.TrainerCallback):
    """After the checkpoint callback: let its background allocation finish before the next step,
    so the first checkpoint finds every buffer (a stage that comes first allocates the rest itself).
    Records, at each step boundary before the first checkpoint, whether the writer's persister exists."""

    def __init__(self, area: StagingArea, engine: Any = None) -> None:
        self.area = area
        self.engine = engine
        self.persister_before_first_checkpoint: list[bool] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.area.wait_prepared(timeout=60)
        if self.engine is not None and self.engine.last_saved_step is None:
            self.persister_before_first_checkpoint.append(self.engine.saves.persister is not None)


def test_hf_trainer_allocates_the_buffers_after_its_first_step_and_stages_into_them(tmp_path: Path) -> None:
    from tests.test_hf import make_trainer

    ckpt = SpotCheckpointCallback(
        dirpath=str(tmp_path / "store"), interval=None, every_n_steps=3, preemption=[]
    )
    wait = WaitForStagingBuffers(ckpt.engine.staging, ckpt.engine)
    trainer = make_trainer(tmp_path / "out", [ckpt, wait], max_steps=7)
    trainer.train()
    # The writer's persister (its threads) is made at the first step boundary, not by the first checkpoint.
    assert wait.persister_before_first_checkpoint == [True, True, True], (
        wait.persister_before_first_checkpoint
    )
    area = ckpt.engine.staging
    assert area.plan_builds == 1 and area.prepared_buffers_used > 0
    # Every tensor of model and optimizer was prepared: none was allocated by the first checkpoint.
    params = sum(1 for _ in trainer.model.parameters())
    assert area.prepared_buffers_used >= 3 * params  # weights, exp_avg, exp_avg_sq
    # Step 6 may be dropped for step 7 when step 3's upload still runs (the newest written checkpoint
    # wins, as designed; seen under a load of 10): the first and the final one always commit.
    committed = [(c.step, c.reason) for c in ckpt.store.committed()]
    assert committed in ([(3, "steps"), (6, "steps"), (7, "end")], [(3, "steps"), (7, "end")]), committed


def test_lightning_allocates_the_buffers_after_its_first_step_and_stages_into_them(tmp_path: Path) -> None:
    spot = SpotCheckpoint(dirpath=str(tmp_path / "run"), interval=None, every_n_steps=3, preemption=[])
    before_first_checkpoint: list[bool] = []

    class Wait(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            assert spot.engine.staging.wait_prepared(timeout=60)
            # Before SpotCheckpoint's hook (Lightning runs Checkpoint callbacks last): after the first
            # step boundary, before the first checkpoint, the writer's persister (its threads) is made.
            if trainer.global_step == 2:
                before_first_checkpoint.append(
                    spot.engine.last_saved_step is None and spot.engine.saves.persister is not None
                )

    model = BoringModel()
    trainer = pl.Trainer(callbacks=[spot, Wait()], max_steps=7, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)  # fmt: skip
    trainer.fit(model)
    area = spot.engine.staging
    assert area.plan_builds == 1
    params = sum(1 for _ in model.parameters())
    assert area.prepared_buffers_used == params  # BoringModel's SGD keeps no state: the weights
    [info, *_] = spot.store.committed()
    assert info.step == 3
    assert before_first_checkpoint == [True]


@pytest.mark.parametrize("slice_pages", [1, 2, 1 << 14])  # slices between looks at the cancel flag
def test_the_background_allocation_touches_every_page_of_a_buffer_the_last_one_included(
    monkeypatch, slice_pages: int
) -> None:
    monkeypatch.setattr(host_buffers, "_FAULT_SLICE", slice_pages * 4096)
    whole = torch.empty(6 * 4096, dtype=torch.uint8)
    start = -whole.data_ptr() % 4096 + 100  # three pages' bytes from 100 bytes into a page: four pages
    buffer = whole[start : start + 3 * 4096]
    buffer.fill_(0xFF)
    host_buffers.fault_in(buffer, threading.Event())
    first_page = buffer.data_ptr() // 4096
    touched = {(buffer.data_ptr() + int(i)) // 4096 - first_page for i in (buffer == 0).nonzero().flatten()}
    assert touched == set(range((buffer.data_ptr() + buffer.numel() - 1) // 4096 - first_page + 1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pinned staging path)")
def test_cuda_tensors_get_pinned_buffers_prepared_in_the_background() -> None:
    model = torch.nn.Linear(256, 256).cuda()
    area = StagingArea()
    area.prepare(model.state_dict())
    assert area.wait_prepared(timeout=60)
    staged = area.stage(model.state_dict())
    assert area.prepared_buffers_used == 2 and staged.state["weight"].is_pinned()
    staged.wait_copied()
    assert torch.equal(staged.state["weight"], model.weight.detach().cpu())
    staged.release()


_EXIT_WHILE_PREPARING = """
import sys, torch
from spot_callbacks.staging import StagingArea
state = {f"w{i}": torch.zeros(4 << 20) for i in range(24)}  # 24 tensors of 16 MiB
area = StagingArea(pin_memory=False)
assert area.prepare(state)
sys.exit(143)  # a notice's exit while the daemon thread allocates and touches the buffers
"""


def test_a_process_that_exits_while_buffers_are_being_prepared_exits_with_its_code_not_an_abort(
    tmp_path: Path,
) -> None:
    # Python stops a daemon thread at its next return from C when the interpreter finalises; one
    # inside a torch op then unwinds through a noexcept frame: std::terminate, SIGABRT (-6).
    import subprocess
    import sys

    script = tmp_path / "exit_while_preparing.py"
    script.write_text(_EXIT_WHILE_PREPARING)
    codes = [
        subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        for _ in range(3)
    ]
    assert [done.returncode for done in codes] == [143, 143, 143], [done.stderr[-400:] for done in codes]
    assert not any("terminate called" in done.stderr for done in codes)
