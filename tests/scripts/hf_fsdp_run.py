"""hf_run.py's Trainer run under accelerate's FSDP plugin with SHARDED_STATE_DICT (run under torchrun).

FSDP2 unless ``--fsdp-version 1``.

``--resume-from`` resumes from a local ``checkpoint-N`` folder (without ``--dirpath``: the Trainer
alone loads it, as a user would); ``--output-dir`` may contain ``{node}`` (torchrun's GROUP_RANK).

Same model, data and schedule as hf_run.py. accelerate 1.15 turns its FSDP plugin on only for
accelerator device types (``AcceleratorState.__init__`` sets ``DistributedType.FSDP`` in the
``MULTI_GPU``/``MULTI_XPU``/... branch and leaves ``MULTI_CPU`` alone), so on a CPU box the Trainer
would silently train plain DDP and write single-file checkpoints. :func:`enable_fsdp_on_cpu` takes
that one branch for ``MULTI_CPU`` too; everything after it (``fully_shard`` on gloo, DCP shard files
and ``.metadata`` in ``checkpoint-N``, their loading on resume) is accelerate's and torch's own code.
Writes the full (unsharded) weights to ``--out`` (may contain ``{rank}``) and one JSON line; exits
143 when the callback stopped training for a preemption.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_run  # noqa: E402  (the sibling script: model, data, SIGTERM and save-recording callbacks)
from report_line import print_line  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dirpath")
    parser.add_argument("--storage-options", default="{}")
    parser.add_argument("--out", required=True)
    parser.add_argument("--output-dir", required=True, help="the Trainer's local output_dir")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sigterm-at-step", type=int, default=-1)
    parser.add_argument("--sigterm-rank", type=int, default=0)
    parser.add_argument(
        "--settle-at-step", type=int, default=-1,
        help="every rank waits at the start of this step until its earlier checkpoints settled",
    )  # fmt: skip
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--every-n-steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--resume-from", default=None, help="a local checkpoint-N folder to resume from")
    parser.add_argument("--state-dict-type", default="SHARDED_STATE_DICT")
    parser.add_argument("--fsdp-version", type=int, default=2, help="accelerate's FSDP plugin: 1 or 2")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (peft) on the frozen model")
    return parser.parse_args(argv)


def enable_fsdp_on_cpu() -> None:
    import accelerate.state
    from accelerate.utils import DistributedType

    original_init = accelerate.state.AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        original_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    accelerate.state.AcceleratorState.__init__ = init


def fsdp1_on_cpu(version: int) -> dict[str, str]:
    """What FSDP1 needs to run on CPU (nothing for FSDP2); its ``fsdp_config`` entries.

    accelerate's plugin with ``sync_module_states`` (on by default) looks for an accelerator device
    and raises on CPU: every rank builds the same seeded model, so there is nothing to sync. And
    accelerate passes its device as ``device_id``, ``cpu:0`` on a CPU box, which torch 2.13's FSDP1
    compares with its compute device ``cpu`` (``torch.cpu.current_device()``) and refuses
    ("Inconsistent compute device"); without a ``device_id`` it refuses CPU outright. Only the
    index is dropped: ``device_id=torch.device("cpu")``.
    """
    if version != 1:
        return {}
    from torch.distributed.fsdp import FullyShardedDataParallel

    original_init = FullyShardedDataParallel.__init__

    def init(self, module, *args, device_id=None, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        on_cpu = device_id is not None and torch.device(device_id).type == "cpu"
        original_init(self, module, *args, device_id=torch.device("cpu") if on_cpu else device_id, **kwargs)

    FullyShardedDataParallel.__init__ = init
    return {"sync_module_states": "false"}


class PersisterAfterFirstStep(transformers.TrainerCallback):
    """After the checkpoint callback: whether the every-rank folder persister (its gloo groups) exists
    at the end of this train()'s first step, before any checkpoint (``None``: that step checkpoints)."""

    def __init__(self, spot: Any) -> None:
        self.spot = spot
        self.seen: bool | None = None
        self.first = True

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.first:
            self.first = False
            staged = self.spot._staged
            if staged.pending is None and not control.should_save and not staged.submitted_steps:
                self.seen = self.spot.engine.saves.persister is not None


class Settle(transformers.TrainerCallback):
    """Every rank waits, at the start of ``step``, until its earlier checkpoints are written and settled
    (FSDP1: the writers' check of the flat-shard plan is done, so the next checkpoint uses it)."""

    def __init__(self, step: int, spot: Any) -> None:
        self.step, self.spot = step, spot

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        persister = self.spot.engine.saves.persister if self.spot is not None else None
        if state.global_step == self.step and persister is not None:
            assert persister.wait(timeout=120), "the earlier checkpoints did not settle"


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded weights; a collective (every rank calls it) since FSDP2 parameters are DTensors."""
    weights = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        weights[name] = full.detach().clone()
    return weights


def main() -> int:
    args = parse_args()
    enable_fsdp_on_cpu()
    model = hf_run.build_model()
    if args.dropout != model.config.resid_pdrop:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = args.dropout
    if args.lora:
        import peft

        torch.manual_seed(1)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"]))
    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir.format(node=os.environ.get("GROUP_RANK", "0")), max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        learning_rate=5e-3, lr_scheduler_type="linear", warmup_steps=3, seed=args.seed, data_seed=7,
        save_strategy="no", logging_steps=5, report_to=[], use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True, fsdp=True,
        fsdp_config={"version": args.fsdp_version, "state_dict_type": args.state_dict_type,
                     "transformer_layer_cls_to_wrap": ["GPT2Block"], **fsdp1_on_cpu(args.fsdp_version)},
    )  # fmt: skip
    callbacks: list = [hf_run.RecordSaves()]
    spot = first_step = None
    if args.dirpath:
        from spot_callbacks.hf import PREEMPTED_EXIT_CODE, SpotCheckpointCallback

        spot = SpotCheckpointCallback(
            dirpath=args.dirpath, interval=None, every_n_steps=args.every_n_steps, keep_last=0,
            storage_options=json.loads(args.storage_options), preemption=["SIGTERM"],
        )  # fmt: skip
        callbacks.append(spot)
        callbacks.append(first_step := PersisterAfterFirstStep(spot))
    if args.settle_at_step >= 0:
        callbacks.append(Settle(args.settle_at_step, spot))
    if args.sigterm_at_step >= 0:
        # The step-5 checkpoint commits before the notice: the tests assert which steps are committed.
        callbacks.append(hf_run.SelfSigterm(args.sigterm_at_step, args.sigterm_rank, spot, settle=True))
    trainer = transformers.Trainer(
        model=model, args=training_args, train_dataset=hf_run.TokenData(), callbacks=callbacks
    )
    resume = spot.latest() if spot is not None else args.resume_from
    trainer.train(resume_from_checkpoint=resume)

    weights = full_weights(model)
    rank = training_args.process_index
    out = args.out.format(rank=rank)
    torch.save(weights, out)
    result = {
        "rank": rank,
        "world_size": training_args.world_size,
        "fsdp": trainer.is_fsdp_enabled,
        "wrapped": type(trainer.model_wrapped).__name__,
        "global_step": trainer.state.global_step,
        "preempted": bool(spot and spot.preempted),
        "resumed_from": resume,
        "persister_after_first_step": first_step.seen if first_step is not None else None,
        # The Trainer's saves (on_save) and the callback's staged ones, which the Trainer never sees.
        "saves": sorted(callbacks[0].steps + (spot._staged.submitted_steps if spot else [])),
        # Sharded: the checkpoints that took the state dicts (FSDP1: collective), and whether FSDP1's
        # later ones staged flat shards instead.
        "state_dict_builds": spot._staged.handles.builds if spot else None,
        "fsdp1_flat_plan": bool(spot and spot._staged.handles.fsdp1.plan is not None),
    }
    print_line(result)
    Path(f"{out}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank has written its result before any exits
        # Gloo's worker threads still alive at interpreter exit abort the process (SIGABRT,
        # "terminate called without an active exception"): torch asks scripts to destroy it.
        torch.distributed.destroy_process_group()
    return PREEMPTED_EXIT_CODE if spot and spot.preempted else 0


if __name__ == "__main__":
    code = main()
    # Even with the process group destroyed, a rank of a plain FSDP1 / FSDP2 run on gloo (no callback
    # in it) aborted at interpreter exit twice in CI ("terminate called without an active exception"),
    # after its results were written. The results are on disk and the exit code says the rest.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
