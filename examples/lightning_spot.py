"""Train a small Lightning model on a spot instance with SpotCheckpoint.

Run it, stop it with `kill -TERM <pid>` (what a spot reclaim sends) or let the cloud do it, and
run it again: it continues from the newest committed checkpoint, on this machine or on a fresh
one with an empty disk, exactly where it stopped.

    python examples/lightning_spot.py                           # checkpoints in spot_runs/lightning
    python examples/lightning_spot.py --dirpath s3://bucket/runs/demo
    python examples/lightning_spot.py --dirpath s3://bucket/runs/demo \\
        --storage-options '{"endpoint_url": "http://127.0.0.1:9000"}'
    spot-callbacks ls spot_runs/lightning                        # what is committed

The same run from YAML, with LightningCLI: examples/lightning_cli.yaml.

Exit codes: 0 when training finished; 143 (128 + SIGTERM) when it stopped for a preemption
after committing an emergency checkpoint, so a scheduler can tell "resume me" from "done".
"""

from __future__ import annotations

import argparse
import json

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from spot_callbacks.lightning import SpotCheckpoint


class Regressor(pl.LightningModule):
    """A small MLP with dropout and a per-step LR schedule: what a resume must get exactly right."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(width, 1)
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=self.trainer.estimated_stepping_batches
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def synthetic_data(samples: int = 8192) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)  # the same data set on every machine
    x = torch.randn(samples, 32, generator=generator)
    y = torch.sin(x[:, :1] * 3) + x[:, 1:2] ** 2 + 0.05 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dirpath", default="spot_runs/lightning", help="fsspec URL or local folder")
    parser.add_argument("--storage-options", default=None, help="JSON object passed to fsspec")
    parser.add_argument("--interval", default="30s", help="time between checkpoints: 90s, 15min, 1h, auto")
    parser.add_argument("--every-n-steps", type=int, default=None)
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    pl.seed_everything(args.seed)
    spot = SpotCheckpoint(
        dirpath=args.dirpath,
        interval=args.interval,
        every_n_steps=args.every_n_steps,
        storage_options=json.loads(args.storage_options) if args.storage_options else None,
    )
    loader = DataLoader(synthetic_data(), batch_size=64, shuffle=True)
    trainer = pl.Trainer(max_epochs=args.max_epochs, callbacks=[spot], accelerator="auto", logger=False)
    # "latest": the newest committed checkpoint of --dirpath, or a fresh start when there is none.
    trainer.fit(Regressor(), loader, ckpt_path="latest")
    newest = spot.store.latest()
    print(f"done: newest committed checkpoint is step {newest.step} at {newest.url}" if newest else "done")


if __name__ == "__main__":
    main()
