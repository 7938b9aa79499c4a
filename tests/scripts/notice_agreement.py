"""Two ranks (run under torchrun, gloo): a hint or a notice seen by one rank becomes one decision for both.

Rank 1 alone sees an AWS rebalance hint, then rank 0 a SIGTERM (deadline T+30) while rank 1 sees
an AWS interruption (deadline T+10). Each rank writes what ``SpotEngine.decide`` answered to
``--out/rank{N}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch.distributed as dist

from spot_callbacks import SpotConfig
from spot_callbacks.engine import SpotEngine
from spot_callbacks.preemption import Notice

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--dirpath", required=True)
parser.add_argument("--base-time", type=float, required=True)
args = parser.parse_args()


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    engine = SpotEngine(SpotConfig(dirpath=args.dirpath, interval=None, preemption=[]), "test")
    results = {}
    results["nothing"] = engine.decide(1).reason
    if rank == 1:
        engine.watcher.report_hint("AWS rebalance recommendation (rank 1 only)")
    results["hint"] = engine.decide(2).reason
    results["after_hint"] = engine.decide(3).reason
    if rank == 0:
        engine.watcher.report(Notice("SIGTERM", args.base_time + 30, "signal"))
    else:
        engine.watcher.report(Notice("aws", args.base_time + 10, "spot instance-action terminate"))
    decision = engine.decide(4)
    results["notice"] = [decision.reason, decision.notice.source, decision.notice.deadline]
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
