"""Train an FSDP2-sharded model with SpotCheckpoint: every rank persists its own shards.

With ``ModelParallelStrategy`` no rank holds the whole state. SpotCheckpoint notices the sharded
strategy and checkpoints through torch.distributed.checkpoint: each rank stages and uploads its
shards in the background, rank 0 commits once all are durable. Resume on any number of
processes: DCP reshards.

    python examples/lightning_fsdp.py                                  # 2 CPU processes (gloo)
    python examples/lightning_fsdp.py --devices 1                      # the same run, resharded
    python examples/lightning_fsdp.py --accelerator gpu --devices 8 --dirpath s3://bucket/runs/fsdp
    spot-callbacks ls spot_runs/fsdp                                   # every rank's files, one manifest
"""

from __future__ import annotations

import argparse
import json

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from spot_callbacks.lightning import SpotCheckpoint


class ShardedMLP(pl.LightningModule):
    def __init__(self, width: int = 512, depth: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.layers:
            fully_shard(layer, mesh=mesh)  # each layer's parameters are split over the ranks
        fully_shard(self.layers, mesh=mesh)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return torch.nn.functional.mse_loss(self.layers(x), x)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dirpath", default="spot_runs/fsdp")
    parser.add_argument("--storage-options", default="{}", help="JSON for fsspec (endpoint, ...)")
    parser.add_argument("--interval", default="10min")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=200)
    args = parser.parse_args()

    pl.seed_everything(0)
    data = TensorDataset(torch.randn(4096, 512))
    spot = SpotCheckpoint(
        dirpath=args.dirpath, interval=args.interval, storage_options=json.loads(args.storage_options)
    )
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1),
        max_steps=args.max_steps,
        callbacks=[spot],
        logger=False,
    )
    # The same global batch on any number of processes: 32 rows per step in all.
    trainer.fit(
        ShardedMLP(), DataLoader(data, batch_size=32 // args.devices, shuffle=True), ckpt_path="latest"
    )
    raise SystemExit(143 if spot.preempted else 0)


if __name__ == "__main__":
    main()
