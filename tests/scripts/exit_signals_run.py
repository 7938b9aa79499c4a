"""A Lightning run whose final checkpoint upload is held until the test says so (run as a subprocess).

The store is the local folder ``--dirpath`` behind a wrapper: the upload of the end checkpoint's
payload prints ``UPLOADING <step>`` and then waits for a line on stdin (the test sends its signal
in between, then the line). ``--hang`` never lets that upload finish (a hung store), and
``--hold-write`` instead holds the writer thread inside the state file's write (with ``--hang``: for good).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import sys
import threading

import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel

from spot_callbacks import saving as jobs
from spot_callbacks.lightning import SpotCheckpoint

# Registered before the library's own exit hook, so it runs after it: how many objects the exit left
# uncollected (exit_guard).
atexit.register(lambda: print(f"GC FROZEN AT EXIT {gc.get_freeze_count()}", flush=True))

parser = argparse.ArgumentParser()
parser.add_argument("--dirpath", required=True)
parser.add_argument("--scratch", required=True)
parser.add_argument("--max-steps", type=int, default=6)
parser.add_argument("--every-n-steps", type=int, default=None)
parser.add_argument("--hang", action="store_true")
parser.add_argument("--hold-write", action="store_true")
parser.add_argument("--preemption", default="SIGTERM", help="'auto', or signal names separated by commas")
parser.add_argument("--ready-at", type=int, default=-1, help="print READY <step> as this step starts")
args = parser.parse_args()


def hold(what: str, step: int) -> None:
    print(f"{what} {step}", flush=True)
    if args.hang:
        threading.Event().wait()  # a store that never answers
    sys.stdin.readline()


class HeldUploads:
    """The real local filesystem; the upload of the last step's payload is held (see the module doc)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_file(self, lpath, rpath, *a, **kw):
        if f"step-{args.max_steps:09d}" in rpath and not rpath.endswith(".json"):
            hold("UPLOADING", args.max_steps)
        return self.inner.put_file(lpath, rpath, *a, **kw)


class Ready(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == args.ready_at:
            print(f"READY {trainer.global_step}", flush=True)


preemption = args.preemption if args.preemption == "auto" else args.preemption.split(",")
spot = SpotCheckpoint(dirpath=args.dirpath, interval=None, every_n_steps=args.every_n_steps, keep_last=0,
                      preemption=preemption, scratch_dir=args.scratch)  # fmt: skip
if args.hold_write:
    real_write = jobs.write_state

    def held_write(staged, target):
        if f"step-{args.max_steps:09d}" in str(target):
            hold("WRITING", args.max_steps)
        return real_write(staged, target)

    jobs.write_state = held_write
else:
    spot.store.fs = HeldUploads(spot.store.fs)
trainer = pl.Trainer(callbacks=[spot, Ready()], logger=False, enable_progress_bar=False, enable_model_summary=False,
                     max_steps=args.max_steps, accelerator="cpu")  # fmt: skip
trainer.fit(BoringModel(), ckpt_path="latest")
print("FIT RETURNED", flush=True)
