"""A Lightning run whose steps take a known time, for the report's billed-time test (a subprocess).

argv: dirpath, steps, seconds per step, checkpoint every n steps. Prints ``step <global_step> <unix time>``
at every step boundary (flushed), so a test can kill it at a step and measure from outside what was lost.
"""

from __future__ import annotations

import sys
import time

import torch
from lightning import pytorch as pl
from torch.utils.data import DataLoader, TensorDataset

from spot_callbacks.lightning import SpotCheckpoint

dirpath, steps, step_s, every = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])


class Paced(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        time.sleep(step_s)  # the work of a step: a known, steady time
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class PrintSteps(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        print(f"step {trainer.global_step} {time.time():.3f}", flush=True)


torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4)
spot = SpotCheckpoint(dirpath=dirpath, interval=None, every_n_steps=every, preemption=[])
trainer = pl.Trainer(
    max_steps=steps, callbacks=[spot, PrintSteps()], logger=False, enable_progress_bar=False,
    enable_model_summary=False, accelerator="cpu", devices=1,
)  # fmt: skip
trainer.fit(Paced(), loader, ckpt_path="latest")
print("done", flush=True)
