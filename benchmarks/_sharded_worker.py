"""One rank of the sharded benchmark (launched by ``benchmarks/sharded.py`` through Lightning's launcher).

An FSDP2 MLP (ModelParallelStrategy, gloo on CPU) trains with SpotCheckpoint every ``--every`` steps.
Around each checkpoint it measures, on every rank: the time the training loop was blocked, the
time until the checkpoint committed, and the peak resident memory (RSS sampled every 2 ms) over
the RSS just before the *first* checkpoint (staging buffers that stay allocated for reuse count).
Writes one ``rank-N.json`` per rank into ``--results``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from spot_callbacks.lightning import SpotCheckpoint
from spot_callbacks.persist import heap

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _train_on  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--dirpath", required=True)
parser.add_argument("--storage-options", default="{}")
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--hidden", type=int, default=4096)
parser.add_argument("--layers", type=int, default=6)
parser.add_argument("--every", type=int, default=3)
parser.add_argument("--steps", type=int, default=9)
parser.add_argument("--gathered", action="store_true")
parser.add_argument("--results", required=True, help="folder for one rank-N.json per rank")
parser.add_argument(
    "--no-saves", action="store_true",
    help="with --train-on: no checkpoint before the end of the run (a control: what RSS does without them)",
)  # fmt: skip
parser.add_argument(
    "--strategy", choices=["fsdp", "fsdp1", "ddp", "single"], default="fsdp",
    help="fsdp: ModelParallelStrategy (FSDP2); fsdp1: FSDPStrategy(state_dict_type='sharded'), each Linear "
    "an FSDP1 unit; ddp: DDPStrategy on gloo; single: one process (give --devices 1)",
)  # fmt: skip
parser.add_argument(
    "--train-on", action="store_true",
    help="training runs on while the writer writes and uploads (no wait for each commit): the hook is "
    "timed from outside, the floor beside each checkpoint, RSS over the whole run (_train_on.py)",
)  # fmt: skip
args = parser.parse_args()


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            *[torch.nn.Linear(args.hidden, args.hidden) for _ in range(args.layers)]
        )

    def configure_model(self) -> None:
        if args.strategy == "fsdp1":  # wrapped here: FSDP1 needs device_id=cpu on the CPU
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            cpu = torch.device("cpu")
            self.layers = FSDP(
                torch.nn.Sequential(*[FSDP(layer, device_id=cpu) for layer in self.layers]), device_id=cpu
            )
        if args.strategy != "fsdp":
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.layers, mesh=mesh)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.layers(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Measure(pl.Callback):
    """Placed around SpotCheckpoint: `before` first in the callback list, `after` last."""

    def __init__(self, spot: SpotCheckpoint, sampler: _train_on.RssWindow) -> None:
        self.spot, self.sampler = spot, sampler
        self.rows: list[dict] = []
        self._started = 0.0
        self._rss_before = 0  # RSS just before the first checkpoint

    def before(self, trainer) -> None:
        rss = self.sampler.reset()
        if not self.rows:  # until the first checkpoint is measured
            self._rss_before = rss
        self._started = time.perf_counter()

    def after(self, trainer) -> None:
        if self.spot.engine.last_saved_step != trainer.global_step or trainer.global_step == 0:
            return
        blocked_s = time.perf_counter() - self._started
        self.spot.engine.wait_for_commit()
        self.rows.append({
            "step": trainer.global_step,
            "blocked_s": blocked_s,
            "committed_s": time.perf_counter() - self._started,
            "peak_extra_bytes": self.sampler.peak - self._rss_before,
        })  # fmt: skip


class Before(pl.Callback):
    def __init__(self, measure: Measure) -> None:
        self.measure = measure

    def on_train_batch_end(self, trainer, *rest) -> None:
        self.measure.before(trainer)


class After(pl.callbacks.Checkpoint):  # Lightning moves Checkpoint callbacks last, in their order
    def __init__(self, measure: Measure) -> None:
        self.measure = measure

    def on_train_batch_end(self, trainer, *rest) -> None:
        self.measure.after(trainer)


def shard_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """This rank's share of the parameters and the optimizer state (what a sharded checkpoint stages)."""
    total = sum(p.to_local().numel() * p.element_size() for p in module.parameters())
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def measure_resume(spot: SpotCheckpoint, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load the newest checkpoint into the live model twice: pulled (verified) then read, and read through
    DCP's fsspec reader straight from the store (no checksums). Every rank, timed between barriers."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    def target() -> dict:
        return {
            "state_dict": get_model_state_dict(module),
            "optimizer_0": get_optimizer_state_dict(module, optimizer),
        }

    step = spot.store.latest().step
    dist.barrier()
    started = time.perf_counter()
    folder = spot.engine.pull_latest(dest=lambda step: Path(args.results) / f"pulled-{step}")
    pulled_s = time.perf_counter() - started
    dcp.load(target(), checkpoint_id=folder)
    dist.barrier()
    pull_and_load_s = time.perf_counter() - started
    started = time.perf_counter()
    reader = FsspecReader(spot.store.step_url(step), **json.loads(args.storage_options))
    dcp.load(target(), storage_reader=reader)
    dist.barrier()
    return {
        "pull_s": pulled_s,
        "pull_and_load_s": pull_and_load_s,
        "fsspec_reader_s": time.perf_counter() - started,
    }


class TrainOn(pl.Callback):
    """First in the list: the step the hook's time goes to, the floor beside each checkpoint, the RSS windows."""

    def __init__(self, spot: SpotCheckpoint, clock: _train_on.HookClock, rss: _train_on.RssWindow) -> None:
        self.spot, self.clock, self.rss = spot, clock, rss
        self.floor: _train_on.Floor | None = None
        self.baseline = 0  # peak RSS over plain steps before the first checkpoint
        self.heap_baseline: int | None = None  # peak heap in use over the same steps
        self.prepared_bytes = 0  # staging buffers allocated before the first checkpoint
        self.waits: dict[int, float] = {}
        self.train_peak = 0  # peak RSS from the first checkpoint through the last step (before the run's end)
        self.staging_bytes = 0  # staging buffers held at the last step

    def on_train_batch_end(self, trainer, pl_module, *rest) -> None:
        step = self.clock.step = trainer.global_step
        tensors = _train_on.local_tensors(pl_module.parameters(), trainer.optimizers[0])
        if self.floor is None:  # after the first step: the optimizer state exists
            self.floor = _train_on.Floor(tensors)
            self.rss.cut()
            # The checkpoint callback allocates its staging buffers in the background from now on:
            # checkpoint memory, kept out of the plain steps' baseline.
            self.rss.discount = lambda: self.spot.engine.staging.buffer_bytes
            return
        _train_on.line_up()
        if step == args.steps:  # a --no-saves control saves at the run's end: not training's memory
            self.train_peak, self.staging_bytes = self.rss.peak, self.spot.engine.staging.buffer_bytes
        if step % args.every == 0 and step < args.steps:
            if not self.floor.seconds:
                self.baseline = self.rss.cut(end_discount=True)
                self.heap_baseline = self.rss.cut_heap
                self.prepared_bytes = self.spot.engine.staging.buffer_bytes
            self.floor.time(step, tensors)
            _train_on.line_up()


class StageWait(pl.callbacks.Checkpoint):  # Lightning moves Checkpoint callbacks last: after SpotCheckpoint
    def __init__(self, spot: SpotCheckpoint, train_on: TrainOn) -> None:
        self.spot, self.train_on = spot, train_on

    def on_train_batch_end(self, trainer, *rest) -> None:
        if trainer.global_step % args.every == 0:
            self.train_on.waits[trainer.global_step] = self.spot.engine.staging.last_wait_s


def cpu_fsdp_strategy() -> Any:
    """FSDPStrategy(state_dict_type="sharded") under another name: Lightning refuses FSDPStrategy itself
    with accelerator="cpu" (by exact type); everything it does is its own."""
    from lightning.pytorch.strategies import FSDPStrategy

    class CPUFSDPStrategy(FSDPStrategy):
        pass

    return CPUFSDPStrategy(state_dict_type="sharded", process_group_backend="gloo")


def main_train_on() -> None:
    from lightning.pytorch.strategies import DDPStrategy

    pl.seed_everything(0)
    rss, clock = _train_on.RssWindow(), _train_on.HookClock(profile_every=args.every)
    spot = SpotCheckpoint(
        dirpath=args.dirpath, interval=None, every_n_steps=10**9 if args.no_saves else args.every,
        keep_last=1, storage_options=json.loads(args.storage_options), preemption=[],
    )  # fmt: skip
    clock.wrap(spot, ["on_train_batch_end"])
    train_on = TrainOn(spot, clock, rss)
    data = TensorDataset(torch.randn(args.steps * 4 * args.devices, args.hidden))
    strategy: Any = (
        DDPStrategy(process_group_backend="gloo") if args.strategy == "ddp"
        else "auto" if args.strategy == "single"
        else cpu_fsdp_strategy() if args.strategy == "fsdp1"
        else ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    )  # fmt: skip
    trainer = pl.Trainer(
        max_steps=args.steps, callbacks=[train_on, spot, StageWait(spot, train_on)], logger=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=args.devices,
        strategy=strategy,
    )  # fmt: skip
    model = Net()
    trainer.fit(model, DataLoader(data, batch_size=4))  # on_train_end waits for the last commit
    extra = rss.cut() - train_on.baseline
    heap_peak, heap_baseline = rss.cut_heap, train_on.heap_baseline
    heap_extra = None if heap_peak is None or heap_baseline is None else heap_peak - heap_baseline
    clock.dump_profile(trainer.global_rank)
    assert train_on.floor is not None
    plain_s, rows = _train_on.checkpoint_rows(clock, train_on.floor, args.every, args.steps)
    for row in rows:
        row["stage_wait_s"] = train_on.waits.get(row["step"], 0.0)
    result = {
        "rank": trainer.global_rank, "mode": f"lightning-{args.strategy}", "shard_bytes": train_on.floor.nbytes,
        "plain_hooks_s": plain_s, "rows": rows, "extra_rss_bytes": extra, "extra_heap_bytes": heap_extra,
        "baseline_rss_bytes": train_on.baseline, "peak_rss_bytes": train_on.baseline + extra,
        "train_peak_rss_bytes": train_on.train_peak, "staging_bytes": train_on.staging_bytes,
        "prepared_bytes": train_on.prepared_bytes, "prepared_used": getattr(spot.engine.staging, "prepared_buffers_used", 0),
        "shard_handle_builds": spot._shard_handles.builds, "trims_s": list(heap.RECENT_TRIMS_S),
    }  # fmt: skip
    with open(os.path.join(args.results, f"rank-{trainer.global_rank}.json"), "w") as handle:
        json.dump(result, handle)


def main() -> None:
    if args.train_on:
        return main_train_on()
    pl.seed_everything(0)
    sampler = _train_on.RssWindow()
    spot = SpotCheckpoint(
        dirpath=args.dirpath, interval=None, every_n_steps=args.every, keep_last=1,
        storage_options=json.loads(args.storage_options), preemption=[],
    )  # fmt: skip
    measure = Measure(spot, sampler)
    data = TensorDataset(torch.randn(args.steps * 4 * args.devices, args.hidden))
    trainer = pl.Trainer(
        max_steps=args.steps, callbacks=[Before(measure), spot, After(measure)], logger=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=args.devices,
        strategy=ModelParallelStrategy(
            data_parallel_size=args.devices, tensor_parallel_size=1, save_distributed_checkpoint=not args.gathered
        ),
    )  # fmt: skip
    model = Net()
    trainer.fit(model, DataLoader(data, batch_size=4))
    resume = {} if args.gathered else measure_resume(spot, model, trainer.optimizers[0])
    result = {
        "resume": resume,
        "rank": trainer.global_rank, "mode": "gathered" if args.gathered else "sharded",
        "shard_bytes": shard_bytes(model.layers, trainer.optimizers[0]), "rows": measure.rows,
    }  # fmt: skip
    with open(os.path.join(args.results, f"rank-{trainer.global_rank}.json"), "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # gloo's threads can abort the exit otherwise
