"""Benchmark: blocked time per checkpoint vs the copy floor beside it, and extra RSS vs the shard, 2 ranks, training on.

Each strategy trains the MLP of ``benchmarks/sharded.py`` (``--layers`` Linear layers of
``--hidden`` squared, AdamW) on 2 CPU processes (gloo) and checkpoints it with spot_callbacks every
``--every`` steps to a ``file://`` (or moto S3) store; training runs on while the writer writes and
uploads (nothing waits for a commit until the end of the run). On every rank (``_train_on.py``):

- *blocked*: the time spent in the checkpoint callback's hooks at a checkpoint step (wrapped from
  outside: HF ``on_step_end``, ``on_log``, the next ``on_step_begin``...; Lightning
  ``on_train_batch_end``) less the median of the same at steps without a checkpoint;
- *floor*: ``copy_`` of the rank's local tensors (parameters and optimizer state: what it stages)
  into buffers allocated once, timed just before each checkpoint's hooks; *ratio*: blocked / floor
  of each checkpoint, and their median; *CPU*: the same median in the training thread's CPU time
  (``time.thread_time``), which other processes' load on a shared machine does not stretch (nor a
  wait in a collective or for the GIL, which the wall-clock ratio, the target's, does count);
- *extra RSS*: the peak RSS from the first checkpoint to the end of the run (last commit included)
  over the peak of the plain training steps before it, in units of the rank's shard. The staging
  buffers the callback allocates in the background after the first step are taken off the plain
  steps' samples (they are the checkpoints' memory, and count in the extra). Training's own heap
  grows over the same window, so this figure is not what the checkpoints add: for that,
- *heap in use*: the same windows in glibc's bytes allocated and not freed (``mallinfo2``, sampled
  with the RSS; ``_train_on.heap_in_use_bytes``), in units of the rank's shard: the checkpoint's own
  memory inside the process (its staging buffers, what its writer and uploads hold at their peak),
  where training's own figure repeats step after step; the heap malloc keeps after frees
  (fragmentation, trims), which drifts and differs between two processes, is not in it. Or,
- *over control* (``--control``): a ``--no-saves`` run of the same strategy beside each run
  (interleaved: the checkpointing run first on odd runs, the control first on even ones); the
  checkpointing run's peak RSS from its first checkpoint to the end less the control's over the same
  steps (through its last step: its one save at the end is left out), the control's staging buffers
  (allocated after the first step in both runs) taken off its peak; per rank, in units of its shard.

Strategies: ``hf-single`` and ``lightning-single`` (one process: it stages the whole state),
``hf-ddp`` (HF Trainer under torchrun, DDP on gloo) and ``lightning-ddp`` (DDPStrategy): rank 0
stages the whole state, rank 1 nothing; ``hf-fsdp2`` / ``hf-fsdp1`` (HF Trainer, accelerate's FSDP2 /
FSDP1 plugin, ``SHARDED_STATE_DICT``: every rank stages its shards), ``lightning-fsdp``
(ModelParallelStrategy: every rank its shards), ``lightning-fsdp1`` (FSDPStrategy with
``state_dict_type="sharded"``, FSDP1: every rank its shards).

    python benchmarks/strategies.py                                   # ~500 MB of state, 2 runs each
    python benchmarks/strategies.py --strategies hf-fsdp2 --runs 1
    python benchmarks/strategies.py --strategies hf-fsdp2,lightning-fsdp --control   # what checkpoints add
    python benchmarks/strategies.py --quick --results-file /tmp/bench.md   # a check that it runs
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

HERE = Path(__file__).resolve().parent
STRATEGIES = (
    "hf-single", "hf-ddp", "hf-fsdp2", "hf-fsdp1", "lightning-single", "lightning-ddp", "lightning-fsdp",
    "lightning-fsdp1",
)  # fmt: skip
SINGLE = ("hf-single", "lightning-single")  # one process
QUICK = {"hidden": 256, "layers": 2, "every": 3, "steps": 10, "runs": 1}
HEADERS = [
    "strategy", "run", "rank", "stages", "blocked / floor per checkpoint", "median", "blocked (median)",
    "floor (median)", "CPU: blocked / floor (median)", "extra RSS", "extra / stages", "heap in use: extra", "heap / stages", "control: extra / stages", "over control", "over control / stages",
    "aligned / stages",
]  # fmt: skip


def command_of(
    strategy: str,
    args: argparse.Namespace,
    workdir: Path,
    url: str,
    options: dict,
    results: Path,
    no_saves: bool,
) -> list[str]:
    common = [
        "--dirpath", f"{url}/{results.name}", "--storage-options", json.dumps(options), "--hidden", str(args.hidden),
        "--layers", str(args.layers), "--every", str(args.every), "--steps", str(args.steps),
        "--results", str(results), "--train-on", *(["--no-saves"] if no_saves else []),
    ]  # fmt: skip
    if strategy.startswith("hf-"):
        kind = strategy.removeprefix("hf-")
        launch = (
            [sys.executable] if strategy in SINGLE
            else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        )  # fmt: skip
        return [
            *launch, str(HERE / "_hf_fsdp_worker.py"), *common, "--parallel", kind,
            "--output-dir", str(workdir / f"out-{results.name}"),
        ]  # fmt: skip
    kind = strategy.removeprefix("lightning-")
    devices = "1" if strategy in SINGLE else "2"
    worker = str(HERE / "_sharded_worker.py")
    return [sys.executable, worker, *common, "--devices", devices, "--strategy", kind]


def run_one(
    strategy: str, run: int, args: argparse.Namespace, workdir: Path, url: str, options: dict, no_saves: bool
) -> list[dict]:
    name = f"{strategy}-{run}{'-control' if no_saves else ''}"
    results = workdir / name
    results.mkdir()
    env = {**os.environ, "SPOT_SCRATCH": str(workdir / f"scratch-{name}"), "PYTHONUNBUFFERED": "1"}
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    command = command_of(strategy, args, workdir, url, options, results, no_saves)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{strategy} run failed (code {done.returncode}):\n{done.stderr[-4000:]}")
    ranks = [json.loads(path.read_text()) for path in sorted(results.glob("rank-*.json"))]
    for result in ranks:
        result["run"] = run
        if strategy.startswith("hf-fsdp") and not result["fsdp"]:
            raise SystemExit(f"{strategy}: the Trainer did not take accelerate's FSDP path")
    return sorted(ranks, key=lambda result: result["rank"])


def stages_bytes(strategy: str, result: dict) -> int:
    """What this rank stages: DDP's rank 0 the whole state, its other ranks nothing."""
    if strategy.endswith("-ddp") and result["rank"] != 0:
        return 0
    return result["shard_bytes"]


def over_control(result: dict, control: dict) -> int:
    """What the checkpoints add to the peak RSS: the checkpointing run's peak from its first checkpoint
    to the end (last commit included) less the control's peak over the same steps (through its last
    step: its one save comes after), the control's staging buffers taken off (allocated after the first
    step in both: checkpoint memory, counted once, in the checkpointing run's peak)."""
    return result["peak_rss_bytes"] - (control["train_peak_rss_bytes"] - control["staging_bytes"])


def row_of(
    strategy: str, result: dict, control: dict | None = None
) -> tuple[list[str], float | None, float | None, float | None, float | None, float | None]:
    rows = result["rows"]
    stages = stages_bytes(strategy, result)
    extra = result["extra_rss_bytes"]
    heap = result.get("extra_heap_bytes")  # None: not glibc
    heap_ratio = heap / stages if heap is not None and stages else None
    blocked = statistics.median(row["blocked_s"] for row in rows)
    floor = statistics.median(row["floor_s"] for row in rows)
    if stages:
        ratios = [row["ratio"] for row in rows]
        median: float | None = statistics.median(ratios)
        per_checkpoint = ", ".join(f"{ratio:.2f}" for ratio in ratios)
        extra_ratio: float | None = extra / stages
        cpu_ratios = [row["cpu_ratio"] for row in rows if row.get("cpu_ratio") is not None]
        cpu_median = statistics.median(cpu_ratios) if cpu_ratios else None
    else:
        median, per_checkpoint, extra_ratio, cpu_median = None, "(stages nothing)", None, None
    control_cells = ["-", "-", "-", "-"]
    over_ratio: float | None = None
    if control is not None:
        over = over_control(result, control)
        control_ratio = control["extra_rss_bytes"] / stages if stages else None
        over_ratio = over / stages if stages else None
        # The same with each run's own RSS baseline taken off (the two processes' offset at the same step).
        aligned = over - (result["baseline_rss_bytes"] - control["baseline_rss_bytes"])
        control_cells = [
            "-" if control_ratio is None else f"{control_ratio:.2f}x", f"{over / 1e6:.0f} MB",
            "-" if over_ratio is None else f"{over_ratio:.2f}x", f"{aligned / stages:.2f}x" if stages else "-",
        ]  # fmt: skip
    waits = [row.get("stage_wait_s", 0.0) for row in rows]
    if max(waits, default=0.0) > 0.05:
        per_checkpoint += f" (waited for the previous write: {max(waits):.2f} s)"
    cells = [
        strategy, str(result["run"]), str(result["rank"]), f"{stages / 1e6:.0f} MB", per_checkpoint,
        "-" if median is None else f"{median:.2f}x", f"{blocked * 1e3:.1f} ms", f"{floor * 1e3:.1f} ms",
        "-" if cpu_median is None else f"{cpu_median:.2f}x",
        f"{extra / 1e6:.0f} MB", "-" if extra_ratio is None else f"{extra_ratio:.2f}x",
        "-" if heap is None else f"{heap / 1e6:.0f} MB", "-" if heap_ratio is None else f"{heap_ratio:.2f}x",
        *control_cells,
    ]  # fmt: skip
    return cells, median, extra_ratio, over_ratio, heap_ratio, cpu_median


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--strategies", default=",".join(STRATEGIES), help=f"comma-separated, of {STRATEGIES}"
    )
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--every", type=int, default=5, help="checkpoint every N steps (the writer's time)")
    parser.add_argument("--steps", type=int, default=21, help="one past the last measured checkpoint")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--store", choices=["s3", "file"], default="file")
    parser.add_argument(
        "--no-saves", action="store_true",
        help="a control: no checkpoint before the run's end (the extra RSS training shows on its own over the "
        "same window; the staging buffers are still allocated after the first step; the ratios mean nothing)",
    )  # fmt: skip
    parser.add_argument(
        "--control", action="store_true",
        help="run a --no-saves control beside each run (same steps and sampling, interleaved: checkpointing first on "
        "odd runs, the control first on even ones) and report the peak RSS over the control's per rank",
    )  # fmt: skip
    add_common_args(parser)
    args = parser.parse_args(argv)
    apply_quick(parser, args, QUICK)
    unknown = set(args.strategies.split(",")) - set(STRATEGIES)
    if unknown:
        parser.error(f"unknown strategies: {sorted(unknown)}")
    if args.control and args.no_saves:
        parser.error("--control runs the --no-saves control itself: give one of them")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    strategies = args.strategies.split(",")
    params = args.layers * (args.hidden * args.hidden + args.hidden)
    state_mb = params * 4 * 3 / 1e6  # fp32 weights + AdamW's two moments
    workdir = Path(tempfile.mkdtemp(prefix="spot-strategies-"))
    load_start = " ".join(f"{value:.2f}" for value in os.getloadavg())
    started = time.monotonic()
    table: list[list[str]] = []
    summary: dict[str, tuple[list[float], list[float]]] = {}
    overs: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}  # each rank-run's median blocked / floor in CPU time
    heaps: dict[str, list[float]] = {}  # heap in use over the plain steps', per rank and run, in shards
    baselines: dict[str, list[float]] = {}  # checkpointing run's RSS baseline less the control's, MB
    trims: dict[str, list[float]] = {}
    builds: dict[str, set[int]] = {}
    prepared: dict[str, list[tuple[int, int]]] = {}
    try:
        with open_store(args.store, workdir, "strategies") as (url, options):
            for run in range(1, args.runs + 1):
                for strategy in strategies if run % 2 else reversed(strategies):
                    controls: dict[int, dict] = {}
                    if args.control and run % 2 == 0:
                        controls = {
                            r["rank"]: r for r in run_one(strategy, run, args, workdir, url, options, True)
                        }
                    results = run_one(strategy, run, args, workdir, url, options, args.no_saves)
                    if args.control and run % 2:
                        controls = {
                            r["rank"]: r for r in run_one(strategy, run, args, workdir, url, options, True)
                        }
                    for result in results:
                        trims.setdefault(strategy, []).extend(result.get("trims_s", []))
                        prepared.setdefault(strategy, []).append(
                            (result.get("prepared_bytes", 0), result.get("prepared_used", 0))
                        )
                        if "shard_handle_builds" in result:
                            builds.setdefault(strategy, set()).add(result["shard_handle_builds"])
                        control = controls.get(result["rank"])
                        cells, median, extra_ratio, over_ratio, heap_ratio, cpu_median = row_of(
                            strategy, result, control
                        )
                        table.append(cells)
                        if cpu_median is not None:
                            cpus.setdefault(strategy, []).append(cpu_median)
                        if heap_ratio is not None:
                            heaps.setdefault(strategy, []).append(heap_ratio)
                        if over_ratio is not None and control is not None:
                            overs.setdefault(strategy, []).append(over_ratio)
                            baselines.setdefault(strategy, []).append(
                                (result["baseline_rss_bytes"] - control["baseline_rss_bytes"]) / 1e6
                            )
                        if median is not None and extra_ratio is not None:
                            ratios, extras = summary.setdefault(strategy, ([], []))
                            ratios.append(median)
                            extras.append(extra_ratio)
                        print(" | ".join(cells), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    total_s = time.monotonic() - started
    load_end = " ".join(f"{value:.2f}" for value in os.getloadavg())
    table.sort(key=lambda cells: (strategies.index(cells[0]), cells[1], cells[2]))
    title = (
        f"{params / 1e6:.0f}M parameters, {state_mb:.0f} MB of state, 2 processes (gloo, CPU; the single rows 1), {args.store} store, "
        f"checkpoint every {args.every} steps, {args.steps} steps, training on during writes and uploads"
    )
    print_rich_table(HEADERS, table, title, left=["strategy", "blocked / floor per checkpoint"])
    verdicts = []
    for strategy in strategies:
        ratios, extras = summary.get(strategy, ([], []))
        if not ratios:
            continue
        ratio, extra = statistics.median(ratios), max(extras)
        line = (
            f"{strategy}: blocked / floor {ratio:.2f}x (median over ranks and runs of each one's median; target "
            f"≤ 1.1x: {'met' if ratio <= 1.1 else 'not met'}"
            + (f"; in CPU time {statistics.median(cpus[strategy]):.2f}x" if cpus.get(strategy) else "")
            + f"), extra RSS up to {extra:.2f}x what a rank stages"
        )
        if strategy in overs:
            over, gaps = max(overs[strategy]), baselines[strategy]
            line += (
                f" (over its own baseline), peak RSS over the control's up to {over:.2f}x (target ≤ 1.1x: "
                f"{'met' if over <= 1.1 else 'not met'}; the two runs' baselines {min(gaps):+.0f} to "
                f"{max(gaps):+.0f} MB apart)"
            )
        else:
            line += f" (target ≤ 1.1x: {'met' if extra <= 1.1 else 'not met'})"
        if heaps.get(strategy):
            top = max(heaps[strategy])
            line += (
                f"; in-process heap in use over the plain steps' {statistics.median(heaps[strategy]):.2f}x "
                f"(median), up to {top:.2f}x what a rank stages (target ≤ 1.1x: {'met' if top <= 1.1 else 'not met'})"
            )
        verdicts.append(line)
    for strategy in strategies:
        seconds = trims.get(strategy, [])
        heap_line = (
            f"{strategy}: malloc_trim after each upload (SPOT_TRIM_HEAP): {len(seconds)} calls, median "
            f"{statistics.median(seconds) * 1e3:.1f} ms, max {max(seconds) * 1e3:.1f} ms (an upload thread's time)"
            if seconds
            else f"{strategy}: no malloc_trim calls (SPOT_TRIM_HEAP=0, or not glibc)"
        )
        if any(builds.get(strategy, ())):
            heap_line += (
                f"; shard state dicts taken {'/'.join(map(str, sorted(builds[strategy])))} time(s) per run"
            )
        allocated = [nbytes for nbytes, _ in prepared.get(strategy, []) if nbytes]
        if allocated:
            used = sorted({count for nbytes, count in prepared[strategy] if nbytes})
            heap_line += (
                f"; staging buffers allocated in the background before the first checkpoint: "
                f"{min(allocated) / 1e6:.0f}-{max(allocated) / 1e6:.0f} MB per staging rank, "
                f"{'/'.join(map(str, used))} of them used by it"
            )
        verdicts.append(heap_line)
    print("\n".join(verdicts))
    print(f"load average at start {load_start}, at end {load_end}")
    allocator = " ".join(
        f"{key}={value}"
        for key, value in sorted(os.environ.items())
        if key.startswith(("MALLOC_", "SPOT_TRIM_HEAP"))
    )
    command = (
        (f"{allocator} " if allocator else "")
        + f"python benchmarks/strategies.py --strategies {args.strategies} --hidden {args.hidden} --layers {args.layers} "
        f"--every {args.every} --steps {args.steps} --runs {args.runs} --store {args.store}"
        + (" --no-saves" if args.no_saves else "")
        + (" --control" if args.control else "")
    )
    section = [
        *section_head(
            "strategies: blocked / copy floor and extra RSS per strategy, 2 ranks, training on",
            command,
            versions_line(("torch", "transformers", "accelerate", "lightning")),
            f" ({total_s:.0f} s)",
        ),
        f"- Load average (1/5/15 min) at start: {load_start}; at end: {load_end}.",
        f"- {title}. *blocked*: the time in the checkpoint callback's hooks at a checkpoint step (wrapped from "
        "outside) less the median at steps without one; *floor*: `copy_` of the rank's local tensors into buffers "
        "allocated once, timed just before each checkpoint's hooks; *CPU*: the same two in the training thread's "
        "CPU time (`time.thread_time`), which other processes' load does not stretch (nor does a wait in a collective "
        "or for the GIL: the wall-clock ratio is the one the target is about); *extra RSS*: the peak RSS from the first "
        "checkpoint to the end of the run (the last commit included) over the peak of the plain steps before it (the staging buffers allocated in the background after "
        "the first step taken off the latter: they count in the extra). *control*: with `--control`, a "
        "`--no-saves` run of the same strategy beside each run (interleaved), its extra RSS the same way; *over "
        "control*: the checkpointing run's peak RSS from its first checkpoint to the end less the control's over "
        "the same steps (through its last step; its staging buffers, allocated in both, taken off it): what the "
        "checkpoints add to training's own memory; *aligned*: the same less the difference of the two runs' "
        "baselines (the two processes' offset at the same step). *heap in use*: the same window as *extra RSS*, "
        "in glibc's bytes allocated and not freed (`mallinfo2`: every arena and mmapped block, sampled with the "
        "RSS; the staging buffers taken off the plain steps' peak likewise): the checkpoint's own memory inside "
        "the process (its staging buffers, what its writer and uploads hold), without the freed heap malloc keeps "
        "(fragmentation, trims), which is what makes the RSS figures differ between two runs.",
        *(f"- {line}" for line in verdicts),
        "",
        *markdown_table(HEADERS, table),
        "",
    ]
    record(args, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
