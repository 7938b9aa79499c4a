"""One machine of the goodput replay: a small MLP trained on CPU, resumed the way its variant resumes.

Run by ``replay.py`` in a fresh working directory with its own HOME, TMPDIR, SPOT_SCRATCH and host
name (``REPLAY_HOSTNAME``, patched into ``socket.gethostname`` before the library is imported).
Prints the ``REPLAY`` marker lines ``_replay_outcome.py`` parses; saves the final ``state_dict`` of
the MLP to ``--out`` when training reached ``--steps``. Exits 143 when an emergency checkpoint
stopped it, 0 when done.

Variants: ``spot`` / ``spot-auto`` (SpotCheckpoint, interval 15 s / "auto", ``ckpt_path="latest"``),
``mc`` (ModelCheckpoint every 15 s with save_last + OnExceptionCheckpoint into ``--persist-dir``,
resumed from the newer of last.ckpt and on_exception.ckpt), ``none`` (from scratch);
``hf-spot`` (SpotCheckpointCallback), ``hf-steps`` (save_steps into ``--persist-dir``,
``resume_from_checkpoint=True`` when a checkpoint is there), ``hf-none``.
"""

from __future__ import annotations

import time

SPAWNED = time.time()
print(f"REPLAY SPAWNED {SPAWNED:.6f}", flush=True)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

if os.environ.get("REPLAY_HOSTNAME"):  # each restart is a new machine, with a host name of its own
    _hostname = os.environ["REPLAY_HOSTNAME"]
    socket.gethostname = lambda: _hostname

import torch  # noqa: E402

LIGHTNING = ("spot", "spot-auto", "mc", "none")
HF = ("hf-spot", "hf-steps", "hf-none")
FEATURES = 64
SAMPLES = 4096


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=LIGHTNING + HF, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dirpath", help="the library's store URL")
    parser.add_argument("--storage-options", default="{}")
    parser.add_argument("--persist-dir", help="the persistent volume of the framework's own checkpoints")
    parser.add_argument("--interval-s", type=float, default=15.0)
    parser.add_argument("--save-steps", type=int, default=0, help="hf-steps: steps between saves")
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def mark(kind: str, *values: object) -> None:
    print(" ".join(["REPLAY", kind, *(str(v) for v in values)]), flush=True)


class MLP(torch.nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        blocks: list[torch.nn.Module] = [
            torch.nn.Linear(FEATURES, width),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.1),
        ]
        for _ in range(layers - 1):
            blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*blocks, torch.nn.Linear(width, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        prediction = self.net(x)
        if labels is None:
            return prediction
        return {"loss": torch.nn.functional.mse_loss(prediction, labels), "logits": prediction}


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)  # the data never depend on the attempt
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = torch.sin(x[:, :8].sum(dim=1, keepdim=True)) + 0.1 * torch.randn(SAMPLES, 1, generator=generator)
    return x, y


def new_mlp(args: argparse.Namespace) -> MLP:
    torch.manual_seed(0)
    return MLP(args.width, args.layers)


def save_final(mlp: MLP, out: str) -> None:
    torch.save({k: v.detach().clone() for k, v in mlp.net.state_dict().items()}, out)


# ----------------------------------------------------------------------------------- Lightning
def run_lightning(args: argparse.Namespace) -> int:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = new_mlp(args)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return self.mlp(x, y)["loss"]

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Steps(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *rest: Any) -> None:
            mark("STEP", trainer.global_step, f"{time.time():.6f}")

    callbacks: list[Any] = [Steps()]
    ckpt_path: str | None = None
    spot = None
    if args.variant in ("spot", "spot-auto"):
        from spot_callbacks.lightning import SpotCheckpoint

        spot = SpotCheckpoint(
            dirpath=args.dirpath, interval="auto" if args.variant == "spot-auto" else args.interval_s,
            storage_options=json.loads(args.storage_options),
        )  # fmt: skip
        callbacks.append(spot)
        ckpt_path = "latest"
    elif args.variant == "mc":
        from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

        callbacks += [
            ModelCheckpoint(dirpath=args.persist_dir, train_time_interval=timedelta(seconds=args.interval_s),
                            save_last=True),
            OnExceptionCheckpoint(dirpath=args.persist_dir),
        ]  # fmt: skip
        found = [p for p in (Path(args.persist_dir) / "last.ckpt", Path(args.persist_dir) / "on_exception.ckpt")
                 if p.exists()]  # fmt: skip
        ckpt_path = str(max(found, key=lambda p: p.stat().st_mtime)) if found else None
    x, y = dataset()
    torch.manual_seed(1)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch, shuffle=True)
    module = Module()
    trainer = pl.Trainer(
        max_steps=args.steps, max_epochs=-1, callbacks=callbacks, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=args.variant != "none", accelerator="cpu", devices=1,
    )  # fmt: skip
    mark("READY", f"{time.time():.6f}")
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    if spot is not None and spot.preempted:
        return 143
    if trainer.global_step >= args.steps:
        save_final(module.mlp, args.out)
        mark("DONE", trainer.global_step, f"{time.time():.6f}")
    return 0


# ---------------------------------------------------------------------------------------- HF
def run_hf(args: argparse.Namespace) -> int:
    import transformers

    class Data(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.x, self.y = dataset()

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            return {"x": self.x[index], "labels": self.y[index]}

    class Steps(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            mark("STEP", state.global_step, f"{time.time():.6f}")

    output_dir = args.persist_dir if args.variant == "hf-steps" else str(Path.cwd() / "hf-output")
    training_args = transformers.TrainingArguments(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch, learning_rate=1e-3,
        seed=1, data_seed=7, save_strategy="steps" if args.variant == "hf-steps" else "no",
        save_steps=max(1, args.save_steps), save_total_limit=2, logging_steps=10**9, report_to=[], use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    callbacks: list[Any] = [Steps()]
    spot = None
    if args.variant == "hf-spot":
        from spot_callbacks.hf import SpotCheckpointCallback

        spot = SpotCheckpointCallback(
            dirpath=args.dirpath, interval=args.interval_s, storage_options=json.loads(args.storage_options)
        )
        callbacks.append(spot)
    mlp = new_mlp(args)
    trainer = transformers.Trainer(model=mlp, args=training_args, train_dataset=Data(), callbacks=callbacks)
    resume: str | bool | None = None
    if spot is not None:
        resume = spot.latest()
    elif args.variant == "hf-steps" and any(Path(output_dir).glob("checkpoint-*")):
        resume = True
    mark("READY", f"{time.time():.6f}")
    trainer.train(resume_from_checkpoint=resume)
    if spot is not None and spot.preempted:
        return 143
    if trainer.state.global_step >= args.steps:
        save_final(mlp, args.out)
        mark("DONE", trainer.state.global_step, f"{time.time():.6f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    return run_hf(args) if args.variant in HF else run_lightning(args)


if __name__ == "__main__":
    sys.exit(main())
