"""Kill -9 a checkpointing training process at random moments and check what it left behind.

Used by ``tests/test_crash.py`` (a short run in CI) and ``benchmarks/soak.py`` (hundreds of kills).
Each process is ``tests/scripts/lightning_run.py`` checkpointing every step, so a kill lands in
whatever the checkpoint machinery is doing then: staging, serialising, uploading, committing the
manifest, pruning. The delay before the kill is drawn from a seeded RNG *after* a readiness signal
(the first training step past the resume point on stdout), so every kill hits a training run.

After each kill: ``CheckpointStore.latest()`` is ``None`` or verifies deeply (every byte against its
checksum), it is never older than the checkpoint the killed run resumed from, and the next run resumes
exactly there (its first step is the checkpoint's step). Each lineage ends with a run to completion.
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spot_callbacks import CheckpointStore

SCRIPT = Path(__file__).parent.parent / "scripts" / "lightning_run.py"
STEPS_PER_EPOCH = 10  # 320 samples, batch 32 (see lightning_run.py)
READY_TIMEOUT_S = 180.0  # process start (imports) and the pull of the resume point, on a loaded box
RUN_TIMEOUT_S = 300.0
_BATCH = re.compile(r"^BATCH r=0 e=\d+ i=\d+ g=(\d+) ")


@dataclass
class CrashResult:
    """What a harness run did and saw."""

    kills: int = 0
    completions: int = 0  # runs that reached max_epochs (a lineage's last run, or one the kill missed)
    resumes: int = 0  # runs that started from a committed checkpoint
    commits_seen: int = 0  # "committed" lines logged by all the runs
    empty_after_kill: int = 0  # kills after which nothing was committed yet (latest() was None)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"{self.kills} kills, {self.commits_seen} commits seen, {self.resumes} resumes, "
            f"{self.completions} runs to completion, {self.empty_after_kill} kills before any commit, "
            f"{len(self.failures)} failures, {self.seconds:.0f}s"
        )


@dataclass
class _Run:
    proc: subprocess.Popen
    lines: queue.Queue
    stdout: list[str]
    log_path: Path
    drained: bool = False


class CrashHarness:
    """Runs lineages of kill -9'd training processes against one store URL prefix.

    Args:
        base_url: lineages go to ``<base_url>/lineage-<k>`` (a local path or fsspec URL).
        storage_options: for fsspec, passed to the training script and to the checks.
        workdir: local folder for scratch disks and process logs.
        seed: seeds the kill delays.
        max_delay_s: a kill lands uniformly within this many seconds after readiness.
        max_epochs: length of a lineage (10 steps an epoch, a checkpoint every step).
        env: extra environment for the training processes.
        log: called with one line per event (progress for long runs); ``None`` for silence.
    """

    def __init__(
        self,
        base_url: str,
        storage_options: dict[str, Any],
        workdir: Path,
        seed: int = 0,
        max_delay_s: float = 1.5,
        max_epochs: int = 40,
        env: dict[str, str] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.storage_options = storage_options
        self.workdir = Path(workdir)
        self.rng = random.Random(seed)
        self.max_delay_s = max_delay_s
        self.max_epochs = max_epochs
        self.env = env or {}
        self.log = log or (lambda line: None)
        self.result = CrashResult()
        self._lineage = 0
        self._lineage_started = False  # a run has written into the current lineage
        self._runs = 0

    # ----------------------------------------------------------------- public
    @property
    def url(self) -> str:
        return f"{self.base_url}/lineage-{self._lineage}"

    @property
    def final_step(self) -> int:
        return self.max_epochs * STEPS_PER_EPOCH

    def store(self) -> CheckpointStore:
        return CheckpointStore(self.url, storage_options=self.storage_options)

    def run(self, kills: int, complete_every: int = 0) -> CrashResult:
        """``kills`` kill -9 cycles; every ``complete_every`` kills (0: only at the end) the lineage
        runs to completion and the next kills start a fresh one."""
        started = time.monotonic()
        while self.result.kills < kills:
            kills_before = self.result.kills
            self.kill_once()
            due = (
                complete_every
                and self.result.kills > kills_before
                and self.result.kills % complete_every == 0
            )
            if due and self.result.kills < kills and self._lineage_started:
                self.complete()
        if self._lineage_started:
            self.complete()
        self.result.seconds = time.monotonic() - started
        return self.result

    def kill_once(self) -> None:
        """Start a run (resuming from the lineage's latest), kill -9 it at a random moment, check the store."""
        before = self.store().latest()
        start_step = before.step if before is not None else 0
        run = self._start()
        self._lineage_started = True
        try:
            first = self._wait_for_step(run, above=start_step, first_expected=start_step)
            if first is None:  # finished before it got past the resume point: a completed lineage
                self._finished(run)
                return
            time.sleep(self.rng.uniform(0.0, self.max_delay_s))  # the random moment is the point
            if run.proc.poll() is None:
                run.proc.send_signal(signal.SIGKILL)
                run.proc.wait(timeout=60)
                self.result.kills += 1
                self._collect(run)
                self._check_after_kill(before)
            else:  # the run ended before the kill: it must have ended well
                self._finished(run)
        finally:
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait(timeout=60)

    def complete(self) -> None:
        """Resume the lineage and run it to the end; then start a fresh lineage."""
        before = self.store().latest()
        run = self._start()
        try:
            run.proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait(timeout=60)
        self._drain(run)
        first = next((int(m.group(1)) for m in map(_BATCH.match, run.stdout) if m), None)
        expected_first = before.step if before is not None else 0
        if (before is None or before.step < self.final_step) and first != expected_first:
            self._fail(f"{self.url}: resumed at step {first}, expected {expected_first}")
        self._finished(run)

    # -------------------------------------------------------------- helpers
    def _start(self) -> _Run:
        self._runs += 1
        name = f"run-{self._runs}"
        log_path = self.workdir / "logs" / f"{name}.stderr"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "SPOT_SCRATCH": str(self.workdir / "scratch" / name),  # every run is a fresh machine
            "PYTHONUNBUFFERED": "1",
            "PRINT_BATCHES": "1",
            **self.env,
        }
        command = [
            sys.executable, str(SCRIPT), "--dirpath", self.url, "--every-n-steps", "1",
            "--max-epochs", str(self.max_epochs), "--storage-options", json.dumps(self.storage_options),
            "--out", str(self.workdir / f"{name}.pt"), "--seed", str(self._runs),
            "--verbose",  # commits_seen counts the "committed" lines
        ]  # fmt: skip
        with open(log_path, "wb") as stderr:
            proc = subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL, text=True
            )
        lines: queue.Queue = queue.Queue()
        stdout: list[str] = []

        def pump() -> None:  # drains stdout so the child never blocks on a full pipe
            for line in proc.stdout:
                stdout.append(line)
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        return _Run(proc, lines, stdout, log_path)

    def _wait_for_step(self, run: _Run, above: int, first_expected: int) -> int | None:
        """Block until the run trains a step past ``above``; check where it resumed. None if it ended first."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        first: int | None = None
        while True:
            try:
                line = run.lines.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                raise AssertionError(f"{self.url}: no training step within {READY_TIMEOUT_S:.0f}s") from None
            if line is None:
                run.drained = True
                return None
            match = _BATCH.match(line)
            if not match:
                continue
            step = int(match.group(1))
            if first is None:
                first = step
                if first != first_expected:
                    self._fail(f"{self.url}: resumed at step {first}, expected {first_expected}")
                if first > 0:
                    self.result.resumes += 1
            if step > above:
                return step

    def _drain(self, run: _Run) -> None:
        while not run.drained:
            run.drained = run.lines.get(timeout=60) is None

    def _collect(self, run: _Run) -> None:
        self._drain(run)
        self.result.commits_seen += run.log_path.read_text(errors="replace").count(
            "spot_callbacks: committed "
        )

    def _check_after_kill(self, before: Any) -> None:
        latest = self.store().latest()
        if latest is None:
            self.result.empty_after_kill += 1
            if before is not None:
                self._fail(f"{self.url}: latest() is None after a kill, was step {before.step}")
            return
        try:
            self.store().verify(latest.step, deep=True)
        except Exception as err:  # noqa: BLE001 - recorded as the failure it is
            self._fail(f"{latest.url} does not verify after a kill: {err}")
        if before is not None and latest.step < before.step:
            self._fail(f"{self.url}: latest() went back from step {before.step} to {latest.step}")
        self.log(f"kill {self.result.kills}: latest {latest.step} ({latest.reason}) verifies")

    def _finished(self, run: _Run) -> None:
        self._collect(run)
        code = run.proc.wait(timeout=RUN_TIMEOUT_S)  # its stdout can close a moment before it exits
        latest = self.store().latest()
        if code != 0:
            tail = run.log_path.read_text(errors="replace")[-3000:]
            self._fail(f"{self.url}: a run exited {code}:\n{tail}")
        elif latest is None or latest.step != self.final_step or latest.reason not in ("end", "steps"):
            self._fail(f"{self.url}: a completed run left latest() = {latest}")
        else:
            try:
                self.store().verify(latest.step, deep=True)
            except Exception as err:  # noqa: BLE001
                self._fail(f"{latest.url} does not verify after completion: {err}")
        self.result.completions += 1
        self.log(f"lineage {self._lineage} completed at step {latest.step if latest else None}")
        self._lineage += 1
        self._lineage_started = False

    def _fail(self, message: str) -> None:
        self.result.failures.append(message)
        self.log(f"FAILURE: {message}")
