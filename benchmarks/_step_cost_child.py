"""One run of ``step_cost.py``: the replay's child job (``_replay_child.py``), with CPU time per thread.

Every Python thread's CPU time (``time.thread_time`` at its end; ``/proc/self/task`` for those alive
at exit) is written as JSON to ``$STEP_COST_THREADS`` at exit, keyed by the thread's name with its
digits dropped (``spot-transfer-3`` → ``spot-transfer-``); threads no Python code started (the C
libraries' own: OpenMP, tokio, ...) as ``native:<comm>``. With ``STEP_COST_WINDOW=FROM,TO`` (step
numbers) it also holds, at those two step markers, the wall time, the main thread's CPU time, the
process's CPU time, its involuntary context switches and minor page faults (``window``), and the garbage collector's
collections and seconds per generation between them (``gc``). ``STEP_COST_NO_UPLOAD=1`` makes the
persister discard each written checkpoint instead of uploading it (the snapshot and the write stay).
In the Hugging Face variants each Trainer event's callbacks (``CallbackHandler.call_event``, all
callbacks) and each of ``SpotCheckpointCallback``'s hooks are timed in that window too (``hooks``:
name -> [calls, wall seconds, main thread CPU seconds]).
"""

from __future__ import annotations

import atexit
import functools
import gc
import json
import os
import re
import resource
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _replay_child  # prints REPLAY SPAWNED, patches the host name, imports torch

_CPU: dict[str, float] = defaultdict(float)
_NAMES: dict[int, str] = {}  # native thread id -> name, of every Python thread started
_GUARD = threading.Lock()
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# "from"/"to": [step, wall, main thread CPU, process CPU, involuntary switches, minor page faults]
_WINDOW: dict[str, list[float]] = {}
_GC: dict[str, float] = defaultdict(float)  # per generation: collections and seconds, in the window
_GC_STARTED: list[float] = []
_HOOKS: dict[str, list[float]] = {}  # in the window: name -> [calls, wall s, thread CPU s]


def _family(name: str) -> str:
    return re.sub(r"[\d_]+", "", name.split(" (")[0]) or name


def _patch_threads() -> None:
    original = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def bootstrap_inner(self: threading.Thread) -> None:
        with _GUARD:
            _NAMES[threading.get_native_id()] = self.name
        try:
            original(self)
        finally:
            with _GUARD:
                _CPU[_family(self.name)] += time.thread_time()
                _NAMES.pop(threading.get_native_id(), None)

    threading.Thread._bootstrap_inner = bootstrap_inner  # type: ignore[attr-defined]


def _task_cpu_s(stat: str) -> float:
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime


def _write_threads(path: str) -> None:
    main_id = threading.main_thread().native_id
    totals = dict(_CPU)
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        tid = int(task.name)
        if tid == main_id:
            name = "main (training)"
        elif tid in _NAMES:
            name = _family(_NAMES[tid])
        else:
            name = "native:" + stat[stat.index("(") + 1 : stat.rindex(")")]
        totals[name] = totals.get(name, 0.0) + _task_cpu_s(stat)
    gc_figures = {**_GC, "tracked objects at exit": float(len(gc.get_objects()))}
    Path(path).write_text(
        json.dumps({"threads": totals, "window": _WINDOW, "gc": gc_figures, "hooks": _HOOKS})
    )


def _time_gc(phase: str, info: dict[str, int]) -> None:
    if "from" not in _WINDOW or "to" in _WINDOW:
        return
    if phase == "start":
        _GC_STARTED[:] = [time.perf_counter()]
    elif _GC_STARTED:
        generation = info["generation"]
        _GC[f"gen{generation} collections"] += 1
        _GC[f"gen{generation} s"] += time.perf_counter() - _GC_STARTED[0]


def _patch_marks(skip: int, last: int) -> None:
    """Note the main thread's and the process's CPU at the ``skip``-th and the ``last``-th step marker."""
    original = _replay_child.mark

    def mark(kind: str, *values: object) -> None:
        original(kind, *values)
        if kind == "STEP" and int(str(values[0])) in (skip, last):
            usage = resource.getrusage(resource.RUSAGE_SELF)
            _WINDOW["from" if int(str(values[0])) == skip else "to"] = [
                float(str(values[0])), time.time(), time.thread_time(), usage.ru_utime + usage.ru_stime,
                float(usage.ru_nivcsw), float(usage.ru_minflt),
            ]  # fmt: skip

    _replay_child.mark = mark


def _add_time(name: str, wall: float, cpu: float) -> None:
    """A call that began at ``wall`` (``perf_counter``) and ``cpu`` (``thread_time``), if in the window."""
    if "from" in _WINDOW and "to" not in _WINDOW:
        figures = _HOOKS.setdefault(name, [0.0, 0.0, 0.0])
        figures[0] += 1
        figures[1] += time.perf_counter() - wall
        figures[2] += time.thread_time() - cpu


def _timed(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, its calls inside the steady window added up under ``name`` in ``_HOOKS``."""

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            _add_time(name, wall, cpu)

    return timed


def _patch_hf_hooks() -> None:
    """Time every Trainer event's callbacks (all of them: ``event:NAME``) and the library's hooks (``spot.NAME``)."""
    from transformers.trainer_callback import CallbackHandler

    from spot_callbacks.hf import SpotCheckpointCallback

    original = CallbackHandler.call_event

    def call_event(self: CallbackHandler, event: str, *args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return original(self, event, *args, **kwargs)
        finally:
            _add_time(f"event:{event}", wall, cpu)

    CallbackHandler.call_event = call_event  # type: ignore[method-assign]
    for hook in ("on_step_begin", "on_step_end", "on_log", "on_epoch_begin", "on_epoch_end", "on_substep_end",
                 "on_pre_optimizer_step", "on_optimizer_step"):  # fmt: skip
        if hook in vars(SpotCheckpointCallback):
            setattr(SpotCheckpointCallback, hook, _timed(f"spot.{hook}", vars(SpotCheckpointCallback)[hook]))


def _no_upload() -> None:
    from spot_callbacks.persist.pipeline import Persister
    from spot_callbacks.persist.scratch import discard_folder

    def upload(self: Persister, job: object) -> None:
        discard_folder(job.local_dir, job.owns_local_dir)  # type: ignore[attr-defined]

    Persister._upload = upload


def main() -> int:
    _patch_threads()
    if os.environ.get("STEP_COST_NO_UPLOAD") == "1":
        _no_upload()
    if os.environ.get("STEP_COST_WINDOW"):
        _patch_marks(*(int(n) for n in os.environ["STEP_COST_WINDOW"].split(",")))
        gc.callbacks.append(_time_gc)
    if os.environ.get("STEP_COST_WINDOW") and _replay_child.parse_args().variant in _replay_child.HF:
        _patch_hf_hooks()
    if os.environ.get("STEP_COST_THREADS"):
        atexit.register(_write_threads, os.environ["STEP_COST_THREADS"])
    return _replay_child.main()


if __name__ == "__main__":
    sys.exit(main())
