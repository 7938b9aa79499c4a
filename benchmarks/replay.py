"""Goodput replay: a training run interrupted on a schedule, every restart a new machine, measured from outside.

A parent drives a child training process (``_replay_child.py``: a small MLP on CPU) and interrupts
each attempt at scheduled times from its spawn: a notice (SIGTERM, SIGKILL ``--grace-s`` later) or
a hard SIGKILL. Each restart is a new machine, started ``--restart-gap-s`` after the previous one
ended: an empty working directory, HOME, TMPDIR and SPOT_SCRATCH, and a host name of its own. The
library's variants checkpoint to one S3 store on moto; the frameworks' own checkpoints go to a
folder that stands for a persistent volume (never wiped). Per variant: billed time (spawn to exit,
summed), goodput (the uninterrupted run's time / billed), steps redone per restart, downtime
(spawn to first step), whether the final weights equal the uninterrupted run's, and, for this
library, what ``spot-callbacks report --json`` and ``plan --from`` say.

    python benchmarks/replay.py --quick                             # a check that it runs
    python benchmarks/replay.py --variants spot,mc,none             # the fixed schedule
    python benchmarks/replay.py --schedule poisson --bands gt20 --variants spot,mc
    python benchmarks/replay.py --variants hf-spot,hf-steps,hf-none
    python benchmarks/replay.py --variants hf-spot,hf-steps --rounds 2 --abba   # A B, then B A

``--rounds N`` runs every variant N times (each time on a store folder of its own); ``--abba`` reverses
the variants' order in every other round, so that a slow stretch of the shared box falls on each
variant alike; the section then gives each variant's mean over the rounds beside the rows.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import (
    REPO_ROOT,
    add_common_args,
    apply_quick,
    choice_list,
    fmt,
    markdown_table,
    print_rich_table,
    record,
    section_head,
    versions_line,
)
from _replay_outcome import (
    Attempt,
    Outcome,
    around,
    interleaved,
    parse_markers,
    per_step_s,
    ready_at,
    round_order,
)
from _replay_schedule import (
    BAND_LABELS,
    BANDS,
    Schedule,
    fixed_schedule,
    interruption_for,
    poisson_schedule,
    rate_per_s,
)
from _servers import S3_KEY, S3_SECRET, make_bucket, moto_server, s3_options

CHILD = Path(__file__).resolve().parent / "_replay_child.py"
# glibc keeps its heap: no trim of its top at every free, no mmap/munmap per block under 32 MiB (--keep-heap)
KEEP_HEAP = {"MALLOC_TRIM_THRESHOLD_": str(2**30), "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20)}
LIGHTNING = ("spot", "spot-auto", "mc", "none")
HF = ("hf-spot", "hf-steps", "hf-none")
LIBRARY = ("spot", "spot-auto", "hf-spot")
BASELINE = {"lightning": "none", "hf": "hf-none"}
LABELS = {
    "spot": "SpotCheckpoint interval=15s",
    "spot-auto": 'SpotCheckpoint interval="auto"',
    "mc": "ModelCheckpoint 15s + save_last + OnExceptionCheckpoint",
    "none": "no checkpoint (restart from scratch)",
    "hf-spot": "SpotCheckpointCallback interval=15s",
    "hf-steps": "Trainer save_steps (~15s) + resume_from_checkpoint=True",
    "hf-none": "no checkpoint (restart from scratch)",
}
QUICK = {"steps": 1500, "width": 256, "layers": 3, "variants": "spot,mc,none", "time_scale": 0.4}
HEADERS = ["variant", "schedule", "attempts", "interruptions", "billed s", "goodput", "useful share", "kept share",
           "lost steps per restart", "lost s (sum)", "lost s at own speed (sum)", "downtime per restart s", "of which in fit s", "weights equal",
           "report goodput", "report billed s", "report lost s", "plan goodput"]  # fmt: skip


def framework_of(variant: str) -> str:
    return "hf" if variant in HF else "lightning"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="spot,spot-auto,mc,none", help=f"of {','.join(LIGHTNING + HF)}")
    parser.add_argument("--schedule", choices=["fixed", "poisson"], default="fixed")
    parser.add_argument("--bands", default="gt20", help=f"poisson: Spot Advisor bands, of {','.join(BANDS)}")
    parser.add_argument("--month-s", type=float, default=20.0, help="poisson: one month compressed into this")
    parser.add_argument(
        "--notice-share", type=float, default=0.5, help="poisson: share of interruptions with notice"
    )
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--time-scale", type=float, default=1.0, help="fixed: the schedule's times × this")
    parser.add_argument("--steps", type=int, default=1300, help="training steps (the job's size)")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--interval-s", type=float, default=15.0)
    parser.add_argument("--grace-s", type=float, default=5.0, help="SIGTERM to SIGKILL; SPOT_SIGNAL_GRACE_S")
    parser.add_argument("--restart-gap-s", type=float, default=3.0)
    parser.add_argument(
        "--store", choices=("moto", "nanio"), default="moto",
        help="the S3 server on this box: moto (the tests' server; receiving an upload costs it several "
        "times a real client's CPU, taken from the training's cores) or nanio (a fast one)",
    )  # fmt: skip
    parser.add_argument(
        "--keep-heap", action="store_true",
        help="every machine (the baselines too) runs with glibc keeping its heap (MALLOC_TRIM_THRESHOLD_, "
        "MALLOC_MMAP_THRESHOLD_): without it a CPU step's speed turns on page faults from the heap's layout, "
        "not on the variant (step_cost.py)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1, help="every variant this many times")
    parser.add_argument(
        "--abba", action="store_true", help="reverse the variants' order in every other round (A B, B A, ...)"
    )
    parser.add_argument("--max-attempts", type=int, default=12)
    parser.add_argument(
        "--baseline-every", type=int, default=2, help="an uninterrupted baseline after every N variant runs"
    )
    parser.add_argument("--attempt-timeout-s", type=float, default=900.0)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs) and print its path")
    add_common_args(parser)
    args = parser.parse_args(argv)
    apply_quick(parser, args, QUICK)
    args.variants = choice_list(parser, args.variants, LIGHTNING + HF, "--variants")
    args.bands = choice_list(parser, args.bands, tuple(BANDS), "--bands")
    return args


@contextlib.contextmanager
def s3_server(kind: str, workdir: Path) -> Iterator[str]:
    """The endpoint of a fresh S3 server on loopback: moto, or nanio (``transfer.py``'s)."""
    if kind == "moto":
        with moto_server(workdir) as endpoint:
            yield endpoint
        return
    from transfer import ensure_nanio, nanio_server

    ensure_nanio()
    (workdir / "objects").mkdir()
    with nanio_server(workdir / "objects", workers=1, key=S3_KEY, secret=S3_SECRET) as endpoint:
        yield endpoint


@dataclass
class Replay:
    """Where one replay keeps its things, and what every machine shares."""

    args: argparse.Namespace
    workdir: Path
    endpoint: str

    @property
    def storage_options(self) -> dict[str, Any]:
        return s3_options(self.endpoint)

    def child_argv(self, variant: str, key: str, out: Path) -> list[str]:
        args = self.args
        argv = [sys.executable, str(CHILD), "--variant", variant, "--steps", str(args.steps), "--width",
                str(args.width), "--layers", str(args.layers), "--interval-s", str(args.interval_s),
                "--out", str(out), "--dirpath", f"s3://replay/{key}",
                "--storage-options", json.dumps(self.storage_options),
                "--persist-dir", str(self.workdir / "persistent" / key)]  # fmt: skip
        if variant == "hf-steps":
            argv += ["--save-steps", str(self.save_steps)]
        return argv

    save_steps: int = 0  # hf-steps: steps in one interval at the baseline's speed

    def machine_env(self, machine: Path, hostname: str) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith(("SPOT_", "AWS_"))}
        for name in ("home", "tmp", "scratch", "work"):
            (machine / name).mkdir(parents=True)
        env.update({
            "HOME": str(machine / "home"), "TMPDIR": str(machine / "tmp"), "SPOT_SCRATCH": str(machine / "scratch"),
            "HF_HOME": str(machine / "home" / "hf"), "HF_HUB_OFFLINE": "1", "REPLAY_HOSTNAME": hostname,
            "SPOT_SIGNAL_GRACE_S": f"{self.args.grace_s:g}", "AWS_ACCESS_KEY_ID": S3_KEY,
            "AWS_SECRET_ACCESS_KEY": S3_SECRET, "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1",
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        })  # fmt: skip
        if self.args.keep_heap:
            env.update(KEEP_HEAP)
        return env

    def attempt(self, variant: str, key: str, index: int, schedule: Schedule, out: Path) -> Attempt:
        """One machine: spawned in a fresh folder, interrupted as scheduled, its folder wiped after."""
        machine = self.workdir / "machines" / f"{key}-{index}"
        env = self.machine_env(machine, f"replay-{key}-{index}")
        log_path = self.workdir / "logs" / f"{key}-{index}.log"
        interruption = interruption_for(schedule, index)
        with open(log_path, "wb") as log:
            spawned = time.time()
            proc = subprocess.Popen(self.child_argv(variant, key, out), cwd=machine / "work", env=env,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
            sent: list[str] = []
            try:
                for at_s, name in interruption.signals() if interruption else []:
                    try:
                        proc.wait(timeout=max(0.0, spawned + at_s - time.time()))
                        break
                    except subprocess.TimeoutExpired:
                        proc.send_signal(getattr(signal, name))
                        sent.append(name)
                proc.wait(timeout=max(1.0, spawned + self.args.attempt_timeout_s - time.time()))
            finally:
                if proc.poll() is None:  # past the attempt's time limit, or the replay itself is stopped
                    proc.kill()
                    proc.wait()
            exited = time.time()
        lines = log_path.read_text(errors="replace").splitlines()
        steps, done = parse_markers(lines)
        shutil.rmtree(machine)  # the machine is gone; what it left is in the store or the persistent folder
        described = interruption.describe() if sent and interruption else "-"
        return Attempt(spawned, exited, proc.returncode, described, steps, done, ready_at(lines))

    def run_variant(self, variant: str, key: str, schedule: Schedule) -> list[Attempt]:
        out = self.workdir / "out" / f"{key}.pt"
        attempts: list[Attempt] = []
        for index in range(self.args.max_attempts):
            if index:
                time.sleep(self.args.restart_gap_s)  # the next machine boots; not billed
            attempt = self.attempt(variant, key, index, schedule, out)
            attempts.append(attempt)
            print(f"  [{key}] machine {index}: {attempt.billed_s:.1f}s billed, exit {attempt.exit_code}, "
                  f"{attempt.interruption}, steps {attempt.first_step}..{attempt.last_step}"
                  f"{', done' if attempt.done else ''}", flush=True)  # fmt: skip
            if attempt.done or attempt.interruption == "-":
                break  # finished, or failed on its own (an error, not an interruption): the replay stops there
        return attempts

    def library_figures(self, key: str, baseline_s: float) -> dict[str, str]:
        """``spot-callbacks report --json`` and ``plan --from`` on the variant's store; "n/a" for what is missing."""
        url = f"s3://replay/{key}"
        cli = [sys.executable, "-m", "spot_callbacks.cli"]
        options = ["--storage-options", json.dumps(self.storage_options)]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        figures = {
            "report goodput": "n/a",
            "report billed s": "n/a",
            "report lost s": "n/a",
            "plan goodput": "n/a",
        }
        done = subprocess.run([*cli, "report", url, "--json", "--all", *options], capture_output=True, text=True,
                              env=env, timeout=300)  # fmt: skip
        (self.workdir / "logs" / f"{key}-report.json").write_text(done.stdout + done.stderr)
        try:
            report = json.loads(done.stdout)
        except json.JSONDecodeError:
            report = {}
        if isinstance(report.get("goodput"), (int, float)):
            figures["report goodput"] = f"{report['goodput']:.3f}"
        if isinstance(report.get("billed_s"), (int, float)):
            figures["report billed s"] = f"{report['billed_s']:.1f}"
        resumes = report.get("recent_resumes")
        if report.get("goodput_basis") == "attempts" and isinstance(report.get("lost_work_s"), (int, float)):
            processes = report.get("attempts") or []
            figures["report lost s"] = (
                f"{report['lost_work_s']:.1f} (from {len(processes)} processes' step records)"
            )
        elif isinstance(resumes, list):
            lost = [r.get("lost_work_s") for r in resumes if isinstance(r, dict)]
            numbers = [v for v in lost if isinstance(v, (int, float))]
            measured = sum(1 for r in resumes if isinstance(r, dict) and r.get("lost_work_measured"))
            figures["report lost s"] = f"{sum(numbers):.1f} ({measured}/{len(lost)} measured)"
        figures["report json"] = json.dumps(
            {k: report.get(k) for k in ("goodput", "billed_s", "interruptions")}
        )
        hours = (
            1000 * baseline_s / 3600
        )  # the model is linear in the work: 1000 jobs, so that plan's hours have digits
        plan = subprocess.run([*cli, "plan", "--from", url, "--work-hours", f"{hours:.6f}", "--spot-price", "1",
                               "--on-demand-price", "3", *options], capture_output=True, text=True, env=env,
                              timeout=300)  # fmt: skip
        (self.workdir / "logs" / f"{key}-plan.txt").write_text(plan.stdout + plan.stderr)
        expected = plan_expected_hours(plan.stdout)
        if expected:
            figures["plan goodput"] = f"{hours / expected:.3f}"
        elif plan.returncode:
            figures["plan goodput"] = (
                "n/a (" + (plan.stderr.strip().splitlines() or ["error"])[-1][-80:] + ")"
            )
        return figures


def plan_expected_hours(text: str) -> float | None:
    """The expected hours on spot from ``plan``'s ``spot  $X, Y h expected`` line."""
    import re

    for line in text.splitlines():
        found = re.match(r"\s*spot\s+\S+,\s*([\d,.]+)\s*(h|min|s)\b.*expected", line)
        if found:
            value = float(found.group(1).replace(",", ""))
            return value * {"h": 1.0, "min": 1 / 60, "s": 1 / 3600}[found.group(2)]
    return None


def weights_equal(a: Path, b: Path) -> bool | None:
    import torch

    if not (a.exists() and b.exists()):
        return None
    left, right = torch.load(a), torch.load(b)
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def schedules(args: argparse.Namespace) -> dict[str, Schedule]:
    if args.schedule == "fixed":
        return {"fixed": fixed_schedule(args.time_scale, args.grace_s)}
    return {
        f"poisson {BAND_LABELS[band]}": poisson_schedule(band, args.month_s, args.seed, args.notice_share,
                                                         args.grace_s, args.max_attempts - 1)
        for band in args.bands
    }  # fmt: skip


def replay(args: argparse.Namespace, workdir: Path) -> list[Outcome]:
    """Every variant over every schedule, an uninterrupted baseline of its framework before the first,
    after every ``--baseline-every`` of them and after the last (:func:`interleaved`).

    Each variant's goodput is against the mean of the two baselines around it: the box's speed drifts
    with other work on it, and a baseline run once, at the start, was slower than the interrupted
    attempts that followed it. Every baseline must end with the same weights (the check of the check).
    """
    (workdir / "logs").mkdir(parents=True)
    (workdir / "out").mkdir()
    plans = schedules(args)
    outcomes: list[Outcome] = []
    args.baselines = {}
    with s3_server(args.store, workdir) as endpoint:
        make_bucket(s3_options(endpoint), "replay")
        run = Replay(args, workdir, endpoint)
        for framework in sorted({framework_of(v) for v in args.variants}):
            ours = [variant for variant in args.variants if framework_of(variant) == framework]
            jobs = [f"{variant}\t{label}\t{round_}" for round_, variant in round_order(ours, args.rounds, args.abba)
                    for label in plans]  # fmt: skip
            baselines: list[Attempt] = []
            runs: list[tuple[str, str, str, list[Attempt], int]] = []  # ..., index of the baseline before
            for job in interleaved(jobs, args.baseline_every):
                if job is None:
                    key = f"baseline-{framework}-{len(baselines)}"
                    print(f"baseline {framework} #{len(baselines)}: uninterrupted", flush=True)
                    (attempt,) = run.run_variant(BASELINE[framework], key, [None])
                    if not attempt.done:
                        raise SystemExit(f"the uninterrupted {framework} run failed: see {workdir}/logs")
                    baselines.append(attempt)
                    continue
                variant, label, round_ = job.split("\t")
                if variant == "hf-steps":
                    run.save_steps = max(1, round(args.interval_s / per_step_s(baselines[-1])))
                key = f"{variant}-{label.replace(' ', '-').replace('%', '').replace('<', 'lt').replace('>', 'gt')}"
                schedule = plans[label]
                if args.rounds > 1:
                    key, label = f"{key}-r{round_}", f"{label} r{round_}"
                print(f"{variant} on {label}: {', '.join(i.describe() if i else '-' for i in schedule[:6])}",
                      flush=True)  # fmt: skip
                runs.append(
                    (variant, label, key, run.run_variant(variant, key, schedule), len(baselines) - 1)
                )
            first_out = workdir / "out" / f"baseline-{framework}-0.pt"
            same = [weights_equal(workdir / "out" / f"baseline-{framework}-{i}.pt", first_out)
                    for i in range(1, len(baselines))]  # fmt: skip
            if not all(same):
                print(
                    f"WARNING: the uninterrupted {framework} runs ended with different weights: {same}",
                    flush=True,
                )
            for variant, label, key, attempts, before in runs:
                baseline_s, step_s = around(baselines[before : before + 2])
                equal = weights_equal(workdir / "out" / f"{key}.pt", first_out)
                outcome = Outcome(variant, label, attempts, baseline_s, step_s, args.steps, equal)
                if variant in LIBRARY:
                    outcome.report = run.library_figures(key, baseline_s)
                outcomes.append(outcome)
            for index, base in enumerate(baselines):
                print(f"baseline {framework} #{index}: {base.billed_s:.1f}s spawn to exit, start-up "
                      f"{base.startup_s:.1f}s, {per_step_s(base) * 1000:.1f} ms/step", flush=True)  # fmt: skip
            args.baselines[framework] = [(b.billed_s, b.startup_s, per_step_s(b)) for b in baselines]
    return outcomes


def row(outcome: Outcome) -> list[str]:
    lost = outcome.lost_steps
    downtimes = outcome.restart_downtimes_s
    equal = {None: "no final weights", True: "yes", False: "no"}[outcome.weights_equal]
    report = outcome.report
    return [
        outcome.variant, outcome.schedule, str(len(outcome.attempts)), str(outcome.interruptions),
        f"{outcome.billed_s:.1f}", f"{outcome.goodput:.3f}" if outcome.finished else "unfinished",
        fmt(outcome.useful_share if outcome.finished else None), f"{outcome.kept_share:.3f}", " / ".join(str(n) for n in lost) or "-",
        f"{sum(outcome.lost_s):.1f}", f"{sum(outcome.lost_own_s):.1f}", " / ".join(f"{d:.1f}" for d in downtimes) or "-",
        " / ".join(f"{d:.1f}" for d in outcome.restart_in_fit_s) or "-", equal,
        report.get("report goodput", "-"), report.get("report billed s", "-"), report.get("report lost s", "-"),
        report.get("plan goodput", "-"),
    ]  # fmt: skip


def breakdown(outcome: Outcome) -> str:
    """Each machine's billed seconds split: spawn to first step, training (steps, ms/step), last step to exit."""
    parts = []
    for attempt in outcome.attempts:
        if len(attempt.steps) < 2 or attempt.startup_s is None:
            parts.append(f"{attempt.billed_s:.1f} s, no steps")
            continue
        (first, t_first), (last, t_last) = attempt.steps[0], attempt.steps[-1]
        parts.append(
            f"{attempt.startup_s:.1f} + {last - first + 1} steps in {t_last - t_first:.1f} s "
            f"({(t_last - t_first) / (last - first) * 1e3:.1f} ms/step) + {attempt.exited - t_last:.1f} s"
        )
    return f"{outcome.variant} ({outcome.schedule}): " + "; ".join(parts)


def round_means(outcomes: list[Outcome]) -> list[str]:
    """Per variant and schedule, the mean (min..max) goodput and kept share over its rounds."""
    groups: dict[tuple[str, str], list[Outcome]] = {}
    for outcome in outcomes:
        groups.setdefault((outcome.variant, outcome.schedule.rsplit(" r", 1)[0]), []).append(outcome)
    lines = []
    for (variant, schedule), group in groups.items():
        figures = []
        for name, values in (
            ("goodput", [o.goodput for o in group if o.finished]),
            ("kept share", [o.kept_share for o in group]),
            ("billed s", [o.billed_s for o in group]),
        ):
            if values:
                mean = sum(values) / len(values)
                figures.append(f"{name} {mean:.3f} ({min(values):.3f}..{max(values):.3f})")
        lines.append(f"{variant} ({schedule}, {len(group)} rounds): " + ", ".join(figures))
    return lines


def command_line(args: argparse.Namespace) -> str:
    parts = ["python benchmarks/replay.py", f"--variants {','.join(args.variants)}", f"--schedule {args.schedule}",
             f"--steps {args.steps} --width {args.width} --layers {args.layers}",
             f"--interval-s {args.interval_s:g} --grace-s {args.grace_s:g}", f"--store {args.store}"]  # fmt: skip
    if args.keep_heap:
        parts.append("--keep-heap")
    if args.rounds > 1:
        parts.append(f"--rounds {args.rounds}" + (" --abba" if args.abba else ""))
    if args.schedule == "fixed":
        parts.append(f"--time-scale {args.time_scale:g}")
    else:
        parts.append(f"--bands {','.join(args.bands)} --month-s {args.month_s:g} --seed {args.seed} "
                     f"--notice-share {args.notice_share:g}")  # fmt: skip
    return " ".join(parts)


def byte_compile_library(tree: str | Path) -> None:
    """Byte-compile the library in ``tree`` (its ``__pycache__``), as pip does when it installs the wheel.

    The frameworks' modules come compiled from their wheels; the library's, imported from a checkout by
    a machine started with ``PYTHONDONTWRITEBYTECODE=1`` (this box sets it), would be compiled from
    source at every spawn: ~0.1 s of CPU (100-170 modules) that no installed library pays.
    """
    compileall.compile_dir(str(Path(tree) / "spot_callbacks"), quiet=1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the child, moto and the folder go
    byte_compile_library(REPO_ROOT)
    workdir = Path(tempfile.mkdtemp(prefix="spot-replay-"))
    load_before = os.getloadavg()
    started = time.monotonic()
    try:
        outcomes = replay(args, workdir)
    finally:
        if args.keep:
            print(f"work folder kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    total_s = time.monotonic() - started
    rows = [row(outcome) for outcome in outcomes]
    print_rich_table(HEADERS, rows, "goodput replay", left=["variant", "schedule"], width=220)
    machines = [breakdown(outcome) for outcome in outcomes]
    print("\n".join(machines))
    means = round_means(outcomes) if args.rounds > 1 else []
    print("\n".join(means))
    uname = subprocess.run(["uname", "-a"], capture_output=True, text=True).stdout.strip()
    baseline_lines = [
        f"- Uninterrupted ({framework}, no checkpoint), interleaved: one before the first variant, after every "
        f"{args.baseline_every} and after the last; each variant against the mean of the two around it: "
        + "; ".join(f"#{i} {wall:.1f} s spawn to exit, start-up {startup:.1f} s, {step * 1000:.1f} ms/step"
                    for i, (wall, startup, step) in enumerate(runs))
        for framework, runs in args.baselines.items()
    ]  # fmt: skip
    if args.schedule == "fixed":
        times = ", ".join(i.describe() if i else "-" for i in fixed_schedule(args.time_scale, args.grace_s))
        schedule_line = f"- Schedule (per attempt, from its spawn): {times}; later attempts run to the end."
    else:
        rates = ", ".join(
            f"{BAND_LABELS[b]}: one per {1 / rate_per_s(b, args.month_s):.0f} s" for b in args.bands
        )
        schedule_line = (f"- Schedule: Poisson per Spot Advisor band, one month = {args.month_s:g} s ({rates}); "
                         f"{args.notice_share:.0%} with notice, seed {args.seed}.")  # fmt: skip
    section = [
        "",
        *section_head(
            "Goodput replay",
            command_line(args),
            versions_line(("torch", "lightning", "transformers", "moto")),
            f" ({total_s:.0f}s)",
        ),  # fmt: skip
        f"- `uname -a`: `{uname}`; nproc {os.cpu_count()}",
        f"- Job: MLP {args.layers}×{args.width} on CPU (1 thread), {args.steps} steps; interval {args.interval_s:g} s, "
        f"SPOT_SIGNAL_GRACE_S={args.grace_s:g}; restart {args.restart_gap_s:g} s after the previous machine "
        f"ended, each a new machine (empty cwd, HOME, TMPDIR, SPOT_SCRATCH; own host name; the library byte-compiled "
        f"first, as installed from its wheel); one {args.store} S3 store"
        + (
            f"; every machine with {' '.join(f'{k}={v}' for k, v in KEEP_HEAP.items())}."
            if args.keep_heap
            else "."
        ),
        *baseline_lines,
        schedule_line,
        "- Load average (1, 5, 15 min; other work shares the box, so compare variants within one run): before "
        + ", ".join(f"{v:.2f}" for v in load_before)
        + "; after "
        + ", ".join(f"{v:.2f}" for v in os.getloadavg()),
        "- goodput = uninterrupted spawn-to-exit / billed (sum of spawn-to-exit); useful share = steps × the "
        "uninterrupted s/step / billed; kept share = the time each attempt spent on steps no later attempt redid, "
        "at its own speed, / billed (no baseline in it: the steadiest figure on a box under changing load); lost steps = steps trained before a restart and trained again after it; "
        "lost s = those steps at the uninterrupted s/step; at own speed = the seconds the machine that trained them "
        "spent on them (what `report` estimates); "
        "downtime = spawn to the first step done (in fit: from the script's call of fit/train, after the interpreter "
        "and the imports); weights equal: every tensor `torch.equal` to the uninterrupted "
        "run's; load: `uptime` before and after. report/plan: `spot-callbacks report --json --all` (goodput, billed_s, lost_work_s from the processes' records, else the sum of the ledger's) and "
        "`plan --from` (work = 1000 × the uninterrupted run; goodput = work / expected hours) on the store.",
        "",
        *markdown_table(HEADERS, rows),
        "",
        *(
            [
                f"Means over the {args.rounds} rounds (mean, min..max; "
                + ("order reversed every other round, ABBA" if args.abba else "same order every round")
                + "):",
                "",
                *(f"- {line}" for line in means),
                "",
            ]
            if means
            else []
        ),
        "Billed seconds per machine: spawn to the first step + the steps trained (first to last, and ms/step) + the "
        "last step to exit (an emergency checkpoint, the final upload, the interpreter's exit):",
        "",
        *(f"- {line}" for line in machines),
        "",
    ]
    record(args, section)
    return 0 if all(outcome.finished for outcome in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
