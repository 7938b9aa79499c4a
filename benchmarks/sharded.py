"""Benchmark: sharded vs gathered checkpoints of an FSDP2 model on 2 CPU processes: time and peak host memory per rank.

*sharded*: ModelParallelStrategy(save_distributed_checkpoint=True): every rank stages and uploads
its own shards through torch.distributed.checkpoint; rank 0 commits. *gathered*: the same run with
save_distributed_checkpoint=False: the full state is gathered on rank 0, which stages and uploads
one file (the DDP-style path). Both write to the same store (moto S3 by default) in one run; each
rank is ``benchmarks/_sharded_worker.py``.

    python benchmarks/sharded.py                      # ~1.2 GB of state (100M params + AdamW), moto S3
    python benchmarks/sharded.py --hidden 1024 --layers 4 --store file --no-record   # a quick look
    python benchmarks/sharded.py --quick --results-file /tmp/bench.md               # a check that it runs
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

WORKER = Path(__file__).with_name("_sharded_worker.py")
BUCKET = "sharded"
MODES = ("sharded", "gathered")
QUICK = {"hidden": 256, "layers": 2, "steps": 6}
HEADERS = [
    "mode", "rank", "rank's shard", "blocked (median)", "until committed (median)",
    "peak extra RSS", "peak extra / shard",
]  # fmt: skip
RESUME_HEADERS = [
    "rank",
    "pull (verified, once per node)",
    "pull + DCP load",
    "DCP load through FsspecReader",
]
RESUME_TITLE = "loading the newest sharded checkpoint into the same 2 processes"


def run_mode(
    mode: str, args: argparse.Namespace, workdir: Path, url: str, options: dict[str, Any]
) -> list[dict]:
    """Both ranks of one mode (Lightning launches the second); their ``rank-N.json`` results, by rank."""
    results_dir = workdir / f"results-{mode}"
    results_dir.mkdir()
    command = [
        sys.executable, str(WORKER), "--dirpath", f"{url}/{mode}", "--storage-options", json.dumps(options),
        "--hidden", str(args.hidden), "--layers", str(args.layers), "--every", str(args.every),
        "--steps", str(args.steps), "--devices", "2", "--results", str(results_dir),
        *(["--gathered"] if mode == "gathered" else []),
    ]  # fmt: skip
    env = {**os.environ, "SPOT_SCRATCH": str(workdir / f"scratch-{mode}"), "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{mode} run failed (code {done.returncode}):\n{done.stderr[-4000:]}")
    results = [json.loads(path.read_text()) for path in sorted(results_dir.glob("rank-*.json"))]
    return sorted(results, key=lambda result: result["rank"])


def row_of(result: dict) -> list[str]:
    rows = result["rows"]
    shard_mb = result["shard_bytes"] / 1e6
    peak_mb = max(row["peak_extra_bytes"] for row in rows) / 1e6
    return [
        result["mode"],
        str(result["rank"]),
        f"{shard_mb:.0f} MB",
        f"{statistics.median(row['blocked_s'] for row in rows):.2f} s",
        f"{statistics.median(row['committed_s'] for row in rows):.2f} s",
        f"{peak_mb:.0f} MB",
        f"{peak_mb / shard_mb:.2f}x",
    ]


def resume_row_of(result: dict) -> list[str]:
    resume = result["resume"]
    return [
        str(result["rank"]),
        f"{resume['pull_s']:.2f} s",
        f"{resume['pull_and_load_s']:.2f} s",
        f"{resume['fsspec_reader_s']:.2f} s",
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--every", type=int, default=3, help="checkpoint every N steps")
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--store", choices=["s3", "file"], default="s3")
    add_common_args(parser)
    args = parser.parse_args(argv)
    apply_quick(parser, args, QUICK)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    params = args.layers * (args.hidden * args.hidden + args.hidden)
    state_gb = params * 4 * 3 / 1e9  # fp32 weights + AdamW's two moments
    workdir = Path(tempfile.mkdtemp(prefix="spot-sharded-"))
    started = time.monotonic()
    try:
        with open_store(args.store, workdir, BUCKET) as (url, options):
            results = [r for mode in MODES for r in run_mode(mode, args, workdir, url, options)]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    total_s = time.monotonic() - started
    rows = [row_of(result) for result in results]
    title = (
        f"{params / 1e6:.0f}M parameters, {state_gb:.2f} GB of state, 2 processes (gloo, CPU), "
        f"{args.store} store, checkpoint every {args.every} steps ({args.steps // args.every} per mode)"
    )
    print_rich_table(HEADERS, rows, title, left=["mode"])
    resume_rows = [resume_row_of(result) for result in results if result.get("resume")]
    print_rich_table(RESUME_HEADERS, resume_rows, RESUME_TITLE)
    command = (
        f"python benchmarks/sharded.py --hidden {args.hidden} --layers {args.layers} --every {args.every} "
        f"--steps {args.steps} --store {args.store}"
    )
    section = [
        *section_head(
            "sharded: FSDP2 checkpoints, every rank persisting its shards vs the state gathered on rank 0",
            command,
            versions_line(("torch", "lightning")),
            f" ({total_s:.0f} s)",
        ),
        f"- {title}. *blocked*: the training loop's wait at the step boundary; *until committed*: from the "
        "step boundary to the manifest written; *peak extra RSS*: the highest resident memory during a "
        "checkpoint over the RSS before the first one (reused staging buffers included).",
        "",
        *markdown_table(HEADERS, rows),
        "",
        f"Resume, {RESUME_TITLE}: pulled (every file's xxh3 checked) then loaded from local disk, "
        "against DCP's `FsspecReader` reading the shards straight from the store (no checksums).",
        "",
        *markdown_table(RESUME_HEADERS, resume_rows),
        "",
    ]
    record(args, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
