"""A Lightning fit with ``ckpt_path="latest"`` and Lightning's rich bar, as a user starts it on a terminal
(run under a pseudo-terminal by tests/test_markup_names.py): ``markup_resume.py DIRPATH MAX_STEPS SLOW_S``.

``SLOW_S`` > 0: every file the resume pulls stays in flight that long after its bytes landed (a slow
link), so the pull bars draw a bar named after each payload file of the store."""

from __future__ import annotations

import sys
import time

import lightning.pytorch as pl
from fsspec.implementations.local import LocalFileSystem
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.demos.boring_classes import BoringModel

from spot_callbacks.lightning import SpotCheckpoint

dirpath, max_steps, slow_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
if slow_s > 0:
    real_get_file = LocalFileSystem.get_file

    def slow_get_file(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        real_get_file(self, *args, **kwargs)
        time.sleep(slow_s)  # the link's pace, not a synchronisation

    LocalFileSystem.get_file = slow_get_file  # type: ignore[method-assign]


class StartingStep(pl.Callback):
    def on_train_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        print(f"markup_resume: starting at step {trainer.global_step}", flush=True)


spot = SpotCheckpoint(dirpath=dirpath, interval=None, every_n_steps=2, keep_last=1, preemption=[])
trainer = pl.Trainer(
    max_steps=max_steps, limit_val_batches=0, callbacks=[spot, RichProgressBar(refresh_rate=1), StartingStep()],
    logger=False, enable_model_summary=False, accelerator="cpu", devices=1,
)  # fmt: skip
trainer.fit(BoringModel(), ckpt_path="latest")
print(f"markup_resume: done at step {trainer.global_step}", flush=True)
