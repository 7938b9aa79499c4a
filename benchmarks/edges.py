"""The two edges of a spot machine's billed time: spawn to the first step, and the last step to exit.

The goodput replay (``replay.py``) bills each machine from spawn to exit; between those the library's
own share is its start-up (imports, the store's preflight, the run lock, the resume's pull) and its
exit: after a notice (the emergency checkpoint, its commit, the lock's release, the interpreter's
exit) or at a normal end (the final checkpoint, waiting for its commit, retention, the attempt
record's close, the lock's release, the interpreter's exit). This runs the replay's own child
(``_replay_child.py``) on a fresh machine each time, against one nanio (or moto) S3 store: a first
machine on an empty store and a second that resumes from it. ``--ends term`` sends each SIGTERM once
it has trained ``--steps-before-term`` steps; ``--ends normal`` lets the first train ``--normal-steps``
steps and end, the second resume from that and train as many again. It measures, per machine, spawn
to the first step (start-up), the call of ``train``/``fit`` to the first step (in fit), and the last
step to exit, each in wall seconds and in the child's CPU seconds (its ``/proc`` counters at the step's
marker, the kernel's rusage at exit: a figure that drifts less than wall time with other work on the
box). ``--trees`` compares checkouts of the library (a baseline and a change), interleaved round by
round so that the box's drifting load falls on both alike. The framework's own ``hf-steps`` and ``mc``
variants run too (their start-up and their local save at a normal end, for comparison).

    python benchmarks/edges.py --quick
    python benchmarks/edges.py --trees /tmp/base,. --variants hf-spot,spot --rounds 3 --no-append
    python benchmarks/edges.py --ends normal --variants hf-spot,hf-steps --rounds 3 --no-append
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import (
    REPO_ROOT,
    add_common_args,
    apply_quick,
    choice_list,
    load_average,
    markdown_table,
    print_rich_table,
    record,
    section_head,
    versions_line,
)
from _replay_outcome import parse_markers, ready_at
from _servers import make_bucket, s3_options
from replay import Replay, byte_compile_library, s3_server

VARIANTS = ("hf-spot", "spot", "spot-auto", "hf-steps", "mc")
ENDS = ("term", "normal")
QUICK = {"rounds": 1, "steps_before_term": 50, "normal_steps": 60, "width": 256, "layers": 3}
HEADERS = ["variant", "tree", "end", "machine", "start-up s", "start-up CPU s", "in fit s", "last step to exit s",
           "last step to exit CPU s", "runs"]  # fmt: skip
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", default=str(REPO_ROOT), help="comma-separated checkouts of the library")
    parser.add_argument("--variants", default="hf-spot", help="replay child variants: hf-spot, spot, ...")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--ends", default="term", help="how each machine ends: term (SIGTERM), normal, or both"
    )
    parser.add_argument("--steps-before-term", type=int, default=200)
    parser.add_argument(
        "--normal-steps",
        type=int,
        default=300,
        help="--ends normal: steps of the first machine (and of the second)",
    )
    parser.add_argument(
        "--save-steps", type=int, default=100, help="hf-steps: steps between the Trainer's saves"
    )
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--grace-s", type=float, default=5.0)
    parser.add_argument("--store", choices=("moto", "nanio"), default="nanio")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    apply_quick(parser, args, QUICK)
    args.variants = choice_list(parser, args.variants, VARIANTS, "--variants")
    args.ends = choice_list(parser, args.ends, ENDS, "--ends")
    return args


def cpu_s(pid: int) -> float | None:
    """The CPU seconds (user + system, all threads) a live process has used so far, from ``/proc``."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def has_exited(pid: int) -> bool:
    """True once the child ``pid`` has exited, left unreaped (:func:`reap` collects its status and rusage)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def reap(pid: int, timeout_s: float | None) -> tuple[int, float, float] | None:
    """Wait up to ``timeout_s`` for ``pid`` to exit: (return code, exit time, its CPU seconds), or None."""
    got: list[tuple[int, float, float]] = []

    def wait() -> None:
        _, status, usage = os.wait4(pid, 0)
        got.append((os.waitstatus_to_exitcode(status), time.time(), usage.ru_utime + usage.ru_stime))

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(timeout_s)
    return got[0] if got else None


def one_machine(
    replay: Replay, tree: str, variant: str, key: str, index: int, end: str, args: argparse.Namespace
) -> dict:
    """Spawn one machine and end it (``term``: SIGTERM after ``--steps-before-term`` steps; ``normal``:
    it trains ``--normal-steps`` more steps and ends); its edges in seconds, wall and CPU."""
    machine = replay.workdir / "machines" / f"{key}-{index}"
    env = replay.machine_env(machine, f"edges-{key}-{index}")
    env["PYTHONPATH"] = os.pathsep.join([tree, str(REPO_ROOT / "benchmarks")])
    argv = replay.child_argv(variant, key, replay.workdir / "out.pt")
    steps_to = args.normal_steps * (index + 1) if end == "normal" else 100000
    argv[argv.index("--steps") + 1] = str(steps_to)
    log_path = replay.workdir / "logs" / f"{key}-{index}.log"
    lines: list[str] = []
    step_cpu: list[float | None] = []  # the child's CPU seconds as each step's marker was read
    enough = threading.Event()
    spawned = time.time()
    proc = subprocess.Popen(argv, cwd=machine / "work", env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("REPLAY STEP"):
                step_cpu.append(cpu_s(proc.pid))
                if end == "term" and len(step_cpu) >= args.steps_before_term:
                    enough.set()
        enough.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if end == "term":
        enough.wait(timeout=300)
        if not has_exited(proc.pid):  # not proc.poll(): it would reap the child, and reap() could not
            os.kill(proc.pid, signal.SIGTERM)
    reaped = reap(proc.pid, args.grace_s if end == "term" else 600)
    if reaped is None:
        proc.kill()
        reaped = reap(proc.pid, None)
    assert reaped is not None
    proc.returncode, exited, total_cpu_s = reaped
    reader.join(timeout=10)
    log_path.write_text("".join(lines))
    steps, _ = parse_markers(lines)
    ready = ready_at(lines)
    if not steps:
        raise SystemExit(f"no step on {key}-{index}: see {log_path}")
    first_cpu, last_cpu = (step_cpu[0], step_cpu[-1]) if step_cpu else (None, None)
    return {
        "startup": steps[0][1] - spawned,
        "startup_cpu": first_cpu if first_cpu is not None else float("nan"),
        "in_fit": steps[0][1] - ready if ready is not None else float("nan"),
        "exit": exited - steps[-1][1],
        "exit_cpu": total_cpu_s - last_cpu if last_cpu is not None else float("nan"),
        "rc": proc.returncode,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trees = [str(Path(tree).resolve()) for tree in args.trees.split(",")]
    for tree in trees:
        byte_compile_library(tree)
    variants = args.variants
    workdir = Path(tempfile.mkdtemp(prefix="spot-edges-"))
    (workdir / "logs").mkdir()
    load_before = load_average()
    started = time.monotonic()
    results: dict[tuple[str, str, str, int], list[dict]] = {}
    replay_args = argparse.Namespace(
        steps=100000,
        width=args.width,
        layers=args.layers,
        interval_s=15.0,
        grace_s=args.grace_s,
        keep_heap=True,
    )
    with s3_server(args.store, workdir) as endpoint:
        make_bucket(s3_options(endpoint), "replay")
        replay = Replay(replay_args, workdir, endpoint)
        replay.save_steps = args.save_steps
        for round_ in range(args.rounds):
            order = trees if round_ % 2 == 0 else trees[::-1]
            for end in args.ends:
                for variant in variants if round_ % 2 == 0 else variants[::-1]:
                    for tree in order:
                        key = f"{variant}-{end}-t{trees.index(tree)}-r{round_}"
                        for index in (0, 1):  # a fresh store, then a resume from it
                            got = one_machine(replay, tree, variant, key, index, end, args)
                            results.setdefault((variant, tree, end, index), []).append(got)
                            print(f"round {round_} {variant} {end} {tree} machine {index}: start-up "
                                  f"{got['startup']:.2f} s ({got['startup_cpu']:.2f} CPU s, in fit {got['in_fit']:.2f}), "
                                  f"last step to exit {got['exit']:.2f} s ({got['exit_cpu']:.2f} CPU s), rc {got['rc']}",
                                  flush=True)  # fmt: skip
    rows = []
    for (variant, tree, end, index), runs in sorted(
        results.items(),
        key=lambda item: (variants.index(item[0][0]), item[0][2], item[0][3], trees.index(item[0][1])),
    ):
        cells = []
        for name in ("startup", "startup_cpu", "in_fit", "exit", "exit_cpu"):
            values = [r[name] for r in runs]
            cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}..{max(values):.2f})")
        rows.append([variant, tree, end, "fresh store" if index == 0 else "resume", *cells, str(len(runs))])
    print_rich_table(
        HEADERS, rows, "start-up and exit, medians (min..max)", left=["variant", "tree", "end", "machine"]
    )
    command = (f"python benchmarks/edges.py --trees {args.trees} --variants {','.join(variants)} --ends "
               f"{','.join(args.ends)} --rounds {args.rounds} --steps-before-term {args.steps_before_term} "
               f"--normal-steps {args.normal_steps} --save-steps {args.save_steps} --width {args.width} --layers "
               f"{args.layers} --grace-s {args.grace_s:g} --store {args.store}")  # fmt: skip
    record(args, [
        "",
        *section_head("Start-up and exit edges", command, versions_line(("torch", "lightning", "transformers")),
                      f" ({time.monotonic() - started:.0f}s)"),
        f"- Each machine: the replay's child (MLP {args.layers}×{args.width}, heap kept) on a fresh machine; "
        f"term: SIGTERM after {args.steps_before_term} steps; normal: {args.normal_steps} steps and the end of "
        "training; a fresh store, then a resume from it; trees and variants interleaved, their order alternating "
        "per round; each tree's library byte-compiled first, as installed from its wheel. CPU s: the child's user + system seconds (all threads) from spawn to the first step's "
        "marker, and from the last step's marker to its exit (`/proc`, then the kernel's rusage at exit).",
        f"- Load average (1, 5, 15 min): before {load_before}; after {load_average()}",
        "",
        *markdown_table(HEADERS, rows),
        "",
    ])  # fmt: skip
    if args.keep:
        print(f"work folder kept: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
