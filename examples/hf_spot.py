"""Train a tiny GPT-2 with the Hugging Face Trainer on a spot instance, with SpotCheckpointCallback.

Nothing is downloaded: the model is built from a config and the data are synthetic tokens.
Run it, stop it with Ctrl-C or `kill -TERM <pid>` (what a spot reclaim sends), run it again: it
continues from the newest committed checkpoint, even on another machine with an empty disk.

    python examples/hf_spot.py                                  # checkpoints in spot_runs/hf
    python examples/hf_spot.py --dirpath s3://bucket/runs/gpt2 --storage-options '{"endpoint_url": "..."}'
    python examples/hf_spot.py --config examples/hf_spot.yaml   # TrainingArguments + SpotConfig in one YAML

Several processes (data parallel; on a machine without a GPU they are CPU processes):

    torchrun --standalone --nproc_per_node 2 examples/hf_spot.py
    accelerate launch --multi_gpu --num_processes 2 examples/hf_spot.py

`accelerate launch --cpu --num_processes 2` starts one process, not two: accelerate leaves the
other CPU processes to mpirun (`--mpirun_hostfile`). The callback warns when it sees that case.

Exit codes: 0 when training finished, 143 (128 + SIGTERM) when it stopped for a preemption after
committing an emergency checkpoint, so a scheduler can tell "resume me" from "done". The Trainer
cannot end the process from a callback without skipping its own shutdown, so the script does it
after train() returns.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

import torch
import transformers
import yaml

from spot_callbacks import SpotConfig, SpotError
from spot_callbacks.hf import PREEMPTED_EXIT_CODE, SpotCheckpointCallback


class SyntheticTokens(torch.utils.data.Dataset):
    """Random token sequences from a fixed generator: the same data set on every machine."""

    def __init__(self, samples: int = 1024, length: int = 32, vocab_size: int = 128) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.tokens = torch.randint(0, vocab_size, (samples, length), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def tiny_gpt2() -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def several_processes_without_gpu() -> bool:
    """Started by torchrun or `accelerate launch --multi_gpu` with several processes, and no GPU here."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()


def parse_args(argv: list[str] | None) -> tuple[transformers.TrainingArguments, SpotConfig]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--config", help="YAML with TrainingArguments and SpotConfig keys (examples/hf_spot.yaml)"
    )
    parser.add_argument("--dirpath", help="where committed checkpoints live: a folder or any fsspec URL")
    parser.add_argument("--storage-options", help="JSON object passed to fsspec (endpoint, credentials, ...)")
    parser.add_argument("--output-dir", help="the Trainer's local output_dir")
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--every-n-steps", type=int, help="also checkpoint every N steps")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="a line per checkpoint, and a traceback with an error"
    )
    args = parser.parse_args(argv)
    # Without a GPU, a Trainer in several processes needs use_cpu=True to train them as one run
    # (gloo); otherwise each process trains its own copy of the model. It must be known when
    # TrainingArguments is built: that is when the Trainer sets up its processes.
    use_cpu = several_processes_without_gpu()
    if args.config:
        hf_parser = transformers.HfArgumentParser((transformers.TrainingArguments, SpotConfig))
        settings = yaml.safe_load(Path(args.config).read_text())  # what parse_yaml_file(args.config) reads
        training_args, spot_config = hf_parser.parse_dict({"use_cpu": use_cpu, **settings})
    else:
        training_args = transformers.TrainingArguments(
            output_dir="spot_runs/hf-output", max_steps=300, per_device_train_batch_size=8, learning_rate=3e-3,
            lr_scheduler_type="linear", warmup_steps=10, logging_steps=20, save_strategy="no", seed=42,
            data_seed=7, dataloader_num_workers=0, report_to=[], ddp_find_unused_parameters=False,
            use_cpu=use_cpu,
        )  # fmt: skip
        spot_config = SpotConfig(dirpath="spot_runs/hf", interval="2min")
    overrides = {}
    if args.dirpath:
        overrides["dirpath"] = args.dirpath
    if args.storage_options:
        overrides["storage_options"] = json.loads(args.storage_options)
    if args.every_n_steps:
        overrides["every_n_steps"] = args.every_n_steps
    if args.verbose:
        overrides["verbose"] = True
    spot_config = dataclasses.replace(spot_config, **overrides)
    if args.output_dir:
        training_args.output_dir = args.output_dir
    if args.max_steps:
        training_args.max_steps = args.max_steps
    return training_args, spot_config


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    training_args, spot_config = parse_args(argv)
    ckpt = SpotCheckpointCallback(**spot_config.to_dict())
    torch.manual_seed(0)
    trainer = transformers.Trainer(
        model=tiny_gpt2(), args=training_args, train_dataset=SyntheticTokens(), callbacks=[ckpt]
    )
    resume_from = ckpt.latest()  # None on the first run: start from scratch
    newest = ckpt.store.latest()
    if newest is not None and newest.step >= training_args.max_steps:
        # Resumed at max_steps, the Trainer would still train (and the callback commit) one more step.
        if trainer.is_world_process_zero():
            print(
                f"already finished at step {newest.step} (max_steps={training_args.max_steps}): nothing to train"
            )
        return 0
    trainer.train(resume_from_checkpoint=resume_from)
    processes = f"{training_args.world_size} process" + ("es" if training_args.world_size > 1 else "")
    if ckpt.preempted:
        if trainer.is_world_process_zero():
            committed = f"the emergency checkpoint is committed in {ckpt.store.url}"
            print(f"preempted ({processes}): {committed}; run again to resume")
        return PREEMPTED_EXIT_CODE
    if trainer.is_world_process_zero():
        print(f"finished at step {trainer.state.global_step} ({processes}); checkpoints in {ckpt.store.url}")
    return 0


if __name__ == "__main__":
    try:
        code = main()
        if torch.distributed.is_initialized():
            # torchrun: without it gloo's threads can abort the process at interpreter exit.
            torch.distributed.destroy_process_group()
        sys.exit(code)
    except SpotError as err:  # its one line says the cause and the fix; -v adds the traceback
        if {"-v", "--verbose"} & set(sys.argv[1:]):
            raise
        if not err.said_in_log:
            print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
