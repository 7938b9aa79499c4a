"""Step cost: how much slower a training step is while checkpoints are taken in the background.

The goodput replay's child job (``_replay_child.py``: an MLP on CPU, one torch thread) trains
uninterrupted for ``--steps`` steps once per variant per round, the variants interleaved
(A B C ... A B C ...) so that the box's drifting speed falls on all of them alike. Per variant:
the median and mean ms/step over the steady part (the first ``--skip`` steps and the last 2 % left
out), both as a ratio to the no-checkpoint runs of the same rounds, and the CPU seconds of every
thread of the process (``_step_cost_child.py``), per minute of training.

Variants: ``none`` (no checkpoint), ``mc`` (ModelCheckpoint every 15 s + save_last +
OnExceptionCheckpoint to a local folder), ``spot-file`` (SpotCheckpoint, interval 15 s, a ``file://``
store), ``spot`` (the same to an S3 server on this box: nanio, or moto with ``--server moto``), and ``spot`` with one background part
turned off: ``spot-no-record`` (the attempt record written once an hour), ``spot-no-beat`` (the run
lock's heartbeat once an hour), ``spot-no-trim`` (no ``malloc_trim``), ``spot-no-upload`` (snapshot
and write only; nothing uploaded), ``spot-resumed`` (resumed from the checkpoint another machine
committed at step 100), ``none-keep-heap``, ``mc-keep-heap``, ``spot-keep-heap`` (glibc told to keep
its heap: ``MALLOC_TRIM_THRESHOLD_=1 GiB``, ``MALLOC_MMAP_THRESHOLD_=32 MiB``), ``spot-quiet`` (record, heartbeat and trim all off); ``spot-after-kill``, ``mc-after-kill`` (heap kept; the
run starts 3 s after a machine of the same run was SIGKILLed 9 s after its spawn: the library's replacement
trains while the dead run's lock goes stale). Hugging Face Trainer (the replay's HF path; the heap kept in
every one, as the HF replays run): ``hf-none``, ``hf-steps`` (the Trainer's ``save_steps`` into a local
folder), ``hf-spot`` / ``hf-spot-file`` (SpotCheckpointCallback), and ``hf-spot-no-record``,
``-no-beat``, ``-no-trim``, ``-no-upload``, ``-quiet`` as above; their Trainer events' callbacks and the
library's hooks are timed per step.

    python benchmarks/step_cost.py --quick
    python benchmarks/step_cost.py --variants none,mc,spot,spot-file --rounds 2
    python benchmarks/step_cost.py --base /path/to/main --variants none,spot@base,spot   # before / after
    python benchmarks/step_cost.py --variants hf-none,hf-steps,hf-spot,hf-spot-no-record --steps 2000
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import (
    REPO_ROOT,
    add_common_args,
    apply_quick,
    choice_list,
    markdown_table,
    print_rich_table,
    record,
    section_head,
    versions_line,
)
from _replay_outcome import parse_markers
from _servers import S3_KEY, S3_SECRET, make_bucket, moto_server, s3_options
from replay import KEEP_HEAP

CHILD = Path(__file__).resolve().parent / "_step_cost_child.py"
HOUR = "3600"
VARIANTS: dict[str, tuple[str, str, dict[str, str]]] = {  # name -> (child variant, store, environment)
    "none": ("none", "-", {}),
    "mc": ("mc", "folder", {}),
    "spot-file": ("spot", "file", {}),
    "spot": ("spot", "s3", {}),
    "spot-no-record": ("spot", "s3", {"SPOT_ATTEMPT_RECORD_S": HOUR}),
    "spot-no-beat": ("spot", "s3", {"SPOT_LOCK_STALE_S": "4h"}),
    "spot-no-trim": ("spot", "s3", {"SPOT_TRIM_HEAP": "0"}),
    "spot-no-upload": ("spot", "s3", {"STEP_COST_NO_UPLOAD": "1"}),
    "spot-resumed": ("spot", "s3", {}),
    "spot-after-kill": ("spot", "s3", KEEP_HEAP),
    "mc-after-kill": ("mc", "folder", KEEP_HEAP),
    "none-keep-heap": ("none", "-", KEEP_HEAP),
    "mc-keep-heap": ("mc", "folder", KEEP_HEAP),
    "spot-keep-heap": ("spot", "s3", KEEP_HEAP),
    "spot-quiet": (
        "spot",
        "s3",
        {"SPOT_ATTEMPT_RECORD_S": HOUR, "SPOT_LOCK_STALE_S": "4h", "SPOT_TRIM_HEAP": "0"},
    ),
    # Hugging Face Trainer: the heap kept by default, as in the HF replays (`replay.py --keep-heap`).
    "hf-none": ("hf-none", "-", KEEP_HEAP),
    "hf-steps": ("hf-steps", "folder", KEEP_HEAP),
    "hf-spot-file": ("hf-spot", "file", KEEP_HEAP),
    "hf-spot": ("hf-spot", "s3", KEEP_HEAP),
    "hf-spot-no-record": ("hf-spot", "s3", {**KEEP_HEAP, "SPOT_ATTEMPT_RECORD_S": HOUR}),
    "hf-spot-no-beat": ("hf-spot", "s3", {**KEEP_HEAP, "SPOT_LOCK_STALE_S": "4h"}),
    "hf-spot-no-trim": ("hf-spot", "s3", {**KEEP_HEAP, "SPOT_TRIM_HEAP": "0"}),
    "hf-spot-no-upload": ("hf-spot", "s3", {**KEEP_HEAP, "STEP_COST_NO_UPLOAD": "1"}),
    "hf-spot-quiet": (
        "hf-spot",
        "s3",
        {**KEEP_HEAP, "SPOT_ATTEMPT_RECORD_S": HOUR, "SPOT_LOCK_STALE_S": "4h", "SPOT_TRIM_HEAP": "0"},
    ),
}
SPOT_CHILDREN = ("spot", "hf-spot")
QUICK = {"steps": 400, "width": 256, "layers": 3, "rounds": 1, "skip": 50, "variants": "none,spot,mc"}
HEADERS = ["variant", "runs", "median ms/step", "mean ms/step", "median / none", "mean / none",
           "main thread CPU ms/step", "process CPU ms/step", "off-CPU ms/step", "involuntary switches/step",
           "minor faults/step", "GC ms/step", "full GCs (tracked objects)", "Trainer callbacks ms/step",
           "library hooks ms/step", "checkpoints", "CPU s per training minute, by thread"]  # fmt: skip


@dataclass
class Run:
    """One uninterrupted run of one variant: its per-step times and its threads' CPU seconds."""

    variant: str
    step_s: list[float]
    train_s: float
    threads: dict[str, float] = field(default_factory=dict)
    checkpoints: int = 0
    window: dict[str, list[float]] = field(default_factory=dict)  # _step_cost_child.py's
    gc: dict[str, float] = field(default_factory=dict)  # _step_cost_child.py's
    server_cpu_s: float = 0.0  # the S3 server's CPU seconds during the run
    hooks: dict[str, list[float]] = field(default_factory=dict)  # HF: name -> [calls, wall s, CPU s]

    def hook_ms_per_step(self, prefix: str, index: int = 1) -> float | None:
        """Wall (``index`` 1) or main thread CPU (2) of the hooks named ``prefix...`` per step, in ms."""
        start, end = self.window.get("from"), self.window.get("to")
        if not self.hooks or start is None or end is None or end[0] <= start[0]:
            return None
        return (
            sum(v[index] for k, v in self.hooks.items() if k.startswith(prefix)) / (end[0] - start[0]) * 1e3
        )

    def gc_ms_per_step(self) -> float | None:
        start, end = self.window.get("from"), self.window.get("to")
        if start is None or end is None or end[0] <= start[0]:
            return None
        return sum(self.gc.get(f"gen{g} s", 0.0) for g in range(3)) / (end[0] - start[0]) * 1e3

    def per_step_ms(self, index: int) -> float | None:
        """A figure of the steady window per step, in ms (1: wall, 2: main thread CPU, 3: process CPU)."""
        start, end = self.window.get("from"), self.window.get("to")
        if start is None or end is None or end[0] <= start[0]:
            return None
        return (end[index] - start[index]) / (end[0] - start[0]) * 1e3

    def switches_per_step(self) -> float | None:
        return self.count_per_step(4)

    def count_per_step(self, index: int) -> float | None:
        """A counter of the steady window per step (4: involuntary switches, 5: minor page faults)."""
        start, end = self.window.get("from"), self.window.get("to")
        if start is None or end is None or end[0] <= start[0] or len(end) <= index:
            return None
        return (end[index] - start[index]) / (end[0] - start[0])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="none,mc,spot-file,spot", help=f"of {','.join(VARIANTS)}")
    parser.add_argument("--rounds", type=int, default=2, help="each variant this many times, interleaved")
    parser.add_argument("--steps", type=int, default=3000, help="steps per run (~20 ms each at the defaults)")
    parser.add_argument("--skip", type=int, default=200, help="steps left out at the start (warm-up)")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--interval-s", type=float, default=15.0)
    parser.add_argument(
        "--save-steps",
        type=int,
        default=1000,
        help="hf-steps: steps between the Trainer's saves (~15 s, as in the replay)",
    )
    parser.add_argument(
        "--server",
        choices=("nanio", "moto"),
        default="nanio",
        help="the S3 server on this box for the s3 variants (moto: the replay's `--store moto`, 5-10x the CPU per byte)",
    )
    parser.add_argument(
        "--base", help="another checkout of the library: a variant named NAME@base runs NAME with its code"
    )
    add_common_args(parser)
    args = parser.parse_args(argv)
    apply_quick(parser, args, QUICK)
    allowed = (*VARIANTS, *(f"{name}@base" for name in VARIANTS)) if args.base else tuple(VARIANTS)
    args.variants = choice_list(parser, args.variants, allowed, "--variants")
    return args


def steady_step_s(steps: list[tuple[int, float]], skip: int) -> list[float]:
    """Seconds per step between consecutive step markers, the first ``skip`` and the last 2 % left out.

    Example:
        >>> steady_step_s([(i, i * 0.02) for i in range(1, 201)], skip=10)
        ... # doctest: +ELLIPSIS
        [0.02..., ...]
    """
    times = [t for _, t in steps]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return gaps[skip : len(gaps) - len(gaps) // 50]


RESUMED_FROM = 100  # ``-resumed``: a machine before trains this many steps, its last checkpoint the resume
KILLED_AT_S = (
    9.0  # ``-after-kill``: a machine before is SIGKILLed this long after its spawn (no checkpoint yet)
)
RESTART_GAP_S = 3.0


SERVER_PROGRAMS = (b"nanio", b"moto.server")  # what `--server` starts, as its command line names it


def server_cpu_s() -> float:
    """CPU seconds so far of this process's children that are not training runs (the S3 server)."""
    total = 0.0
    me = str(os.getpid())
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = stat_path.read_text()
            cmdline = (stat_path.parent / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[1] == me and any(name in cmdline for name in SERVER_PROGRAMS):  # ppid
            # utime, stime, cutime, cstime (its workers)
            total += sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return total


def run_once(args: argparse.Namespace, variant: str, index: int, workdir: Path, endpoint: str | None) -> Run:
    if variant.endswith("-resumed"):
        _run_child(args, variant, index, workdir, endpoint, RESUMED_FROM, "before")
    elif variant.endswith("-after-kill"):
        _run_child(args, variant, index, workdir, endpoint, args.steps, "killed", kill_after_s=KILLED_AT_S)
        time.sleep(RESTART_GAP_S)  # the replacement boots, as in the replay
    server_before = server_cpu_s()
    run = _run_child(args, variant, index, workdir, endpoint, args.steps, "")
    assert run is not None
    run.server_cpu_s = server_cpu_s() - server_before
    return run


def _run_child(
    args: argparse.Namespace,
    variant: str,
    index: int,
    workdir: Path,
    endpoint: str | None,
    steps: int,
    tag: str,
    kill_after_s: float | None = None,
) -> Run | None:
    child_variant, store, extra_env = VARIANTS[variant.split("@")[0]]
    code = args.base if variant.endswith("@base") else str(REPO_ROOT)
    machine = workdir / "machines" / f"{variant}-{index}{tag}"
    for name in ("home", "tmp", "scratch", "work", "persistent"):
        (machine / name).mkdir(parents=True)
    threads_json = machine / "threads.json"
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SPOT_", "AWS_"))}
    env.update({
        "HOME": str(machine / "home"), "TMPDIR": str(machine / "tmp"), "SPOT_SCRATCH": str(machine / "scratch"),
        "HF_HOME": str(machine / "home" / "hf"), "HF_HUB_OFFLINE": "1", "STEP_COST_THREADS": str(threads_json),
        "STEP_COST_WINDOW": f"{args.skip + 1},{args.steps - args.steps // 50}",
        "PYTHONPATH": os.pathsep.join([code, str(CHILD.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        **extra_env,
    })  # fmt: skip
    options: dict[str, Any] = {}
    dirpath = (workdir / "stores" / f"{variant}-{index}").as_uri()
    if store == "s3":
        assert endpoint is not None
        options = s3_options(endpoint)
        dirpath = f"s3://steps/{variant}-{index}"
        env.update({"AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET, "AWS_ENDPOINT_URL": endpoint,
                    "AWS_DEFAULT_REGION": "us-east-1"})  # fmt: skip
    argv = [sys.executable, str(CHILD), "--variant", child_variant, "--steps", str(steps),
            "--width", str(args.width), "--layers", str(args.layers), "--interval-s", str(args.interval_s),
            "--out", str(machine / "final.pt"), "--dirpath", dirpath, "--storage-options", json.dumps(options),
            "--persist-dir", str(machine / "persistent")]  # fmt: skip
    if child_variant == "hf-steps":
        argv += ["--save-steps", str(args.save_steps)]
    log_path = workdir / "logs" / f"{variant}-{index}{tag}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=machine / "work", env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip
        try:
            proc.wait(timeout=kill_after_s)
        except subprocess.TimeoutExpired:
            proc.kill()  # a hard loss: no notice, the lock and the attempt record left behind
            proc.wait()
            shutil.rmtree(machine)
            return None
    lines = log_path.read_text(errors="replace").splitlines()
    markers, done = parse_markers(lines)
    if proc.returncode != 0 or not done:
        raise SystemExit(f"{variant} run {index} failed (exit {proc.returncode}): see {log_path}")
    measured = json.loads(threads_json.read_text()) if threads_json.exists() else {}
    if child_variant in SPOT_CHILDREN:
        checkpoints = sum("committed" in line for line in lines)
    else:  # the Trainer's own: the checkpoint-N folders it wrote (save_total_limit=2 keeps the newest 2)
        checkpoints = len(list((machine / "persistent").glob("checkpoint-*")))
    shutil.rmtree(machine)
    return Run(variant, steady_step_s(markers, args.skip), markers[-1][1] - markers[0][1], measured.get("threads", {}),
               checkpoints, measured.get("window", {}), measured.get("gc", {}), hooks=measured.get("hooks", {}))  # fmt: skip


def cpu_cell(runs: list[Run]) -> str:
    """The threads' CPU seconds per minute of training (the mean over ``runs``), largest first."""
    names = sorted({name for run in runs for name in run.threads})
    per_minute = {
        name: statistics.mean(run.threads.get(name, 0.0) * 60 / run.train_s for run in runs) for name in names
    }
    shown = sorted(((s, n) for n, s in per_minute.items() if s >= 0.05), reverse=True)
    server = statistics.mean(run.server_cpu_s * 60 / run.train_s for run in runs)
    return ", ".join(f"{name} {seconds:.2f}" for seconds, name in shown) + (
        f"; S3 server {server:.2f}" if server >= 0.005 else ""
    )


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def mean_of(values: list[float | None], spec: str = ".2f") -> str:
    """The mean of the known ``values`` with each in brackets; ``-`` when none is known."""
    known = [v for v in values if v is not None]
    return f"{statistics.mean(known):{spec}} ({', '.join(f'{v:{spec}}' for v in known)})" if known else "-"


def baseline_of(variant: str) -> str:
    """The no-checkpoint variant a variant is compared with: ``hf-none`` for the Trainer's, else ``none``."""
    return "hf-none" if variant.startswith("hf-") else "none"


def summary_rows(runs: list[Run], variants: list[str]) -> list[list[str]]:
    rows = []
    for variant in variants:
        base = [run for run in runs if run.variant == baseline_of(variant)]
        base_median = statistics.median([statistics.median(r.step_s) for r in base]) if base else None
        base_mean = statistics.mean([statistics.mean(r.step_s) for r in base]) if base else None
        mine = [run for run in runs if run.variant == variant]
        medians = [statistics.median(run.step_s) * 1e3 for run in mine]
        means = [statistics.mean(run.step_s) * 1e3 for run in mine]
        median, mean = statistics.median(medians), statistics.mean(means)
        rows.append([
            variant, str(len(mine)), f"{median:.2f} ({', '.join(f'{m:.2f}' for m in medians)})",
            f"{mean:.2f} ({', '.join(f'{m:.2f}' for m in means)})",
            f"{median / (base_median * 1e3):.3f}" if base_median else "-",
            f"{mean / (base_mean * 1e3):.3f}" if base_mean else "-",
            mean_of([run.per_step_ms(2) for run in mine]), mean_of([run.per_step_ms(3) for run in mine]),
            mean_of([_minus(run.per_step_ms(1), run.per_step_ms(2)) for run in mine]),
            mean_of([run.switches_per_step() for run in mine]),
            mean_of([run.count_per_step(5) for run in mine], ".0f"),
            mean_of([run.gc_ms_per_step() for run in mine]),
            ", ".join(f"{run.gc.get('gen2 collections', 0):.0f} ({run.gc.get('tracked objects at exit', 0) / 1e3:.0f}k)"
                      for run in mine),
            mean_of([run.hook_ms_per_step("event:") for run in mine], ".3f"),
            mean_of([run.hook_ms_per_step("spot.") for run in mine], ".3f"),
            " / ".join(str(run.checkpoints) for run in mine) if VARIANTS[variant.split("@")[0]][0] != "none" else "-",
            cpu_cell(mine),
        ])  # fmt: skip
    return rows


def hook_lines(runs: list[Run], variants: list[str]) -> list[str]:
    """Per variant with timed hooks: each Trainer event's and library hook's wall (CPU) µs per step."""
    lines = []
    for variant in variants:
        mine = [run for run in runs if run.variant == variant and run.hooks]
        if not mine:
            continue
        names = sorted({name for run in mine for name in run.hooks})
        cells = []
        for name in names:
            walls = [_per_step_us(run, name, 1) for run in mine]
            cpus = [_per_step_us(run, name, 2) for run in mine]
            cells.append(f"{name} {statistics.mean(walls):.1f} ({statistics.mean(cpus):.1f})")
        lines.append(f"- {variant}: " + ", ".join(cells))
    return lines


def _per_step_us(run: Run, name: str, index: int) -> float:
    start, end = run.window["from"], run.window["to"]
    return run.hooks.get(name, [0.0, 0.0, 0.0])[index] / (end[0] - start[0]) * 1e6


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="spot-step-cost-"))
    (workdir / "logs").mkdir()
    load_before = os.getloadavg()
    started = time.monotonic()
    runs: list[Run] = []
    try:
        endpoint = None
        server = None
        if any(VARIANTS[v.split("@")[0]][1] == "s3" for v in args.variants):
            if args.server == "moto":
                server = moto_server(workdir)
            else:
                from transfer import ensure_nanio, nanio_server

                ensure_nanio()
                (workdir / "objects").mkdir()
                server = nanio_server(workdir / "objects", workers=1, key=S3_KEY, secret=S3_SECRET)
            endpoint = server.__enter__()
            make_bucket(s3_options(endpoint), "steps")
        try:
            for index in range(args.rounds):
                for variant in args.variants:
                    run = run_once(args, variant, index, workdir, endpoint)
                    runs.append(run)
                    print(f"  round {index} {variant}: median {statistics.median(run.step_s) * 1e3:.2f} ms/step, "
                          f"mean {statistics.mean(run.step_s) * 1e3:.2f}, main CPU {mean_of([run.per_step_ms(2)])}, "
                          f"process CPU {mean_of([run.per_step_ms(3)])}, switches {mean_of([run.switches_per_step()])}, "
                          f"faults {mean_of([run.count_per_step(5)], '.0f')}, "
                          f"GC {mean_of([run.gc_ms_per_step()])} ms/step {dict(run.gc)}; "
                          f"{cpu_cell([run])}", flush=True)  # fmt: skip
                    if run.hooks:
                        print("   ", *hook_lines([run], [variant]), flush=True)
        finally:
            if server is not None:
                server.__exit__(None, None, None)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    total_s = time.monotonic() - started
    rows = summary_rows(runs, args.variants)
    print_rich_table(HEADERS, rows, "step cost", left=["variant", HEADERS[-1]], width=220)
    command = (f"python benchmarks/step_cost.py --variants {','.join(args.variants)} --rounds {args.rounds} "
               f"--steps {args.steps} --skip {args.skip} --width {args.width} --layers {args.layers} "
               f"--interval-s {args.interval_s:g}"
               + (f" --save-steps {args.save_steps}" if any(v.startswith("hf-steps") for v in args.variants) else "")
               + (f" --server {args.server}" if args.server != "nanio" else "")
               + (f" --base {args.base}" if args.base else ""))  # fmt: skip
    section = [
        "",
        *section_head("Step cost: ms per training step with background checkpoints, interleaved", command,
                      versions_line(("torch", "lightning", "boto3", "s3fs", "nanio")), f" ({total_s:.0f}s)"),  # fmt: skip
        f"- Job: the replay's child (MLP {args.layers}×{args.width} on CPU, 1 torch thread), {args.steps} steps "
        f"uninterrupted per run; SpotCheckpoint interval {args.interval_s:g} s; S3 = "
        f"{'moto (moto.server)' if args.server == 'moto' else 'nanio (1 worker)'} on this box; "
        f"{args.rounds} round(s), variants interleaved in the order listed.",
        "- ms/step: the gaps between consecutive steps' end times, the first "
        f"{args.skip} steps and the last 2 % left out; median and mean per run, then the median of the medians "
        "and the mean of the means (per run in brackets); / none: against the no-checkpoint runs. CPU: each "
        "thread's CPU seconds (`time.thread_time` at its end, `/proc/self/task` at exit; the main thread's "
        "include start-up) per minute of training, threads of one name summed; `native:` a thread no Python "
        "code started; S3 server: the server process's CPU (another process on the same cores). main thread CPU / process CPU / off-CPU (wall less the main thread's CPU: waits for the "
        "GIL, for a core, for memory) / involuntary context switches: per step over the same steady window, "
        "measured inside the process at its step markers; minor page faults per step likewise. GC: the garbage collector's time per step in that "
        "window (`gc.callbacks`), its full collections, and the objects it tracks at exit. Hugging Face "
        f"(`hf-*`, the heap kept as in the replays; hf-steps saves every {args.save_steps} steps into a local "
        "folder, checkpoints = the `checkpoint-N` it kept; / none against `hf-none`): Trainer callbacks = the "
        "wall time of every Trainer event's callbacks (`CallbackHandler.call_event`, all callbacks), library "
        "hooks = that of `SpotCheckpointCallback`'s own hooks, per step in the same window; per hook below "
        "(µs per step, wall and in brackets main thread CPU).",
        "- Load average (1, 5, 15 min) before: " + ", ".join(f"{v:.2f}" for v in load_before)
        + "; after: " + ", ".join(f"{v:.2f}" for v in os.getloadavg()),
        "",
        *markdown_table(HEADERS, rows),
        "",
        *(["Hooks, µs per step: wall (main thread CPU); `event:` all callbacks of a Trainer event, `spot.` "
           "the library's own:", "", *hook_lines(runs, args.variants), ""] if any(r.hooks for r in runs) else []),
    ]  # fmt: skip
    record(args, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
