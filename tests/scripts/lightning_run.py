"""A small Lightning training run for the resume tests (run as a subprocess).

Dropout, a shuffled DataLoader and a per-step LR scheduler: everything that breaks a naive
resume. Sends itself SIGTERM at ``--sigterm-at-step`` (a real signal, mid-epoch by choice), or
at ``--announce-at-step`` has a test's loopback cloud metadata service (``--announce-url``)
announce a preemption, and waits until the callback's poller has seen it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import urllib.request

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report_line import print_line  # noqa: E402  (the sibling module)

parser = argparse.ArgumentParser()
parser.add_argument("--dirpath")
parser.add_argument("--out", required=True)
parser.add_argument("--seed", type=int, default=1)
parser.add_argument("--sigterm-at-step", type=int, default=-1)
parser.add_argument("--sigterm-rank", type=int, default=0)
parser.add_argument("--announce-at-step", type=int, default=-1)
parser.add_argument("--announce-url")
parser.add_argument("--num-workers", type=int, default=0)
parser.add_argument("--max-epochs", type=int, default=3)
parser.add_argument("--every-n-steps", type=int, default=None)
parser.add_argument("--ckpt-path", default="latest")
parser.add_argument("--storage-options", default="{}")
parser.add_argument("--devices", type=int, default=1)
parser.add_argument("--stateful-loader", action="store_true")
parser.add_argument(
    "--package", default="lightning.pytorch", choices=["lightning.pytorch", "pytorch_lightning"]
)
parser.add_argument("--logger-dir")
parser.add_argument("--verbose", action="store_true", help="log every commit (SpotCheckpoint(verbose=True))")
args = parser.parse_args()

pl = importlib.import_module(args.package)


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


class ResumableLoader:
    """A loader with state_dict()/load_state_dict(), as torchdata's StatefulDataLoader offers."""

    def __init__(self, dataset, batch_size: int) -> None:
        self.dataset, self.batch_size = dataset, batch_size
        self.epoch, self.position, self._resume_at = 0, 0, 0

    def __len__(self) -> int:
        return len(self.dataset) // self.batch_size

    def __iter__(self):
        order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(100 + self.epoch))
        start, self._resume_at = self._resume_at, 0
        for position in range(start, len(self)):
            self.position = position + 1  # batches handed out, as the trainer has them now
            yield self.dataset[order[position * self.batch_size : (position + 1) * self.batch_size]]
        self.epoch += 1

    def state_dict(self):
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state):
        self.epoch, self._resume_at = state["epoch"], state["position"]


class SelfSigterm(pl.Callback):
    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank, self.sent = step, rank, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and trainer.global_rank == self.rank and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)  # arrives inside the step, like a real notice


class AnnounceNotice(pl.Callback):
    def __init__(self, step: int, url: str, spot) -> None:
        self.step, self.url, self.spot, self.sent = step, url, spot, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and not self.sent:
            self.sent = True
            no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            no_proxy.open(urllib.request.Request(self.url, data=b"", method="POST"), timeout=10).read()
            # The notice lands inside this step, as a real one would: the poller reports it now.
            assert self.spot.engine.watcher.wait(timeout=30) is not None, "the poller saw no notice"


class PrintBatches(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        print(
            f"BATCH r={trainer.global_rank} e={trainer.current_epoch} i={batch_idx} g={trainer.global_step} "
            f"x={batch[0][0, 0].item():.4f} rng={torch.get_rng_state().float().sum().item():.0f}",
            flush=True,
        )


def main() -> int:
    pl.seed_everything(args.seed, workers=True)
    data_gen = torch.Generator().manual_seed(1234)  # the data set itself is fixed
    x = torch.randn(320, 16, generator=data_gen)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(320, 1, generator=data_gen)
    dataset = TensorDataset(x, y)
    if args.stateful_loader:
        loader = ResumableLoader(dataset, batch_size=32)
    else:
        loader = DataLoader(dataset, batch_size=32, shuffle=True, num_workers=args.num_workers)

    callbacks: list = []
    spot = None
    if args.dirpath:
        module = (
            "spot_callbacks.lightning"
            if args.package == "lightning.pytorch"
            else "spot_callbacks.pytorch_lightning"
        )
        SpotCheckpoint = importlib.import_module(module).SpotCheckpoint  # noqa: N806
        spot = SpotCheckpoint(
            dirpath=args.dirpath, interval=None, every_n_steps=args.every_n_steps, keep_last=2,
            storage_options=json.loads(args.storage_options), verbose=args.verbose,
        )  # fmt: skip
        callbacks.append(spot)
    if os.environ.get("PRINT_BATCHES"):
        callbacks.append(PrintBatches())
    if args.sigterm_at_step >= 0:
        callbacks.append(SelfSigterm(args.sigterm_at_step, args.sigterm_rank))
    if args.announce_at_step >= 0:
        callbacks.append(AnnounceNotice(args.announce_at_step, args.announce_url, spot))
    torch.manual_seed(0)  # the model's initial weights do not depend on --seed
    model = Net()
    torch.manual_seed(args.seed)
    logger = pl.loggers.CSVLogger(args.logger_dir, name="run") if args.logger_dir else False
    trainer = pl.Trainer(
        max_epochs=args.max_epochs, callbacks=callbacks, logger=logger, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=bool(spot), accelerator="cpu", devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto", log_every_n_steps=1, use_distributed_sampler=True,
    )  # fmt: skip
    trainer.fit(model, loader, ckpt_path=args.ckpt_path if spot else None)
    if trainer.is_global_zero:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out)
    print_line({"global_step": trainer.global_step, "rank": trainer.global_rank,
                "preempted": bool(spot and spot.preempted)})  # fmt: skip
    return 143 if spot and spot.preempted else 0


if __name__ == "__main__":
    sys.exit(main())
