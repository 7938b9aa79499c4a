"""One rank of the HF FSDP benchmark (launched by ``benchmarks/hf_fsdp.py`` under torchrun).

The MLP of ``_sharded_worker.py`` (the same sizes as Lightning's sharded row) as a Hugging Face
Trainer model under accelerate's FSDP2 plugin (SHARDED_STATE_DICT, gloo on CPU: the one line of
``tests/scripts/hf_fsdp_run.py`` that lets accelerate take its FSDP path there), checkpointed by
SpotCheckpointCallback every ``--every`` steps: staged (the default), or through the Trainer's own
save (``SPOT_HF_SAVE=trainer`` in the environment). Around each checkpoint, on every rank:

- *blocked*: from the first callback's ``on_step_end`` of a checkpoint step to the last callback's
  ``on_step_begin`` of the next step (the Trainer's save, or the snapshot and its submission), less
  the median of the same span at steps without a checkpoint;
- *until committed*: from the same start until ``engine.wait_for_commit()`` returns;
- *peak extra RSS*: the highest resident memory until the commit over the RSS just before the first
  checkpoint (staging buffers kept for reuse count).

With ``--floor`` it also times the floor at every checkpoint, just before the checkpoint's own span
starts (side by side, under the same load): ``copy_`` of this rank's local shards of every
parameter and optimizer tensor into buffers allocated (and touched) once, before the RSS baseline.
Writes ``rank-N.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "scripts"))
from hf_fsdp_run import enable_fsdp_on_cpu, fsdp1_on_cpu  # noqa: E402

from spot_callbacks.hf import SpotCheckpointCallback  # noqa: E402
from spot_callbacks.persist import heap  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _trace  # noqa: E402
import _train_on  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--dirpath", required=True)
parser.add_argument("--storage-options", default="{}")
parser.add_argument("--hidden", type=int, default=4096)
parser.add_argument("--layers", type=int, default=6)
parser.add_argument("--every", type=int, default=3)
parser.add_argument("--steps", type=int, default=9)
parser.add_argument("--floor", action="store_true")
parser.add_argument(
    "--train-on", action="store_true",
    help="training runs on while the writer writes and uploads (no wait for each commit): the hooks "
    "are timed from outside, the floor beside each checkpoint, RSS over the whole run (_train_on.py)",
)  # fmt: skip
parser.add_argument(
    "--parallel", choices=["fsdp2", "fsdp1", "ddp", "single"], default="fsdp2",
    help="with --train-on: accelerate's FSDP2 or FSDP1 plugin (SHARDED_STATE_DICT), DDP (torchrun, no "
    "FSDP), or one process (plain python)",
)  # fmt: skip
parser.add_argument("--output-dir", required=True)
parser.add_argument(
    "--no-saves", action="store_true",
    help="with --train-on: no checkpoint before the end of the run (a control: what RSS does without them)",
)  # fmt: skip
parser.add_argument("--results", required=True, help="folder for one rank-N.json per rank")
args = parser.parse_args()


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            *[torch.nn.Linear(args.hidden, args.hidden) for _ in range(args.layers)]
        )

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.layers(x).pow(2).mean()}


class Inputs(torch.utils.data.Dataset):
    def __init__(self, count: int) -> None:
        self.x = torch.randn(count, args.hidden, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index]}


class Measure:
    """The spans of every step (first ``on_step_end`` -> last ``on_step_begin`` of the next), and the checkpoints'."""

    def __init__(self, spot: SpotCheckpointCallback, sampler: _train_on.RssWindow) -> None:
        self.spot, self.sampler = spot, sampler
        self.rows: list[dict] = []
        self.plain_spans: list[float] = []
        self._started: float | None = None
        self._step = 0
        self._rss_before = 0

    def step_ended(self, step: int) -> None:
        rss = self.sampler.reset()
        if not self.rows and step % args.every == 0:
            self._rss_before = rss
        self._started, self._step = time.perf_counter(), step

    def next_step_began(self) -> None:
        if self._started is None:
            return
        span_s = time.perf_counter() - self._started
        if self._step % args.every:
            self.plain_spans.append(span_s)
        else:
            self.spot.engine.wait_for_commit()  # every rank: a barrier inside
            self.rows.append({
                "step": self._step, "span_s": span_s, "committed_s": time.perf_counter() - self._started,
                "peak_extra_bytes": self.sampler.peak - self._rss_before,
                "stall_s_measured_by_spot": self.spot.engine.last_stall_s,
            })  # fmt: skip
        self._started = None


class Head(transformers.TrainerCallback):
    def __init__(self, measure: Measure) -> None:
        self.measure = measure
        self.floor_buffers: list[torch.Tensor] | None = None
        self.floors_s: list[float] = []

    def on_step_end(self, args_, state, control, **kwargs):
        if args.floor and state.global_step % args.every == 0:
            tensors = local_tensors(kwargs["model"], kwargs["optimizer"])
            if self.floor_buffers is None:  # touched now, so the copy below adds no resident memory
                self.floor_buffers = [torch.zeros_like(tensor, device="cpu") for tensor in tensors]
            self.floors_s.append(copy_s(self.floor_buffers, tensors))
        self.measure.step_ended(state.global_step)


class Tail(transformers.TrainerCallback):
    def __init__(self, measure: Measure) -> None:
        self.measure = measure

    def on_step_begin(self, args, state, control, **kwargs):
        self.measure.next_step_began()

    def on_train_end(self, args, state, control, **kwargs):
        self.measure.next_step_began()


def local_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's local shards of every parameter and optimizer tensor (what a sharded checkpoint stages)."""
    tensors = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                tensors.append(value.to_local() if hasattr(value, "to_local") else value)
    return [tensor.detach() for tensor in tensors]


def copy_s(buffers: list[torch.Tensor], tensors: list[torch.Tensor]) -> float:
    started = time.perf_counter()
    for buffer, tensor in zip(buffers, tensors, strict=True):
        buffer.copy_(tensor)
    return time.perf_counter() - started


class TrainOn(transformers.TrainerCallback):
    """First in the list: the step the hooks' time goes to, the floor beside each checkpoint, the RSS windows."""

    def __init__(
        self, spot: SpotCheckpointCallback, clock: _train_on.HookClock, rss: _train_on.RssWindow
    ) -> None:
        self.spot, self.clock, self.rss = spot, clock, rss
        self.floor: _train_on.Floor | None = None
        self.baseline = 0  # peak RSS over plain steps before the first checkpoint
        self.heap_baseline: int | None = None  # peak heap in use over the same steps
        self.prepared_bytes = 0  # staging buffers allocated before the first checkpoint
        self.waits: dict[int, float] = {}
        self.train_peak = 0  # peak RSS from the first checkpoint through the last step (before the run's end)
        self.staging_bytes = 0  # staging buffers held at the last step

    def on_step_end(self, args_, state, control, **kwargs):
        step = self.clock.step = state.global_step
        tensors = _train_on.local_tensors(kwargs["model"].parameters(), kwargs["optimizer"])
        if self.floor is None:  # after the first step: the optimizer state exists
            self.floor = _train_on.Floor(tensors)
            self.rss.cut()
            # The checkpoint callback allocates its staging buffers in the background from now on:
            # checkpoint memory, kept out of the plain steps' baseline.
            self.rss.discount = lambda: self.spot.engine.staging.buffer_bytes
            return
        _train_on.line_up()
        if step == state.max_steps:  # a --no-saves control saves at the run's end: not training's memory
            self.train_peak, self.staging_bytes = self.rss.peak, self.spot.engine.staging.buffer_bytes
        if step % args.every == 0 and step < state.max_steps:
            _train_on.dump_heap(f"before checkpoint {step}")
            if not self.floor.seconds:
                self.baseline = self.rss.cut(end_discount=True)
                self.heap_baseline = self.rss.cut_heap
                self.prepared_bytes = self.spot.engine.staging.buffer_bytes
            self.floor.time(step, tensors)
            _train_on.line_up()


class StageWait(transformers.TrainerCallback):
    """After the checkpoint callback: how long its stage waited for the previous write (0: it did not)."""

    def __init__(self, spot: SpotCheckpointCallback, train_on: TrainOn) -> None:
        self.spot, self.train_on = spot, train_on

    def on_step_end(self, args_, state, control, **kwargs):
        if state.global_step % args.every == 0:
            self.train_on.waits[state.global_step] = self.spot.engine.staging.last_wait_s


def main_train_on() -> None:
    enable_fsdp_on_cpu()
    torch.manual_seed(0)
    rss, clock = _train_on.RssWindow(), _train_on.HookClock(profile_every=args.every)
    trace = _trace.install(lambda: clock.step)  # SPOT_BENCH_TRACE: before the hooks are wrapped
    spot = SpotCheckpointCallback(
        dirpath=args.dirpath, interval=None, every_n_steps=10**9 if args.no_saves else args.every,
        keep_last=1, storage_options=json.loads(args.storage_options), preemption=[],
    )  # fmt: skip
    clock.wrap(spot, ["on_step_begin", "on_step_end", "on_log", "on_evaluate", "on_save"])
    train_on = TrainOn(spot, clock, rss)
    sharding: dict = {}
    if args.parallel.startswith("fsdp"):
        version = int(args.parallel[-1])
        sharding = {
            "fsdp": True,
            "fsdp_config": {
                "version": version, "state_dict_type": "SHARDED_STATE_DICT",
                "transformer_layer_cls_to_wrap": ["Linear"], **fsdp1_on_cpu(version),
            },
        }  # fmt: skip
    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=4, learning_rate=1e-4,
        save_strategy="no", logging_steps=10**6, report_to=[], use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True, **sharding,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=Mlp(), args=training_args, train_dataset=Inputs(args.steps * 4 * training_args.world_size),
        callbacks=[train_on, spot, StageWait(spot, train_on)],
    )  # fmt: skip
    trainer.train()  # on_train_end waits for the last commit: inside the RSS window
    extra = rss.cut() - train_on.baseline
    heap_peak, heap_baseline = rss.cut_heap, train_on.heap_baseline
    heap_extra = None if heap_peak is None or heap_baseline is None else heap_peak - heap_baseline
    _train_on.dump_heap("after train")
    clock.dump_profile(training_args.process_index)
    assert train_on.floor is not None
    plain_s, rows = _train_on.checkpoint_rows(clock, train_on.floor, args.every, args.steps)
    for row in rows:
        row["stage_wait_s"] = train_on.waits.get(row["step"], 0.0)
    rank = training_args.process_index
    result = {
        "rank": rank, "mode": f"hf-{args.parallel}", "fsdp": trainer.is_fsdp_enabled, "shard_bytes": train_on.floor.nbytes,
        "plain_hooks_s": plain_s, "rows": rows, "extra_rss_bytes": extra, "extra_heap_bytes": heap_extra,
        "baseline_rss_bytes": train_on.baseline, "peak_rss_bytes": train_on.baseline + extra,
        "train_peak_rss_bytes": train_on.train_peak, "staging_bytes": train_on.staging_bytes,
        "prepared_bytes": train_on.prepared_bytes, "prepared_used": getattr(spot.engine.staging, "prepared_buffers_used", 0),
        "shard_handle_builds": spot._staged.handles.builds, "trims_s": list(heap.RECENT_TRIMS_S),
        "trace": trace.per_step() if trace is not None else None,
    }  # fmt: skip
    with open(os.path.join(args.results, f"rank-{rank}.json"), "w") as handle:
        json.dump(result, handle)


def main() -> None:
    if args.train_on:
        return main_train_on()
    enable_fsdp_on_cpu()
    torch.manual_seed(0)
    sampler = _train_on.RssWindow()
    spot = SpotCheckpointCallback(
        dirpath=args.dirpath, interval=None, every_n_steps=args.every, keep_last=1,
        storage_options=json.loads(args.storage_options), preemption=[],
    )  # fmt: skip
    measure = Measure(spot, sampler)
    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=4, learning_rate=1e-4,
        save_strategy="no", logging_steps=10**6, report_to=[], use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True, fsdp=True,
        fsdp_config={"version": 2, "state_dict_type": "SHARDED_STATE_DICT", "transformer_layer_cls_to_wrap": ["Linear"]},
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=Mlp(), args=training_args, train_dataset=Inputs(args.steps * 4 * training_args.world_size),
        callbacks=[head := Head(measure), spot, Tail(measure)],
    )  # fmt: skip
    trainer.train()
    tensors = local_tensors(trainer.model, trainer.optimizer)
    rank = training_args.process_index
    plain_s = statistics.median(measure.plain_spans) if measure.plain_spans else 0.0
    result = {
        "rank": rank,
        "mode": f"hf-{os.environ.get('SPOT_HF_SAVE', 'staged')}",
        "fsdp": trainer.is_fsdp_enabled,
        "shard_bytes": sum(tensor.numel() * tensor.element_size() for tensor in tensors),
        "plain_span_s": plain_s,
        "rows": [{**row, "blocked_s": max(row["span_s"] - plain_s, 0.0)} for row in measure.rows],
        "floors_s": head.floors_s if args.floor else None,  # one per checkpoint, as the rows
    }
    with open(os.path.join(args.results, f"rank-{rank}.json"), "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # gloo's threads can abort the exit otherwise
