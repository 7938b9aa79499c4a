"""Benchmark: HF Trainer under FSDP2, staged checkpoints vs the Trainer's own save vs Lightning's sharded path, 2 CPU processes.

In one run, on the same model sizes (the MLP of ``benchmarks/sharded.py``: ``--layers`` Linear
layers of ``--hidden`` squared, AdamW, ~1.2 GB of state by default), each rank's blocked time per
checkpoint, time until committed and peak extra host RAM for:

- *hf-staged*: SpotCheckpointCallback's two-phase path (every rank stages its own shards, writes
  the Trainer's ``checkpoint-N`` DCP folders from them in the background, rank 0 commits);
- *hf-trainer*: the same run with ``SPOT_HF_SAVE=trainer`` (the Trainer's synchronous ``dcp.save``,
  then the background upload);
- *floor*: ``copy_`` of the rank's local shards into buffers allocated once, timed in the hf-staged
  run at every checkpoint just before its span (side by side, under the same load);
- *lightning-sharded*: Lightning's ModelParallelStrategy with SpotCheckpoint (``_sharded_worker.py``).

    python benchmarks/hf_fsdp.py                       # ~1.2 GB of state, file:// store
    python benchmarks/hf_fsdp.py --store s3            # moto S3
    python benchmarks/hf_fsdp.py --quick --results-file /tmp/bench.md   # a check that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    add_common_args,
    apply_quick,
    markdown_table,
    print_rich_table,
    record,
    section_head,
    versions_line,
)
from _servers import open_store
from sharded import run_mode as run_lightning_mode

WORKER = Path(__file__).with_name("_hf_fsdp_worker.py")
BUCKET = "hf-fsdp"
QUICK = {"hidden": 256, "layers": 2, "steps": 7}
HEADERS = [
    "path", "rank", "rank's shard", "blocked (median)", "blocked / floor", "until committed (median)",
    "peak extra RSS", "peak extra / shard",
]  # fmt: skip


def run_hf(
    mode: str, args: argparse.Namespace, workdir: Path, url: str, options: dict[str, Any]
) -> list[dict]:
    """Both ranks of one HF mode under torchrun; their ``rank-N.json`` results, by rank."""
    results_dir = workdir / f"results-{mode}"
    results_dir.mkdir()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
        "--dirpath", f"{url}/{mode}", "--storage-options", json.dumps(options), "--hidden", str(args.hidden),
        "--layers", str(args.layers), "--every", str(args.every), "--steps", str(args.steps),
        "--output-dir", str(workdir / f"out-{mode}"), "--results", str(results_dir),
        *(["--floor"] if mode == "hf-staged" else []),
    ]  # fmt: skip
    env = {**os.environ, "SPOT_SCRATCH": str(workdir / f"scratch-{mode}"), "PYTHONUNBUFFERED": "1"}
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    if mode == "hf-trainer":
        env["SPOT_HF_SAVE"] = "trainer"
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{mode} run failed (code {done.returncode}):\n{done.stderr[-4000:]}")
    results = [json.loads(path.read_text()) for path in sorted(results_dir.glob("rank-*.json"))]
    for result in results:
        if not result["fsdp"]:
            raise SystemExit(f"{mode}: the Trainer did not take accelerate's FSDP path")
    return sorted(results, key=lambda result: result["rank"])


def median_of(result: dict, key: str) -> float:
    return statistics.median(row[key] for row in result["rows"])


def floor_ratio(result: dict, floors_s: list[float], same_run: bool) -> float:
    """The median over checkpoints of blocked / floor: each checkpoint against the floor timed beside it
    (``same_run``), else against the median floor (the rows are another run's)."""
    blocked = [row["blocked_s"] for row in result["rows"]]
    if not same_run or len(floors_s) != len(blocked):
        floors_s = [statistics.median(floors_s)] * len(blocked)
    return statistics.median(b / f for b, f in zip(blocked, floors_s, strict=True))


def row_of(path: str, result: dict, floors_s: list[float], same_run: bool = False) -> list[str]:
    shard_mb = result["shard_bytes"] / 1e6
    peak_mb = max(row["peak_extra_bytes"] for row in result["rows"]) / 1e6
    blocked_s = median_of(result, "blocked_s")
    ratio = floor_ratio(result, floors_s, same_run)
    return [
        path, str(result["rank"]), f"{shard_mb:.0f} MB", f"{blocked_s:.3f} s", f"{ratio:.2f}x",
        f"{median_of(result, 'committed_s'):.2f} s", f"{peak_mb:.0f} MB", f"{peak_mb / shard_mb:.2f}x",
    ]  # fmt: skip


def floor_row(result: dict) -> list[str]:
    shard_mb = result["shard_bytes"] / 1e6
    return ["floor (copy_ into kept buffers)", str(result["rank"]), f"{shard_mb:.0f} MB",
            f"{statistics.median(result['floors_s']):.3f} s", "1.00x", "-", "-", "-"]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--every", type=int, default=3, help="checkpoint every N steps")
    # One step past the last measured checkpoint: the end-of-training save, and the wait for its
    # commit inside the Trainer's on_train_end, fall into no checkpoint's row.
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--store", choices=["s3", "file"], default="file")
    add_common_args(parser)
    args = parser.parse_args(argv)
    apply_quick(parser, args, QUICK)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    params = args.layers * (args.hidden * args.hidden + args.hidden)
    state_gb = params * 4 * 3 / 1e9  # fp32 weights + AdamW's two moments
    workdir = Path(tempfile.mkdtemp(prefix="spot-hf-fsdp-"))
    load_start = " ".join(f"{value:.2f}" for value in os.getloadavg())
    started = time.monotonic()
    try:
        with open_store(args.store, workdir, BUCKET) as (url, options):
            staged = run_hf("hf-staged", args, workdir, url, options)
            trainer = run_hf("hf-trainer", args, workdir, url, options)
            lightning = run_lightning_mode("sharded", args, workdir, url, options)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    total_s = time.monotonic() - started
    load_end = " ".join(f"{value:.2f}" for value in os.getloadavg())
    floors = {result["rank"]: result["floors_s"] for result in staged}
    for result in lightning:
        result["rows"] = [{**row, "blocked_s": row["blocked_s"]} for row in result["rows"]]
    rows = [
        *(row_of("HF FSDP, staged (spot_callbacks)", r, floors[r["rank"]], same_run=True) for r in staged),
        *(row_of("HF FSDP, the Trainer's save", r, floors[r["rank"]]) for r in trainer),
        *(floor_row(r) for r in staged),
        *(row_of("Lightning sharded (spot_callbacks)", r, floors[r["rank"]]) for r in lightning),
    ]
    ratios = [
        median_of(hf, "blocked_s") / median_of(lit, "blocked_s")
        for hf, lit in zip(staged, lightning, strict=True)
    ]
    title = (
        f"{params / 1e6:.0f}M parameters, {state_gb:.2f} GB of state, 2 processes (gloo, CPU), "
        f"{args.store} store, checkpoint every {args.every} steps ({args.steps // args.every} per path)"
    )
    print_rich_table(HEADERS, rows, title, left=["path"])
    print(
        f"HF staged blocked / Lightning sharded blocked, per rank: {', '.join(f'{r:.2f}x' for r in ratios)}; "
        f"load average at start {load_start}, at end {load_end}"
    )
    command = (
        f"python benchmarks/hf_fsdp.py --hidden {args.hidden} --layers {args.layers} --every {args.every} "
        f"--steps {args.steps} --store {args.store}"
    )
    section = [
        *section_head(
            "hf_fsdp: HF Trainer under FSDP2, staged vs the Trainer's save vs the floor vs Lightning's sharded path",
            command,
            versions_line(("torch", "transformers", "accelerate", "lightning")),
            f" ({total_s:.0f} s)",
        ),
        f"- Load average (1/5/15 min) at start: {load_start}; at end: {load_end}.",
        f"- {title}. *blocked*: HF: from the first callback's `on_step_end` of a checkpoint step to the last "
        "callback's `on_step_begin` of the next, less the same span at a step without a checkpoint; Lightning: "
        "the wait at the step boundary. *until committed*: from the step to the manifest written. *peak extra "
        "RSS*: the highest resident memory until the commit over the RSS before the first checkpoint (reused "
        "staging buffers included). *floor*: `copy_` of the rank's local shards into buffers allocated once, "
        "timed in the staged run at every checkpoint just before its span (*blocked / floor*: the median "
        "of each checkpoint's ratio to the floor beside it; for the other runs, to the median floor). "
        f"HF staged blocked / Lightning sharded blocked: {', '.join(f'{r:.2f}x' for r in ratios)} (rank 0, 1).",
        "",
        *markdown_table(HEADERS, rows),
        "",
    ]
    record(args, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
