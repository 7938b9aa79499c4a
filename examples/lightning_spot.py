"""Train a small Lightning model on a spot instance with SpotCheckpoint.

Run it: it prints its PID and the command that stops it as a spot reclaim would,
`kill -TERM <pid>` (from another terminal). It commits an emergency checkpoint, exits
with code 143, and running the same command again continues from that checkpoint ("resumed from
step N"), on this machine or on a fresh one with an empty disk, exactly where it stopped. The
default run is 4,000 steps of a 1M-parameter MLP, about a minute on a laptop CPU, with a
checkpoint every 10 s (about 13 MB each), so there is time to interrupt it and see the resume.

    python examples/lightning_spot.py                           # checkpoints in spot_runs/lightning
    python examples/lightning_spot.py --dirpath s3://bucket/runs/demo
    python examples/lightning_spot.py --dirpath s3://bucket/runs/demo \\
        --storage-options '{"endpoint_url": "http://127.0.0.1:9000"}'
    python examples/lightning_spot.py --max-steps 400 --width 256 --every-n-steps 50   # a quick run
    spot-callbacks ls spot_runs/lightning                        # what is committed

Options: --dirpath, --storage-options (JSON), --interval (90s, 15min, 1h30, auto; default 10s),
--every-n-steps, --max-steps (default 4000), --max-epochs (default: as many as --max-steps
needs), --width (hidden units, default 1024: wider is slower per step and a bigger checkpoint),
--seed. Delete --dirpath (or pass a new one) to start over.

The same run from YAML, with LightningCLI: examples/lightning_cli.yaml.

Exit codes: 0 when training finished; 143 (128 + SIGTERM) when it stopped for a preemption
after committing an emergency checkpoint, so a scheduler can tell "resume me" from "done".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from spot_callbacks import SpotError
from spot_callbacks.lightning import SpotCheckpoint


class Regressor(pl.LightningModule):
    """An MLP with dropout and a per-step LR schedule: what a resume must get exactly right."""

    def __init__(self, width: int = 1024) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Dropout(0.1),
            torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Dropout(0.1),
            torch.nn.Linear(width, 1),
        )  # fmt: skip

    def on_train_start(self) -> None:
        # After ckpt_path="latest" has restored the loops, global_step is the committed step.
        if self.trainer.global_step and self.trainer.is_global_zero:
            step, last = self.trainer.global_step, self.trainer.max_steps
            print(f"resumed from step {step} of {last}: {last - step} steps to go", flush=True)

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
    parser.add_argument("--interval", default="10s", help="time between checkpoints: 90s, 15min, 1h30, auto")
    parser.add_argument("--every-n-steps", type=int, default=None, help="also checkpoint every N steps")
    parser.add_argument("--max-steps", type=int, default=4000, help="optimizer steps of the whole run")
    parser.add_argument("--max-epochs", type=int, default=None, help="default: as many as --max-steps needs")
    parser.add_argument(
        "--width", type=int, default=1024, help="hidden units: time per step, checkpoint size"
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="a line per checkpoint, and a traceback with an error"
    )
    args = parser.parse_args()

    pl.seed_everything(args.seed)
    spot = SpotCheckpoint(
        dirpath=args.dirpath,
        interval=args.interval,
        verbose=args.verbose,
        every_n_steps=args.every_n_steps,
        storage_options=json.loads(args.storage_options) if args.storage_options else None,
    )
    loader = DataLoader(synthetic_data(), batch_size=64, shuffle=True)
    epochs = args.max_epochs if args.max_epochs is not None else math.ceil(args.max_steps / len(loader))
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        max_epochs=epochs,
        callbacks=[spot],
        accelerator="auto",
        logger=False,
    )
    if os.environ.get("LOCAL_RANK", "0") == "0":  # once, not once per DDP process
        announce_how_to_interrupt()
    # "latest": the newest committed checkpoint of --dirpath, or a fresh start when there is none.
    trainer.fit(Regressor(args.width), loader, ckpt_path="latest")
    newest = spot.store.latest()
    print(f"done: newest committed checkpoint is step {newest.step} at {newest.url}" if newest else "done")


def announce_how_to_interrupt() -> None:
    pid = os.getpid()
    print(
        f"PID {pid}. Interrupt it as a spot reclaim would, from another terminal:\n"
        f"    kill -TERM {pid}\n"
        f"then run the same command again to resume:\n"
        f"    {shlex.join(['python', *sys.argv])}",
        flush=True,
    )


if __name__ == "__main__":
    try:
        main()
    except SpotError as err:  # its one line says the cause and the fix; -v adds the traceback
        if {"-v", "--verbose"} & set(sys.argv[1:]):
            raise
        if not err.said_in_log:
            print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
