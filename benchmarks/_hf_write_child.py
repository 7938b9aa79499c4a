"""One Hugging Face checkpoint written and uploaded by the library, in a fresh process (``hf_write.py``).

Trains a small-config Llama one step (the optimizer state exists), stages the state as the
callback does, then measures the persister's two phases one after the other: the writer thread's
``write_checkpoint_folder`` (the Trainer's ``checkpoint-N`` from the snapshot) and the upload of the
folder with the digests the writer handed over. Prints one JSON line: each phase's wall seconds and
the process's CPU seconds (user + system, kernel counters: the writer's page-cache work included),
and the writer thread's own CPU. Run with ``PYTHONPATH`` at the checkout under test; it uses only
what the baseline has too (a baseline ``write_checkpoint_folder`` returns ``None``: no digests).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch
import transformers


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def sys_s() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(16) * (index + 3)) % self.vocab
        return {"input_ids": ids, "labels": ids}


def trained_trainer(out: Path, hidden: int, layers: int, vocab: int) -> transformers.Trainer:
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=1, per_device_train_batch_size=2, save_strategy="no", report_to=[],
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, logging_strategy="no",
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=transformers.LlamaForCausalLM(config), args=args, train_dataset=Tokens(vocab)
    )
    trainer.train()
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--store-url", required=True)
    parser.add_argument("--storage-options", default="{}")
    parser.add_argument("--step", type=int, required=True)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()

    from spot_callbacks.hf import checkpoint
    from spot_callbacks.staging import StagingArea
    from spot_callbacks.store import CheckpointStore, CommitWriter, local_payload_names

    trainer = trained_trainer(args.workdir / "out", args.hidden, args.layers, args.vocab)
    staged = StagingArea().stage(checkpoint.rank_state(trainer, sharded=False, layouts={}))
    staged.wait_copied()
    folder = args.workdir / "out" / f"checkpoint-{args.step}"

    time.sleep(2)  # the training step's threads and allocations settle before the timed phases
    wall, cpu, system, thread = time.perf_counter(), cpu_s(), sys_s(), time.thread_time()
    digests: Any = checkpoint.write_checkpoint_folder(trainer, staged, trainer.state, folder)
    write = {
        "wall_s": time.perf_counter() - wall,
        "cpu_s": cpu_s() - cpu,
        "sys_s": sys_s() - system,
        "thread_cpu_s": time.thread_time() - thread,
    }
    staged.release()

    store = CheckpointStore(args.store_url, storage_options=json.loads(args.storage_options))
    names = local_payload_names(folder)
    handed = dict(digests or {})
    wall, cpu, system = time.perf_counter(), cpu_s(), sys_s()
    uploaded = CommitWriter(store).upload(args.step, folder, names, handed)
    upload = {"wall_s": time.perf_counter() - wall, "cpu_s": cpu_s() - cpu, "sys_s": sys_s() - system}
    assert set(uploaded) == set(names)
    size = sum((folder / name).stat().st_size for name in names)
    print(
        json.dumps(
            {"write": write, "upload": upload, "bytes": size, "handed": sorted(handed),
             "pid": os.getpid()}
        )
    )  # fmt: skip


if __name__ == "__main__":
    main()
