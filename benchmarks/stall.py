"""Benchmark: how long the training loop is blocked per checkpoint, vs copying the state in RAM (Lightning or HF).

A ~600 MB training state (a stack of ``Linear(width, width)`` layers, fp32, AdamW: parameters +
two moments) is trained on CPU with a tiny batch and checkpointed every ``--every-n`` steps to a
moto S3 server on loopback. Variants, each a fresh model and trainer per fit; one framework per run:

Lightning (the default; :mod:`_stall_lightning`)

* ``floor-clone`` -- the floor: ``clone()`` of every tensor of the model ``state_dict`` and of the
  optimizer state, in RAM (the previous snapshot is dropped first); nothing is written;
* ``floor-copy`` -- reference only: ``copy_`` of the same tensors into buffers kept between
  checkpoints (a memcpy bound; allocation-free);
* ``spot`` -- ``SpotCheckpoint(every_n_steps=N)``: snapshot in the loop, serialize + upload in
  the background. Beside each of its checkpoints, in the same fit, just before the hook, the
  floor is timed again (``copy_`` into buffers kept for the fit): "hook ÷ floor beside" is the
  per-checkpoint ratio (printed for every checkpoint); "extra RSS ÷ state" is the peak resident
  memory over the rest of the fit (training runs on while the writer writes and uploads) less
  the RSS at the first checkpoint, in units of the state (sampled every 10 ms);
* ``mc-sync`` -- ``ModelCheckpoint(dirpath="s3://...", every_n_train_steps=N)`` (s3fs credentials
  from ``AWS_*`` environment variables);
* ``mc-async`` -- the same with ``Trainer(plugins=[AsyncCheckpointIO()])``.

Hugging Face Trainer (``--variants hf-floor,hf-spot,hf-local,hf-sync``; needs transformers; :mod:`_stall_hf`)

* ``hf-floor`` -- the floor: ``copy_`` of every tensor of the model ``state_dict`` and of the
  optimizer state into buffers kept between checkpoints (allocated at the first); nothing is written;
* ``hf-spot`` -- ``SpotCheckpointCallback``: RAM snapshot; ``checkpoint-N`` written and uploaded in
  the background (``SPOT_HF_SAVE=trainer``: the Trainer's save, then a background upload);
* ``hf-local`` -- the second reference: the Trainer's own save to a local folder;
* ``hf-sync`` -- the Trainer's save + an ``on_save`` that ``fs.put``'s the folder to S3.

**Blocked time** = wall time of the checkpoint inside the training loop (for Lightning: inside the
checkpointing callback's ``on_train_batch_end``; for HF: first ``on_step_end`` → last
``on_save``, or → last ``on_step_end`` where the checkpoint is taken there), with the process CPU time and the CPU other processes used meanwhile. Each interval
of N steps ends with two *quiet* steps and the checkpoint step. Before them (untimed) the previous
checkpoint's background work (upload, async write) is waited for, dirty pages are synced and the
machine is waited on (up to ``--quiet-timeout``) until other processes are quiet, so each
checkpoint starts from an idle pipeline, as with realistic (minutes-long) intervals. Cross-check:
"step excess" = checkpoint step period − median quiet step period. After each fit the bucket is
listed: every remote variant must have left ``--ckpts`` full-size checkpoints (and, for the spot
variants, as many committed manifests); otherwise the variant is flagged. The prefix is deleted
after each fit.

Variants run in rounds, in reverse order on odd rounds, to spread drift and noise. The table
reports medians over all checkpoints of all rounds and the ratio to the floor (``floor-clone`` or
``hf-floor``) measured in the same run (HF: also to ``hf-local``; the first checkpoint of each fit
apart). On a machine other processes load, pass ``--threads 1``:
torch's multi-threaded copies then wait on their slowest thread and vary 10-50×.

Usage::

    python benchmarks/stall.py [--size-mb 600] [--every-n 5] [--ckpts 3] [--rounds 2] [--threads 1]
                               [--variants floor-clone,floor-copy,spot,mc-sync,mc-async] [--no-append]
    python benchmarks/stall.py --variants hf-floor,hf-spot,hf-local,hf-sync   # the Hugging Face Trainer
    python benchmarks/stall.py --quick --results-file /tmp/bench.md    # a small check that it runs

Adding a variant: write a ``make_setup(ctx, recorder) -> Setup`` and register a ``Variant`` in the
adapter's ``VARIANTS`` (and its name in :data:`VARIANT_NAMES`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from types import ModuleType

import torch
from _common import (
    add_common_args,
    apply_quick,
    check_scratch,
    choice_list,
    load_average,
    print_rich_table,
    record,
    versions_line,
)
from _servers import export_s3_env, make_bucket, moto_server, s3_options
from _stall import Context, FitResult, depth_for, state_bytes
from _stall_report import REPORTS, Summary

BUCKET = "spot-bench-stall"
VARIANT_NAMES = {
    "lightning": ("floor-clone", "floor-copy", "spot", "mc-sync", "mc-async"),
    "hf": ("hf-floor", "hf-spot", "hf-local", "hf-sync"),
}
ADAPTERS = {"lightning": "_stall_lightning", "hf": "_stall_hf"}
QUICK = {"size_mb": 8.0, "width": 256, "ckpts": 2, "rounds": 1, "quiet_timeout": 0.5}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--size-mb", type=float, default=600.0, help="training state size in MB (default 600)")
    add("--width", type=int, default=1024, help="Linear layer width (default 1024)")
    add("--batch", type=int, default=2, help="batch size (default 2)")
    add("--every-n", type=int, default=5, help="steps between checkpoints (default 5)")
    add("--ckpts", type=int, default=3, help="checkpoints per fit (default 3)")
    add("--rounds", type=int, default=2, help="rounds over the variants (default 2)")
    add(
        "--variants",
        default=",".join(VARIANT_NAMES["lightning"]),
        help=f"subset of {','.join(VARIANT_NAMES['lightning'])} (Lightning, the default) or of "
        f"{','.join(VARIANT_NAMES['hf'])} (Hugging Face Trainer; needs transformers); not mixed",
    )
    add(
        "--quiet-cores",
        type=float,
        default=0.3,
        help="before each checkpoint, wait until other processes use fewer cores than this (default 0.3)",
    )
    add("--quiet-timeout", type=float, default=5.0, help="longest wait for a quiet machine, s (default 5)")
    add(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads (default: torch's choice). On a box other processes load, use 1: "
        "multi-threaded copies then wait on their slowest thread and vary 10-50×",
    )
    add("--note", default="", help="a line added to the BENCHMARKS.md section")
    add("--scratch", default=tempfile.gettempdir(), help="where the temp folder goes")
    add_common_args(parser)
    args = parser.parse_args(argv)
    apply_quick(parser, args, QUICK)
    args.variants = choice_list(
        parser, args.variants, [n for ns in VARIANT_NAMES.values() for n in ns], "--variants"
    )
    groups = [fw for fw, names in VARIANT_NAMES.items() if set(args.variants) & set(names)]
    if len(groups) > 1:
        parser.error("--variants: run the Lightning and the Hugging Face variants separately")
    args.framework = groups[0]
    if args.size_mb <= 0 or min(args.width, args.batch, args.every_n, args.ckpts, args.rounds) < 1:
        parser.error("sizes and counts must be positive")
    if args.every_n < 5:
        parser.error(
            "--every-n must be >= 5 (two quiet baseline steps and steps overlapping background work)"
        )
    return args


def command_line(args: argparse.Namespace) -> str:
    """The command that repeats this run (``--quick`` spelled out)."""
    return (
        f"python benchmarks/stall.py --size-mb {args.size_mb:g} --width {args.width} "
        f"--batch {args.batch} --every-n {args.every_n} --ckpts {args.ckpts} --rounds {args.rounds} "
        f"--quiet-cores {args.quiet_cores:g} --quiet-timeout {args.quiet_timeout:g} "
        + (f"--threads {args.threads} " if args.threads else "")
        + f"--variants {','.join(args.variants)}"
    )


def quiet_frameworks() -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for message in (
        ".*does not have many workers.*",
        ".*Checkpoint directory .* exists and is not empty.*",
        ".*`training_step` returned `None`.*",
        ".*isinstance\\(treespec, LeafSpec\\)` is deprecated.*",
    ):
        warnings.filterwarnings("ignore", message=message)


def progress_line(rnd: int, args: argparse.Namespace, name: str, result: FitResult, took_s: float) -> str:
    landed = result.landed
    return (
        f"  round {rnd + 1}/{args.rounds} {name:<11} blocked "
        + " ".join(f"{v:.3f}" for v in result.blocked_s)
        + " s"
        + (f", landed {landed.found}/{landed.expected}" if landed else "")
        + (f" {landed.note}" if landed and landed.note else "")
        + (f" ERROR {result.error}" if result.error else "")
        + f" ({took_s:.0f}s)"
    )


def run_rounds(
    args: argparse.Namespace, adapter: ModuleType, scratch: Path, shape: tuple[int, int]
) -> dict[str, list[FitResult]]:
    """Every variant once per round (reversed on odd rounds), side by side against one moto server."""
    fits: dict[str, list[FitResult]] = {name: [] for name in args.variants}
    with moto_server(scratch) as endpoint:
        export_s3_env(endpoint)  # ModelCheckpoint's s3fs takes its credentials and endpoint from there
        options = s3_options(endpoint)
        make_bucket(options, BUCKET)
        for rnd in range(args.rounds):
            for name in args.variants if rnd % 2 == 0 else list(reversed(args.variants)):
                ctx = Context(
                    args, options, scratch, f"{BUCKET}/{name}-r{rnd}-{uuid.uuid4().hex[:6]}", *shape
                )
                started = time.perf_counter()
                result = adapter.run(ctx, adapter.VARIANTS[name])
                fits[name].append(result)
                with contextlib.suppress(FileNotFoundError):
                    ctx.fs().rm(ctx.prefix, recursive=True)
                print(progress_line(rnd, args, name, result, time.perf_counter() - started), flush=True)
    return fits


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = REPORTS[args.framework]
    adapter = importlib.import_module(ADAPTERS[args.framework])
    assert set(adapter.VARIANTS) == set(VARIANT_NAMES[args.framework]), "VARIANT_NAMES is out of date"
    quiet_frameworks()
    if args.threads:
        torch.set_num_threads(args.threads)
    versions = versions_line(report.versions)
    depth = depth_for(int(args.size_mb * 1e6), args.width)
    nbytes = state_bytes(args.width, depth)
    # moto's spill files + multipart parts + spot scratch
    need = (2 * args.ckpts + 2) * nbytes + 512 * 2**20
    check_scratch(Path(args.scratch), need, 6 * nbytes, f"the state is {nbytes / 1e9:.1f} GB")
    scratch = Path(tempfile.mkdtemp(prefix="spot-bench-stall-", dir=args.scratch))
    began, load_start = time.perf_counter(), load_average()
    print(
        f"state: {depth} × Linear({args.width}) + AdamW = {nbytes / 1e6:.0f} MB; "
        f"{args.rounds} rounds × {len(args.variants)} variants × {args.ckpts} checkpoints",
        flush=True,
    )
    try:
        fits = run_rounds(args, adapter, scratch, (depth, nbytes))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summaries = [Summary(adapter.VARIANTS[name], fits[name]) for name in args.variants]
    wall_s = time.perf_counter() - began
    run = {"command": command_line(args), "versions": versions, "load_start": load_start}
    run.update(
        load_end=load_average(), after_command=f" ({wall_s:.0f}s); torch threads {torch.get_num_threads()}"
    )
    print(f"load average at start {run['load_start']}, at end {run['load_end']}")
    title = (
        f"{report.title} ({nbytes / 1e6:.0f} MB state, {args.ckpts * args.rounds} checkpoints per variant)"
    )
    rows = report.rows(summaries, args.ckpts)
    print_rich_table(report.headers, rows, title, left=("variant", "landed"), width=220)
    print(*report.breakdown_lines(summaries), sep="\n")
    flagged = [s.variant.name for s in summaries if s.flagged]
    if flagged:
        print(f"FLAGGED (error or checkpoints missing in the bucket): {', '.join(flagged)}")
    verdict = report.verdict(summaries)
    if verdict:
        print(verdict.replace("**", ""))
    print(f"total time {wall_s:.0f}s")
    record(args, report.section(summaries, args, (depth, nbytes), run))
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
