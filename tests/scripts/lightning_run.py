"""A small Lightning training run for the resume tests (run as a subprocess).

Dropout, a shuffled DataLoader and a per-step LR scheduler: everything that breaks a naive
resume. Sends itself SIGTERM at ``--sigterm-at-step`` (a real signal, mid-epoch by choice).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layers(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class SelfSigterm(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and not getattr(self, "sent", False):
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)  # arrives inside the step, like a real notice


class PrintBatches(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        print(f"BATCH e={trainer.current_epoch} i={batch_idx} g={trainer.global_step} x={batch[0][0, 0].item():.4f}",
              flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dirpath")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sigterm-at-step", type=int, default=-1)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--every-n-steps", type=int, default=None)
    parser.add_argument("--ckpt-path", default="latest")
    parser.add_argument("--storage-options", default="{}")
    args = parser.parse_args()

    pl.seed_everything(args.seed, workers=True)
    torch.manual_seed(args.seed)
    data_gen = torch.Generator().manual_seed(1234)  # the data set itself is fixed
    x = torch.randn(320, 16, generator=data_gen)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(320, 1, generator=data_gen)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, num_workers=args.num_workers)

    callbacks: list = []
    spot = None
    if args.dirpath:
        from spot_callbacks.lightning import SpotCheckpoint

        spot = SpotCheckpoint(
            dirpath=args.dirpath, interval=None, every_n_steps=args.every_n_steps, keep_last=2,
            storage_options=json.loads(args.storage_options),
        )  # fmt: skip
        callbacks.append(spot)
    if os.environ.get("PRINT_BATCHES"):
        callbacks.append(PrintBatches())
    if args.sigterm_at_step >= 0:
        callbacks.append(SelfSigterm(args.sigterm_at_step))
    torch.manual_seed(0)  # the model's initial weights do not depend on --seed
    model = Net()
    torch.manual_seed(args.seed)
    trainer = pl.Trainer(
        max_epochs=args.max_epochs, callbacks=callbacks, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=bool(spot), accelerator="cpu", devices=1,
    )  # fmt: skip
    trainer.fit(model, loader, ckpt_path=args.ckpt_path if spot else None)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out)
    print(json.dumps({"global_step": trainer.global_step, "preempted": bool(spot and spot.preempted)}), flush=True)
    return 143 if spot and spot.preempted else 0


if __name__ == "__main__":
    sys.exit(main())
