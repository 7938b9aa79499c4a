"""A small Hugging Face Trainer run for the resume tests (run as a subprocess, or under torchrun).

A tiny GPT-2 (dropout on) built from a config, a shuffled synthetic token data set and a linear
LR schedule: everything that breaks a naive resume. Sends itself SIGTERM at ``--sigterm-at-step``
(a real signal, arriving inside a step, like a real notice). ``--out`` may contain ``{rank}``,
``--output-dir`` ``{node}`` (torchrun's GROUP_RANK: a node-local output_dir per node).
Prints one JSON line; exits 143 when the callback stopped training for a preemption.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

import torch
import transformers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dirpath")
    parser.add_argument("--out", required=True)
    parser.add_argument("--output-dir", required=True, help="the Trainer's local output_dir")
    parser.add_argument(
        "--seed", type=int, default=1, help="TrainingArguments.seed: the process RNG, not the data order"
    )
    parser.add_argument("--sigterm-at-step", type=int, default=-1)
    parser.add_argument("--sigterm-rank", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--every-n-steps", type=int, default=None)
    parser.add_argument("--interval", default=None)
    parser.add_argument("--resume", choices=["latest", "true", "none"], default="latest")
    parser.add_argument("--save-strategy", default="no")
    parser.add_argument("--jit", action="store_true", help="TrainingArguments(enable_jit_checkpoint=True)")
    parser.add_argument("--storage-options", default="{}")
    parser.add_argument(
        "--record-uploads", action="store_true", help="list this rank's file uploads in the result"
    )
    parser.add_argument("--refuse-uploads-rank", type=int, default=-1, help="this rank's uploads are denied")
    return parser.parse_args(argv)


class TokenData(torch.utils.data.Dataset):
    """Fixed random token sequences (the data set never depends on --seed)."""

    def __init__(self, samples: int = 256, length: int = 16, vocab: int = 128) -> None:
        self.tokens = torch.randint(
            0, vocab, (samples, length), generator=torch.Generator().manual_seed(1234)
        )

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


class SelfSigterm(transformers.TrainerCallback):
    """SIGTERM to ``rank`` at the start of ``step``; with ``settle``, once the earlier checkpoints settled.

    ``settle`` makes which steps get committed independent of upload speed: an emergency checkpoint
    drops an older one still waiting for the uploader, by design.
    """

    def __init__(self, step: int, rank: int, spot=None, settle: bool = False) -> None:
        self.step, self.rank, self.spot, self.settle, self.sent = step, rank, spot, settle, False

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step != self.step or self.sent:
            return
        self.sent = True
        persister = self.spot.engine.saves.persister if self.settle and self.spot is not None else None
        if persister is not None:  # the writer rank; the notice is agreed at the step's end, after this
            assert persister.wait(timeout=120), "the checkpoints before the SIGTERM did not settle"
        if args.process_index == self.rank:
            os.kill(os.getpid(), signal.SIGTERM)


class RecordSaves(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_save(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def build_model() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)  # the initial weights do not depend on --seed
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def refuse_uploads() -> None:
    """Every upload of this process fails as a store denying access would (not retryable)."""
    from spot_callbacks.store import CommitWriter

    def refusing(self, local_path, step, name, *rest, **options):  # noqa: ANN001, ANN002, ANN003, ANN202
        raise PermissionError(f"injected: access denied uploading {name}")

    CommitWriter.upload_file = refusing


def record_uploads() -> list[str]:
    """Every file this process uploads into the store, as ``step/name``."""
    from spot_callbacks.store import CommitWriter

    uploaded: list[str] = []
    upload_file = CommitWriter.upload_file

    def recording(self, local_path, step, name, *rest, **options):  # noqa: ANN001, ANN002, ANN003, ANN202
        sent = upload_file(self, local_path, step, name, *rest, **options)
        uploaded.append(f"{step}/{name}")
        return sent

    CommitWriter.upload_file = recording
    return uploaded


def main() -> int:
    args = parse_args()
    uploaded = record_uploads() if args.record_uploads else None
    if int(os.environ.get("RANK", "0")) == args.refuse_uploads_rank:
        refuse_uploads()
    model = build_model()
    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir.format(node=os.environ.get("GROUP_RANK", "0")), max_steps=args.max_steps, per_device_train_batch_size=8,
        learning_rate=5e-3, lr_scheduler_type="linear", warmup_steps=3, seed=args.seed, data_seed=7,
        save_strategy=args.save_strategy, save_steps=10, logging_steps=5, report_to=[], use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True, enable_jit_checkpoint=args.jit,
    )  # fmt: skip
    spot = None
    callbacks: list = [RecordSaves()]
    if args.dirpath:
        from spot_callbacks.hf import PREEMPTED_EXIT_CODE, SpotCheckpointCallback

        spot = SpotCheckpointCallback(
            dirpath=args.dirpath, interval=args.interval, every_n_steps=args.every_n_steps, keep_last=3,
            storage_options=json.loads(args.storage_options), preemption=["SIGTERM"],
        )  # fmt: skip
        callbacks.append(spot)
    if args.sigterm_at_step >= 0:
        callbacks.append(SelfSigterm(args.sigterm_at_step, args.sigterm_rank))
    trainer = transformers.Trainer(
        model=model, args=training_args, train_dataset=TokenData(), callbacks=callbacks
    )
    resume = None
    if spot is not None and args.resume == "latest":
        resume = spot.latest()
    elif args.resume == "true":
        resume = True
    trainer.train(resume_from_checkpoint=resume)

    rank = training_args.process_index
    jit_fired = any(isinstance(t, threading.Timer) for t in threading.enumerate())
    if args.jit:
        jit = next(
            cb for cb in trainer.callback_handler.callbacks if type(cb).__name__ == "JITCheckpointCallback"
        )
        jit_fired = jit_fired or jit.jit_manager.is_checkpoint_requested
    out = args.out.format(rank=rank)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out)
    result = {
        "rank": rank,
        "global_step": trainer.state.global_step,
        "preempted": bool(spot and spot.preempted),
        "resumed_from": resume if isinstance(resume, (str, bool)) else None,
        # The Trainer's saves (on_save) and the callback's staged ones, which the Trainer never sees.
        "saves": sorted(callbacks[0].steps + (spot._staged.submitted_steps if spot else [])),
        "jit_fired": jit_fired,
        "log_keys": sorted({key for entry in trainer.state.log_history for key in entry}),
        "uploaded": uploaded,
    }
    print(json.dumps(result), flush=True)
    with open(f"{out}.json", "w") as handle:
        json.dump(result, handle)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank has written its result before any exits
        # Gloo's worker threads still alive at interpreter exit abort the process (SIGABRT,
        # "terminate called without an active exception"): torch asks scripts to destroy it.
        torch.distributed.destroy_process_group()
    return PREEMPTED_EXIT_CODE if spot and spot.preempted else 0


if __name__ == "__main__":
    sys.exit(main())
