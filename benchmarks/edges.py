"""The two edges of a spot machine's billed time: spawn to the first step, and SIGTERM to exit.

The goodput replay (``replay.py``) bills each machine from spawn to exit; between those the library's
own share is its start-up (imports, the store's preflight, the run lock, the resume's pull) and its
exit after a notice (the emergency checkpoint, its commit, the lock's release, the interpreter's
exit). This runs the replay's own child (``_replay_child.py``) on a fresh machine each time, against
one nanio (or moto) S3 store: a first machine on an empty store and a second that resumes from it,
each sent SIGTERM once it has trained ``--steps-before-term`` steps. It measures, per machine,
spawn to the first step (start-up), the call of ``train``/``fit`` to the first step (in fit), and the
last step to exit (the emergency path). ``--trees`` compares checkouts of the library (a baseline
and a change), interleaved round by round so that the box's drifting load falls on both alike.

    python benchmarks/edges.py --quick
    python benchmarks/edges.py --trees /tmp/base,. --variants hf-spot,spot --rounds 3 --no-append
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
from replay import Replay, s3_server

VARIANTS = ("hf-spot", "spot", "spot-auto")
QUICK = {"rounds": 1, "steps_before_term": 50, "width": 256, "layers": 3}
HEADERS = ["variant", "tree", "machine", "start-up s", "in fit s", "last step to exit s", "runs"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", default=str(REPO_ROOT), help="comma-separated checkouts of the library")
    parser.add_argument("--variants", default="hf-spot", help="replay child variants: hf-spot, spot, ...")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-before-term", type=int, default=200)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--grace-s", type=float, default=5.0)
    parser.add_argument("--store", choices=("moto", "nanio"), default="nanio")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    apply_quick(parser, args, QUICK)
    args.variants = choice_list(parser, args.variants, VARIANTS, "--variants")
    return args


def one_machine(
    replay: Replay, tree: str, variant: str, key: str, index: int, args: argparse.Namespace
) -> dict:
    """Spawn one machine, SIGTERM it after ``--steps-before-term`` steps; its edges in seconds."""
    machine = replay.workdir / "machines" / f"{key}-{index}"
    env = replay.machine_env(machine, f"edges-{key}-{index}")
    env["PYTHONPATH"] = os.pathsep.join([tree, str(REPO_ROOT / "benchmarks")])
    argv = replay.child_argv(variant, key, replay.workdir / "out.pt")
    argv[argv.index("--steps") + 1] = "100000"
    log_path = replay.workdir / "logs" / f"{key}-{index}.log"
    lines: list[str] = []
    enough = threading.Event()
    spawned = time.time()
    proc = subprocess.Popen(argv, cwd=machine / "work", env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip

    def read() -> None:
        assert proc.stdout is not None
        seen = 0
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("REPLAY STEP"):
                seen += 1
                if seen >= args.steps_before_term:
                    enough.set()
        enough.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    enough.wait(timeout=300)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=args.grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    exited = time.time()
    reader.join(timeout=10)
    log_path.write_text("".join(lines))
    steps, _ = parse_markers(lines)
    ready = ready_at(lines)
    if not steps:
        raise SystemExit(f"no step on {key}-{index}: see {log_path}")
    return {
        "startup": steps[0][1] - spawned,
        "in_fit": steps[0][1] - ready if ready is not None else float("nan"),
        "exit": exited - steps[-1][1],
        "rc": proc.returncode,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trees = [str(Path(tree).resolve()) for tree in args.trees.split(",")]
    variants = args.variants
    workdir = Path(tempfile.mkdtemp(prefix="spot-edges-"))
    (workdir / "logs").mkdir()
    load_before = load_average()
    started = time.monotonic()
    results: dict[tuple[str, str, int], list[dict]] = {}
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
        for round_ in range(args.rounds):
            order = trees if round_ % 2 == 0 else trees[::-1]
            for variant in variants:
                for tree in order:
                    key = f"{variant}-t{trees.index(tree)}-r{round_}"
                    for index in (0, 1):  # a fresh store, then a resume from it
                        got = one_machine(replay, tree, variant, key, index, args)
                        results.setdefault((variant, tree, index), []).append(got)
                        print(f"round {round_} {variant} {tree} machine {index}: start-up {got['startup']:.2f} s "
                              f"(in fit {got['in_fit']:.2f}), last step to exit {got['exit']:.2f} s, rc {got['rc']}",
                              flush=True)  # fmt: skip
    rows = []
    for (variant, tree, index), runs in results.items():
        cells = []
        for name in ("startup", "in_fit", "exit"):
            values = [r[name] for r in runs]
            cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}..{max(values):.2f})")
        rows.append([variant, tree, "fresh store" if index == 0 else "resume", *cells, str(len(runs))])
    print_rich_table(
        HEADERS, rows, "start-up and exit, medians (min..max)", left=["variant", "tree", "machine"]
    )
    command = (f"python benchmarks/edges.py --trees {args.trees} --variants {','.join(variants)} --rounds "
               f"{args.rounds} --steps-before-term {args.steps_before_term} --width {args.width} --layers "
               f"{args.layers} --grace-s {args.grace_s:g} --store {args.store}")  # fmt: skip
    record(args, [
        "",
        *section_head("Start-up and exit edges", command, versions_line(("torch", "lightning", "transformers")),
                      f" ({time.monotonic() - started:.0f}s)"),
        f"- Each machine: the replay's child (MLP {args.layers}×{args.width}, heap kept) on a fresh machine, "
        f"SIGTERM after {args.steps_before_term} steps; a fresh store, then a resume from it; trees interleaved, "
        "their order alternating per round.",
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
