"""Where a checkpoint's blocked time goes: wall and thread-CPU timers wrapped around named functions.

``SPOT_BENCH_TRACE=1`` in a ``--train-on`` HF worker's environment (``_hf_fsdp_worker.py``): :func:`install`
wraps each function of :data:`TARGETS` (``module:Class.method`` or ``module:function``) so that every call
on the training thread adds, to the step it belongs to (the ``HookClock``'s): its count, wall time, thread
CPU time (``time.thread_time``), the process's CPU time (every thread: what the others ran meanwhile),
its minor page faults and its involuntary context switches (preempted by the OS). A recursive call
(``Module.state_dict`` of a submodule) counts in its outermost call only. The calls of :data:`BACKGROUND`,
on any thread, go on a timeline (start, end, thread CPU), to see what the writer and the uploads do
during a checkpoint's window. The worker writes :meth:`Trace.per_step` into its ``rank-N.json`` as
``trace`` (steps as keys, and ``timeline``). ``SPOT_BENCH_WRITER_DELAY_MS``: a diagnostic, the HF
writers start that much later. No figure of BENCHMARKS.md's tables comes from here.
"""

from __future__ import annotations

import functools
import importlib
import os
import resource
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

TARGETS = (
    "spot_callbacks.hf.callback:SpotCheckpointCallback.on_step_end",
    "spot_callbacks.hf.callback:SpotCheckpointCallback.on_step_begin",
    "spot_callbacks.engine:SpotEngine.step_boundary",
    "spot_callbacks.engine:SpotEngine.save_folder",
    "spot_callbacks.engine:SpotEngine.save_rank_files",
    "spot_callbacks.engine:SpotEngine.new_records",
    "spot_callbacks.engine:SpotEngine.state_dict",
    "spot_callbacks.engine:SpotEngine.persist_lag_s",
    "spot_callbacks.saving:CheckpointWriter._job_terms",
    "spot_callbacks.saving:CheckpointWriter._after_save",
    "spot_callbacks.saving:CheckpointWriter.persister_for",
    "spot_callbacks.saving:barrier",
    "spot_callbacks.persist.pipeline:Persister.submit",
    "spot_callbacks.persist.folders:NodeFolderPersister.submit",
    "spot_callbacks.persist.folders:NodeFolderPersister.job",
    "spot_callbacks.hf.checkpoint:StagedSaves.stage",
    "spot_callbacks.hf.checkpoint:StagedSaves.submit",
    "spot_callbacks.hf.checkpoint:StagedSaves.prepare",
    "spot_callbacks.hf.checkpoint:rank_state",
    "spot_callbacks.hf.fsdp:ShardHandles.shards_of",
    "spot_callbacks.hf._compat:rng_states",
    "spot_callbacks.hf._compat:trainer_state_at_save",
    "spot_callbacks.hf.metrics:SpotMetrics.flush",
    "spot_callbacks.staging:StagingArea.stage",
    "spot_callbacks.staging:_StageContext.finish",
    "_train_on:Floor.time",
    "torch.nn.modules.module:Module.state_dict",
    "torch.optim.optimizer:Optimizer.state_dict",
)

# Any thread's calls, on a timeline (start, end): what the writer and uploader do during a checkpoint's window.
BACKGROUND = (
    "spot_callbacks.hf.callback:SpotCheckpointCallback.on_step_end",
    "spot_callbacks.hf.callback:SpotCheckpointCallback.on_step_begin",
    "spot_callbacks.staging:_StageContext.finish",
    "spot_callbacks.hf.checkpoint:write_rank_files",
    "spot_callbacks.hf.checkpoint:write_checkpoint_folder",
    "spot_callbacks.persist.rank_group:RankGroupPersister._upload_round",
    "spot_callbacks.persist.pipeline:Persister._upload",
    "spot_callbacks.persist.rank_group:trim_heap",
    "spot_callbacks.persist.pipeline:trim_heap",
)


class Trace:
    """Per step and name: calls, wall s, thread CPU s, process CPU s (the training thread's calls only)."""

    def __init__(self, step: Callable[[], int | None]) -> None:
        self.step = step
        self.thread = threading.get_ident()
        self.totals: dict[int, dict[str, list[float]]] = defaultdict(
            lambda: defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0, 0])
        )
        self._depth: dict[str, int] = defaultdict(int)
        self.timeline: list[tuple[str, float, float, float, int | None]] = []  # name, start, end, CPU s, step
        self.windows: list[tuple[int, float, float]] = []  # checkpoint steps' hook windows (on_step_end)

    def wrap_background(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started, cpu = time.perf_counter(), time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.timeline.append(
                    (name, started, time.perf_counter(), time.thread_time() - cpu, self.step())
                )

        return timed

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self.thread or self._depth[name]:
                return function(*args, **kwargs)
            self._depth[name] += 1
            started, cpu, process = time.perf_counter(), time.thread_time(), time.process_time()
            usage = resource.getrusage(resource.RUSAGE_THREAD)
            try:
                return function(*args, **kwargs)
            finally:
                self._depth[name] -= 1
                step = self.step()
                if step is not None:
                    entry = self.totals[step][name]
                    entry[0] += 1
                    entry[1] += time.perf_counter() - started
                    entry[2] += time.thread_time() - cpu
                    entry[3] += time.process_time() - process
                    after = resource.getrusage(resource.RUSAGE_THREAD)
                    entry[4] += after.ru_minflt - usage.ru_minflt
                    entry[5] += after.ru_nivcsw - usage.ru_nivcsw  # preempted (involuntary switches)

        return timed

    def per_step(self) -> dict[str, Any]:
        steps: dict[str, Any] = {
            str(step): {name: list(v) for name, v in names.items()} for step, names in self.totals.items()
        }
        steps["timeline"] = self.timeline
        return steps


def install(step: Callable[[], int | None]) -> Trace | None:
    """Wrap :data:`TARGETS` when ``SPOT_BENCH_TRACE`` is set; the trace, else ``None``."""
    if not os.environ.get("SPOT_BENCH_TRACE"):
        return None
    trace = Trace(step)
    for target in TARGETS:
        module_name, _, qualname = target.partition(":")
        owner: Any = importlib.import_module(module_name)
        *path, attr = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, attr, trace.wrap(qualname, getattr(owner, attr)))
    delay_s = float(os.environ.get("SPOT_BENCH_WRITER_DELAY_MS", "0")) / 1e3  # a diagnostic
    if delay_s:
        import spot_callbacks.hf.checkpoint as hf_checkpoint

        for name in ("write_rank_files", "write_checkpoint_folder"):
            function = getattr(hf_checkpoint, name)

            def delayed(*args: Any, __function: Any = function, **kwargs: Any) -> Any:
                time.sleep(delay_s)
                return __function(*args, **kwargs)

            setattr(hf_checkpoint, name, delayed)
    for target in BACKGROUND:
        module_name, _, qualname = target.partition(":")
        owner = importlib.import_module(module_name)
        *path, attr = qualname.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if owner is not None and hasattr(owner, attr):
            setattr(owner, attr, trace.wrap_background(target, getattr(owner, attr)))
    return trace
