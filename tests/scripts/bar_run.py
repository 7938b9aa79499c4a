"""A tiny Lightning fit with a progress bar on screen (run under a pseudo-terminal by
tests/test_bar_lines.py): ``bar_run.py DIRPATH tqdm|rich verbose|quiet``."""

from __future__ import annotations

import sys

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.demos.boring_classes import BoringModel

from spot_callbacks.lightning import SpotCheckpoint

dirpath, bar_kind, loudness = sys.argv[1:4]
bar = TQDMProgressBar(refresh_rate=1) if bar_kind == "tqdm" else RichProgressBar(refresh_rate=1)
spot = SpotCheckpoint(
    dirpath=dirpath, interval=None, every_n_steps=2, keep_last=1, preemption=[], verbose=loudness == "verbose"
)
trainer = pl.Trainer(
    max_steps=24, limit_val_batches=0, callbacks=[spot, bar], logger=False, enable_model_summary=False,
    accelerator="cpu", devices=1,
)  # fmt: skip
trainer.fit(BoringModel(), ckpt_path="latest")
print("bar_run: done", flush=True)
