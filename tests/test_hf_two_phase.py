"""The Hugging Face two-phase checkpoint: a RAM snapshot at the step, ``checkpoint-N`` written in the background.

The staged folder must be the Trainer's own: the same files, weights ``from_pretrained`` loads
equal (tied ones tied), and an unchanged ``train(resume_from_checkpoint=folder)`` that resumes
bit-identically mid-epoch. Where staging cannot be exact the Trainer writes the folder, and the
callback says why. Real Trainers (tiny GPT-2 from a config, CPU), in-process unless a real
SIGTERM is needed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file
from test_hf import assert_same_weights, hf_run, make_trainer, result_of, run_script, weights

from spot_callbacks import CheckpointStore, ConfigError
from spot_callbacks.hf import SpotCheckpointCallback
from spot_callbacks.hf.checkpoint import SAVE_PATH_ENV

MAX_STEPS = 40  # 32 steps per epoch: a resume at step 13 or 15 is mid-epoch
TRAINER_FILES = {
    "config.json", "generation_config.json", "model.safetensors", "optimizer.pt", "scheduler.pt",
    "rng_state.pth", "trainer_state.json", "training_args.bin",
}  # fmt: skip


class StopAt(transformers.TrainerCallback):
    """Ends training after ``step`` (placed after the spot callback: its checkpoint is taken first)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


def spot(store: Path, **settings: Any) -> SpotCheckpointCallback:
    return SpotCheckpointCallback(dirpath=str(store), interval=None, preemption=[], **settings)


def assert_same_objects(actual: Any, expected: Any, where: str = "") -> None:
    """Equal nested state dicts: tensors equal exactly, everything else by ``==`` (numpy arrays by value)."""
    if isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for key in expected:
            assert_same_objects(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_objects(a, e, f"{where}[{index}]")
    elif hasattr(expected, "shape"):
        assert (actual == expected).all(), where
    else:
        assert actual == expected, where


@pytest.fixture(scope="module")
def plain_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    trainer = make_trainer(tmp_path_factory.mktemp("plain"), [], max_steps=MAX_STEPS)
    trainer.train()
    return weights(trainer.model)


def llama_untied() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("tied", [True, False], ids=["gpt2-tied", "llama-untied"])
def test_the_staged_folder_is_the_trainers_own(tied: bool, tmp_path: Path) -> None:
    build = hf_run.build_model if tied else llama_untied
    ckpt = spot(tmp_path / "store", every_n_steps=5)
    staged_run = make_trainer(tmp_path / "staged", [ckpt], max_steps=5, model=build())
    staged_run.train()
    own_run = make_trainer(
        tmp_path / "own", [], max_steps=5, save_strategy="steps", save_steps=5, model=build()
    )
    own_run.train()
    staged, own = tmp_path / "staged" / "checkpoint-5", tmp_path / "own" / "checkpoint-5"

    info = ckpt.store.latest()
    assert (info.step, info.extra["hf_save"]) == (5, "staged")
    assert {p.name for p in own.iterdir()} == TRAINER_FILES
    assert {p.name for p in staged.iterdir()} == TRAINER_FILES | {"manifest.json"}  # the kept local copy
    assert set(CheckpointStore(str(tmp_path / "store")).read_manifest(5).extra) >= {"engine", "hf_save"}
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        assert_same_objects(
            torch.load(staged / name, weights_only=False), torch.load(own / name, weights_only=False), name
        )
    state, own_state = (json.loads((folder / "trainer_state.json").read_text()) for folder in (staged, own))
    assert {key for key in own_state if state[key] != own_state[key]} == {
        "save_steps"
    }  # an argument of own_run
    # model.safetensors holds the same tensors under the same names (the tied lm_head left out alike)
    tensors, own_tensors = load_file(staged / "model.safetensors"), load_file(own / "model.safetensors")
    assert_same_weights(tensors, own_tensors)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(staged)
    embeddings = loaded.get_input_embeddings().weight
    assert ("lm_head.weight" not in tensors) is tied
    assert (loaded.lm_head.weight.data_ptr() == embeddings.data_ptr()) is tied  # tied again, or still apart
    assert_same_weights(weights(loaded), weights(staged_run.model))


def test_save_only_model_is_staged_as_the_trainers_model_only_folder(tmp_path: Path) -> None:
    ckpt = spot(tmp_path / "store", every_n_steps=5)
    staged_run = make_trainer(tmp_path / "staged", [ckpt], max_steps=5, save_only_model=True)
    staged_run.train()
    own_run = make_trainer(tmp_path / "own", [], 5, save_strategy="steps", save_steps=5, save_only_model=True)
    own_run.train()
    staged, own = tmp_path / "staged" / "checkpoint-5", tmp_path / "own" / "checkpoint-5"
    model_only = TRAINER_FILES - {"optimizer.pt", "scheduler.pt", "rng_state.pth"}
    assert {p.name for p in own.iterdir()} == model_only
    assert {p.name for p in staged.iterdir()} == model_only | {"manifest.json"}
    assert ckpt.store.latest().extra["hf_save"] == "staged"
    assert_same_weights(load_file(staged / "model.safetensors"), load_file(own / "model.safetensors"))


@pytest.mark.parametrize(
    "save_path, stop_step",
    [("staged", 13), ("staged", 15), ("trainer", 13)],
    ids=["staged-unlogged-step", "staged-logged-step", "trainer"],
)
def test_an_interrupted_run_resumes_bit_identically_mid_epoch(
    save_path: str, stop_step: int, tmp_path: Path, plain_weights: dict[str, torch.Tensor],
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    monkeypatch.setenv(SAVE_PATH_ENV, save_path)
    caplog.set_level(logging.INFO, logger="spot_callbacks")
    store = tmp_path / "store"
    make_trainer(tmp_path / "a", [spot(store, every_n_steps=stop_step), StopAt(stop_step)], MAX_STEPS).train()
    info = CheckpointStore(str(store)).latest()
    assert (info.step, info.extra["hf_save"]) == (stop_step, save_path)

    fresh = spot(store)
    resumed = make_trainer(tmp_path / "b", [fresh], MAX_STEPS)
    folder = fresh.latest()
    assert folder == str(tmp_path / "b" / f"checkpoint-{stop_step}")
    resumed.train(resume_from_checkpoint=folder)  # the Trainer's own resume, unchanged
    assert_same_weights(weights(resumed.model), plain_weights)
    expected = {
        "staged": "checkpoints are staged in RAM and written in the background",
        "trainer": f"the Trainer writes each checkpoint, then it is uploaded ({SAVE_PATH_ENV}=trainer)",
    }[save_path]
    assert [r.getMessage() for r in caplog.records].count(f"spot_callbacks: {expected}") == 2  # once per run


@pytest.mark.parametrize(
    "overrides, reason",
    [({"eval_strategy": "steps", "eval_steps": 4}, "an evaluation runs at the checkpoint step")],
    ids=["evaluation-at-the-step"],
)
def test_where_staging_is_not_exact_the_trainer_saves_and_says_why(
    overrides: dict[str, Any], reason: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="spot_callbacks")
    ckpt = spot(tmp_path / "store", every_n_steps=3)
    evaluates = "eval_strategy" in overrides
    extra = {"eval_dataset": hf_run.TokenData(samples=8)} if evaluates else {}
    make_trainer(tmp_path / "out", [ckpt], max_steps=6, **overrides, **extra).train()
    paths = [(c.step, ckpt.store.read_manifest(c.step).extra["hf_save"]) for c in ckpt.store.committed()]
    # The Trainer evaluates at steps 4 and 6 (the end): step 3's checkpoint is staged all the same.
    assert paths == ([(3, "staged"), (6, "trainer")] if evaluates else [(3, "trainer"), (6, "trainer")])
    said = [r.getMessage() for r in caplog.records if reason in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]


class AskAt(transformers.TrainerCallback):
    """Sets ``control.<flag>`` at ``step``, listed after the spot callback (as a user's own callback is)."""

    def __init__(self, step: int, flag: str) -> None:
        self.step, self.flag = step, flag

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            setattr(control, self.flag, True)


@pytest.mark.parametrize("flag", ["should_save", "should_evaluate"])
def test_a_later_callback_that_saves_or_evaluates_at_a_staged_step_gets_the_trainers_save(
    flag: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Step 3 is staged at the spot callback's on_step_end; the callback after it then asks for a
    # save (or an evaluation) at that step. One writer must make checkpoint-3: the Trainer.
    caplog.set_level(logging.INFO, logger="spot_callbacks")
    ckpt = spot(tmp_path / "store", every_n_steps=3)
    out = tmp_path / "out"
    make_trainer(out, [ckpt, AskAt(3, flag)], max_steps=6, eval_dataset=hf_run.TokenData(samples=8)).train()
    paths = [(c.step, ckpt.store.read_manifest(c.step).extra["hf_save"]) for c in ckpt.store.committed()]
    assert paths == [(3, "trainer"), (6, "staged")]
    assert set(ckpt.store.read_manifest(3).files) == TRAINER_FILES
    assert not list(out.glob(".checkpoint-*.partial"))  # the dropped snapshot left nothing behind
    said = [r.getMessage() for r in caplog.records if "at a staged checkpoint's step" in r.getMessage()]
    assert len(said) == 1, said


def test_an_unknown_save_path_setting_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SAVE_PATH_ENV, "fast")
    with pytest.raises(ConfigError, match=f"{SAVE_PATH_ENV}='fast': expected 'staged' or 'trainer'"):
        spot(tmp_path / "store", every_n_steps=4)  # refused when the callback is built: nothing trained
    assert not (tmp_path / "store").exists()


@pytest.mark.slow
def test_a_sigterm_checkpoint_is_staged_and_a_fresh_machine_resumes_bit_identically(tmp_path: Path) -> None:
    url = (tmp_path / "store").as_uri()
    run_script(
        "--out", tmp_path / "plain.pt", "--output-dir", tmp_path / "plain", "--resume", "none", expect_rc=0
    )
    run_script("--dirpath", url, "--out", tmp_path / "first.pt", "--output-dir", tmp_path / "a",
               "--sigterm-at-step", 13, expect_rc=143)  # fmt: skip
    first = result_of(tmp_path / "first.pt")
    assert first["preempted"] and first["saves"] == [14] and first["global_step"] == 14
    info = CheckpointStore(url).latest()
    assert (info.step, info.reason, info.extra["hf_save"]) == (14, "preemption", "staged")

    run_script("--dirpath", url, "--out", tmp_path / "second.pt", "--output-dir", tmp_path / "b", expect_rc=0)
    assert result_of(tmp_path / "second.pt")["resumed_from"] == str(tmp_path / "b" / "checkpoint-14")
    assert_same_weights(torch.load(tmp_path / "second.pt"), torch.load(tmp_path / "plain.pt"))


@pytest.mark.slow
def test_two_processes_stage_their_own_rng_files_and_resume_bit_identically(tmp_path: Path) -> None:
    url = (tmp_path / "store").as_uri()
    run_script("--out", tmp_path / "plain{rank}.pt", "--output-dir", tmp_path / "plain", "--resume", "none",
               expect_rc=0, torchrun=True)  # fmt: skip
    run_script("--dirpath", url, "--out", tmp_path / "first{rank}.pt", "--output-dir", tmp_path / "a",
               "--sigterm-at-step", 13, "--sigterm-rank", 1, expect_rc=None, torchrun=True)  # fmt: skip
    assert [result_of(tmp_path / f"first{rank}.pt")["saves"] for rank in (0, 1)] == [[14], [14]]
    info = CheckpointStore(url).latest()
    assert (info.step, info.reason, info.extra["hf_save"]) == (14, "preemption", "staged")
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(info.files)
    assert not (set(info.files) & {"rng_state.pth"})

    run_script("--dirpath", url, "--out", tmp_path / "second{rank}.pt", "--output-dir", tmp_path / "b",
               expect_rc=0, torchrun=True)  # fmt: skip
    for rank in (0, 1):
        second = torch.load(tmp_path / f"second{rank}.pt")
        assert_same_weights(second, torch.load(tmp_path / f"plain{rank}.pt"))


def test_the_optimizer_state_is_hashed_as_written_and_not_again_at_upload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer thread hands over optimizer.pt's digest (it holds most of the bytes): the upload
    hashes only the files ``save_pretrained`` and the few-KB ``torch.save`` calls wrote."""
    from spot_callbacks.store import transfer
    from spot_callbacks.store.checksums import digest_local_file

    hashed_at_upload: list[str] = []
    real = transfer.digest_mapped
    monkeypatch.setattr(
        transfer, "digest_mapped", lambda path: hashed_at_upload.append(Path(path).name) or real(path)
    )
    ckpt = spot(tmp_path / "store", every_n_steps=5)
    make_trainer(tmp_path / "staged", [ckpt], max_steps=5).train()
    info = ckpt.store.latest()
    assert (info.step, info.extra["hf_save"]) == (5, "staged")
    assert sorted(hashed_at_upload) == sorted(TRAINER_FILES - {"optimizer.pt"})
    staged = tmp_path / "staged" / "checkpoint-5"  # the kept local copy: the bytes that were uploaded
    assert info.files["optimizer.pt"] == digest_local_file(staged / "optimizer.pt")
    assert ckpt.store.verify(5, deep=True)  # every recorded checksum is the stored bytes'


def test_a_hashed_torch_save_reaches_the_disk_in_quarter_mib_writes_with_its_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from helpers.counted_writes import CountedWrites

    import spot_callbacks.staging as staging
    from spot_callbacks.store.checksums import WRITE_PIECE_BYTES, ChecksumWriter, digest_local_file

    counted: list[CountedWrites] = []
    monkeypatch.setattr(
        staging,
        "ChecksumWriter",
        lambda raw: ChecksumWriter(counted.append(CountedWrites(raw)) or counted[-1]),
    )
    state = {
        "state": {0: {"exp_avg": torch.arange(3 * 1024 * 1024 // 4 + 5, dtype=torch.float32)}},
        "lr": 0.1,
    }
    digest = staging.save_hashed(state, tmp_path / "optimizer.pt")
    writes = counted[0].writes
    assert digest == digest_local_file(tmp_path / "optimizer.pt")
    assert sum(writes) == digest.size and max(writes) <= WRITE_PIECE_BYTES
    assert_same_objects(torch.load(tmp_path / "optimizer.pt"), state)


def test_a_full_disk_while_the_optimizer_state_is_written_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import spot_callbacks.staging as staging

    class FullDisk:
        def __init__(self, raw: Any) -> None:
            pass

        def write(self, data: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self) -> None:
            pass

    monkeypatch.setattr(staging, "ChecksumWriter", FullDisk)
    with pytest.raises(OSError) as raised:
        staging.save_hashed({"w": torch.ones(4)}, tmp_path / "optimizer.pt")
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(tmp_path / "optimizer.pt")
