"""A small FSDP2 Lightning run (ModelParallelStrategy, gloo on CPU) for the sharded-checkpoint tests.

The global batch is the same for any number of processes (each takes ``--global-batch / devices``
rows, and DistributedSampler's shuffle does not depend on the world size), so runs on 1, 2 or 4
processes train on the same data step by step and end at the same weights up to float rounding.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report_line import print_line  # noqa: E402  (the sibling module)

parser = argparse.ArgumentParser()
parser.add_argument("--dirpath")
parser.add_argument("--out", required=True)
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--global-batch", type=int, default=32)
parser.add_argument("--max-epochs", type=int, default=2)
parser.add_argument("--every-n-steps", type=int, default=None)
parser.add_argument("--sigterm-at-step", type=int, default=-1)
parser.add_argument("--storage-options", default="{}")
parser.add_argument("--hidden", type=int, default=64)
parser.add_argument("--gathered", action="store_true", help="save_distributed_checkpoint=False")
parser.add_argument("--keep-last", type=int, default=2)
parser.add_argument("--own-save-at-step", type=int, default=-1, help="also trainer.save_checkpoint there")
parser.add_argument(
    "--fsdp1", action="store_true", help="FSDPStrategy(state_dict_type='sharded'): FSDP1 units"
)
args = parser.parse_args()


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(16, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, 1)
        )

    def configure_model(self) -> None:
        if args.fsdp1:  # each Linear and the stack an FSDP1 unit, on the CPU (FSDP1 needs device_id there)
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            for index, layer in enumerate(self.layers):
                if isinstance(layer, torch.nn.Linear):
                    self.layers[index] = FSDP(layer, device_id=torch.device("cpu"))
            self.layers = FSDP(self.layers, device_id=torch.device("cpu"))
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.layers:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.layers, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layers(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class SelfSigterm(pl.Callback):
    def __init__(self, step: int, spot) -> None:
        self.step, self.spot, self.sent = step, spot, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and trainer.global_rank == 0 and not self.sent:
            self.sent = True
            # The checkpoints before the notice commit first: the emergency one then never overtakes
            # (and drops) one still queued, so which steps are committed does not depend on upload speed.
            persister = self.spot.engine.saves.persister if self.spot is not None else None
            if persister is not None:
                assert persister.wait(timeout=120), "the checkpoints before the SIGTERM did not settle"
            if self.spot is not None:  # how many checkpoints took the state dicts so far
                print_line({"state_dict_builds_before_sigterm": self.spot._shard_handles.builds})
            os.kill(os.getpid(), signal.SIGTERM)


def inject_upload_fault(setting: str) -> None:
    """``kill:RANK:STEP`` (SIGKILL itself) or ``fail:RANK:STEP`` (access denied) on RANK's first upload at
    STEP+; ``scratch:RANK:STEP``: RANK's scratch disk is full when it prepares the folder of STEP only."""
    import errno

    import torch.distributed as dist

    from spot_callbacks.persist.sharded import ShardedPersister
    from spot_callbacks.store import CommitWriter

    action, fault_rank, from_step = setting.split(":")
    if action == "scratch":
        prepare = ShardedPersister._prepare_folder

        def prepare_folder(job):
            if dist.get_rank() == int(fault_rank) and job.step == int(from_step):
                raise OSError(errno.ENOSPC, "No space left on device (injected)", str(job.local_dir))
            return prepare(job)

        ShardedPersister._prepare_folder = staticmethod(prepare_folder)
        return
    original = CommitWriter.upload_file

    def upload_file(self, local_path, step, name, *rest, **options):
        if dist.get_rank() == int(fault_rank) and step >= int(from_step):
            if action == "kill":
                print(f"FAULT: rank {fault_rank} killed uploading {name} of step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            raise PermissionError(f"injected: access denied uploading {name}")
        return original(self, local_path, step, name, *rest, **options)

    CommitWriter.upload_file = upload_file


def strategy():
    if args.fsdp1:
        from lightning.pytorch.strategies import FSDPStrategy

        # Lightning refuses FSDPStrategy itself on accelerator="cpu" (by exact type); everything the
        # strategy does is its own.
        class CPUFSDPStrategy(FSDPStrategy):
            pass

        return CPUFSDPStrategy(state_dict_type="sharded")
    return ModelParallelStrategy(
        data_parallel_size=args.devices, tensor_parallel_size=1, save_distributed_checkpoint=not args.gathered
    )


class OwnSave(pl.Callback):
    """The strategy's own save of the step the callback checkpoints too, for the files to be compared."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(os.path.join(os.path.dirname(args.out), f"own-{self.step}"))


class FullWeightsAtTrainEnd(pl.Callback):
    """FSDP1: the full weights, gathered before the strategy's teardown (which leaves FSDP1 unusable)."""

    weights: dict = {}

    def on_train_end(self, trainer, pl_module):
        type(self).weights = fsdp1_full_weights(pl_module)


def full_weights(trainer, model) -> dict:
    if not args.fsdp1:
        return {k: v.full_tensor().clone() for k, v in model.layers.state_dict().items()}
    return FullWeightsAtTrainEnd.weights


def fsdp1_full_weights(model) -> dict:
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    with FSDP.state_dict_type(model.layers, StateDictType.FULL_STATE_DICT, config):
        state = model.layers.state_dict()
    return {k: v.clone() for k, v in state.items()}


def main() -> int:
    if os.environ.get("SPOT_TEST_UPLOAD_FAULT"):
        inject_upload_fault(os.environ["SPOT_TEST_UPLOAD_FAULT"])
    pl.seed_everything(1)
    data_gen = torch.Generator().manual_seed(1234)
    x = torch.randn(256, 16, generator=data_gen)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(256, 1, generator=data_gen)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.global_batch // args.devices, shuffle=True)
    callbacks: list = []
    spot = None
    if args.dirpath:
        from spot_callbacks.lightning import SpotCheckpoint

        spot = SpotCheckpoint(
            dirpath=args.dirpath, interval=None, every_n_steps=args.every_n_steps, keep_last=args.keep_last,
            storage_options=json.loads(args.storage_options), preemption=["SIGTERM"],
        )  # fmt: skip
        callbacks.append(spot)
    if args.sigterm_at_step >= 0:
        callbacks.append(SelfSigterm(args.sigterm_at_step, spot))
    if args.fsdp1:
        callbacks.append(FullWeightsAtTrainEnd())
    if args.own_save_at_step >= 0:
        callbacks.insert(0, OwnSave(args.own_save_at_step))
    torch.manual_seed(0)
    model = Net()
    trainer = pl.Trainer(
        max_epochs=args.max_epochs, callbacks=callbacks, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=bool(spot), accelerator="cpu", devices=args.devices,
        strategy=strategy(),
        use_distributed_sampler=True,
    )  # fmt: skip
    trainer.fit(model, loader, ckpt_path="latest" if spot else None)
    full = full_weights(trainer, model)
    if trainer.is_global_zero:
        torch.save(full, args.out)
    builds = spot._shard_handles.builds if spot is not None else None
    print_line({"global_step": trainer.global_step, "rank": trainer.global_rank, "state_dict_builds": builds,
                "preempted": bool(spot and spot.preempted)})  # fmt: skip
    return 143 if spot and spot.preempted else 0


if __name__ == "__main__":
    sys.exit(main())
