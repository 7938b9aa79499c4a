"""A PEFT model under the Hugging Face Trainer: its adapters staged, written as ``save_pretrained`` writes them.

The staged ``checkpoint-N`` must be the Trainer's own byte for byte where it can be
(``adapter_model.safetensors``, ``adapter_config.json``, the model card, a second adapter's
sub-folder) and equal object for object elsewhere, and the Trainer's unchanged
``train(resume_from_checkpoint=folder)`` must resume from it bit-identically mid-epoch. Real
Trainers on a tiny LLaMA built from a config, LoRA on CPU, nothing downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_hf import assert_same_weights, make_trainer, weights
from test_hf_two_phase import MAX_STEPS, StopAt, assert_same_objects, llama_untied, spot

from spot_callbacks import CheckpointStore

peft = pytest.importorskip("peft")

OWN_FILES = {
    "adapter_model.safetensors", "adapter_config.json", "README.md", "optimizer.pt", "scheduler.pt",
    "rng_state.pth", "trainer_state.json", "training_args.bin",
}  # fmt: skip


def lora_llama(second_adapter: bool = False) -> torch.nn.Module:
    """The same LoRA model at every call (seeded base and adapters); dropout draws from the RNG."""
    base = llama_untied()
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(base, config)
    if second_adapter:  # not trained (only the active adapter is), saved all the same
        model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["k_proj"], init_lora_weights=False))
    return model


@pytest.mark.parametrize("second_adapter", [False, True], ids=["one-adapter", "two-adapters"])
def test_the_staged_adapter_folder_is_the_trainers_own(second_adapter: bool, tmp_path: Path) -> None:
    ckpt = spot(tmp_path / "store", every_n_steps=5)
    staged_run = make_trainer(tmp_path / "staged", [ckpt], max_steps=5, model=lora_llama(second_adapter))
    staged_run.train()
    own_run = make_trainer(
        tmp_path / "own",
        [],
        max_steps=5,
        save_strategy="steps",
        save_steps=5,
        model=lora_llama(second_adapter),
    )
    own_run.train()
    staged, own = tmp_path / "staged" / "checkpoint-5", tmp_path / "own" / "checkpoint-5"

    info = ckpt.store.latest()
    assert (info.step, info.extra["hf_save"]) == (5, "staged")
    own_files = {p.relative_to(own).as_posix() for p in own.rglob("*") if p.is_file()}
    adapter_files = {"adapter_model.safetensors", "adapter_config.json"}
    expected = OWN_FILES | ({f"other/{name}" for name in adapter_files} if second_adapter else set())
    assert own_files == expected
    assert {p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file()} == expected | {
        "manifest.json"
    }
    for name in sorted(own_files - {"optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"}):
        if name == "trainer_state.json":
            state, own_state = (json.loads((folder / name).read_text()) for folder in (staged, own))
            assert {key for key in own_state if state[key] != own_state[key]} == {"save_steps"}
        else:  # the adapter weights, their configs and the model card: the same bytes
            assert (staged / name).read_bytes() == (own / name).read_bytes(), name
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        assert_same_objects(
            torch.load(staged / name, weights_only=False), torch.load(own / name, weights_only=False), name
        )
    # The live adapter configs stay as they were (save_pretrained flips inference_mode while it writes).
    assert not any(config.inference_mode for config in staged_run.model.peft_config.values())


@pytest.fixture(scope="module")
def plain_lora_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    trainer = make_trainer(tmp_path_factory.mktemp("plain-lora"), [], max_steps=MAX_STEPS, model=lora_llama())
    trainer.train()
    return weights(trainer.model)


@pytest.mark.parametrize("stop_step", [13, 15], ids=["unlogged-step", "logged-step"])
def test_an_interrupted_lora_run_resumes_bit_identically_mid_epoch(
    stop_step: int, tmp_path: Path, plain_lora_weights: dict[str, torch.Tensor]
) -> None:
    store = tmp_path / "store"
    first = make_trainer(
        tmp_path / "a",
        [spot(store, every_n_steps=stop_step), StopAt(stop_step)],
        MAX_STEPS,
        model=lora_llama(),
    )
    first.train()
    info = CheckpointStore(str(store)).latest()
    assert (info.step, info.extra["hf_save"]) == (stop_step, "staged")
    assert "adapter_model.safetensors" in info.files and "model.safetensors" not in info.files

    fresh = spot(store)
    resumed = make_trainer(tmp_path / "b", [fresh], MAX_STEPS, model=lora_llama())  # the same base, rebuilt
    folder = fresh.latest()
    assert folder == str(tmp_path / "b" / f"checkpoint-{stop_step}")
    resumed.train(resume_from_checkpoint=folder)  # the Trainer's own resume, unchanged
    assert resumed.state.global_step == MAX_STEPS
    assert_same_weights(weights(resumed.model), plain_lora_weights)
    lora, untrained = [name for name in plain_lora_weights if "lora_" in name], weights(lora_llama())
    assert lora and not all(torch.equal(plain_lora_weights[name], untrained[name]) for name in lora)


def test_the_adapters_are_staged_not_the_frozen_base(tmp_path: Path) -> None:
    ckpt = spot(tmp_path / "store", every_n_steps=3)
    trainer = make_trainer(tmp_path / "out", [ckpt], max_steps=3, model=lora_llama())
    trainer.train()
    adapters = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
    whole = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    # the adapters, AdamW's two moments of them, the scheduler and RNG: nothing of the frozen base
    assert 3 * adapters <= ckpt.engine.staging.buffer_bytes < 3 * adapters + 16_384 < whole
    assert ckpt.store.latest().extra["hf_save"] == "staged"
