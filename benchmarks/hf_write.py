"""One staged Hugging Face checkpoint: the writer thread's CPU and the upload's CPU, checkout against checkout.

The persister's writer thread makes the Trainer's ``checkpoint-N`` from the RAM snapshot
(``write_checkpoint_folder``) and the uploader sends the folder, hashing the files whose digests the
writer did not hand over. Each measurement is a fresh process (``_hf_write_child.py``) that trains
a small-config Llama (``--hidden``, ``--layers``, ``--vocab``: the default is ~1 GiB of weights and
AdamW state) one step, stages it, writes the folder and uploads it to a file store or moto S3,
timing each phase in wall seconds and the process's CPU seconds (kernel counters). ``--trees``
names the checkouts (a baseline and a change); the rounds alternate them, the order reversed every
other round (A B, B A), so the box's drifting load falls on both alike.

    python benchmarks/hf_write.py --quick
    python benchmarks/hf_write.py --trees /tmp/base,. --rounds 3 --store file,s3
"""

from __future__ import annotations

import argparse
import contextlib
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
from _servers import make_bucket, moto_server, s3_options

STORES = ("file", "s3")
QUICK = {"rounds": 1, "hidden": 128, "vocab": 1000, "store": "file"}
HEADERS = ["tree", "store", "GB", "write s", "write CPU s", "of it system", "writer thread CPU s", "upload s", "upload CPU s",
           "write+upload CPU s/GB", "digests handed over", "runs"]  # fmt: skip
CHILD = Path(__file__).resolve().parent / "_hf_write_child.py"


def run_child(
    tree: Path, workdir: Path, store_url: str, options: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    command = [
        sys.executable, str(CHILD), "--workdir", str(workdir), "--store-url", store_url,
        "--storage-options", json.dumps(options), "--step", "1", "--hidden", str(args.hidden),
        "--layers", str(args.layers), "--vocab", str(args.vocab),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the child failed ({tree}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--trees", default=".", help="comma-separated checkouts of the library (default: this one)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs every tree once per store")
    parser.add_argument("--store", default="file", help="comma-separated subset of file,s3")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--scratch", default=None, help="where the temp folders go")
    add_common_args(parser)
    args = parser.parse_args()
    apply_quick(parser, args, QUICK)
    stores = choice_list(parser, args.store, STORES, "--store")
    trees = [Path(tree).resolve() for tree in args.trees.split(",") if tree]
    names = {tree: ("." if tree == REPO_ROOT else str(tree)) for tree in trees}
    load_before = load_average()
    started = time.monotonic()
    results: dict[tuple[Path, str], list[dict[str, Any]]] = {
        (tree, store): [] for tree in trees for store in stores
    }
    with (
        tempfile.TemporaryDirectory(prefix="spot-hf-write-", dir=args.scratch) as tmp,
        contextlib.ExitStack() as stack,
    ):
        root = Path(tmp)
        options: dict[str, Any] = {}
        if "s3" in stores:
            options = s3_options(stack.enter_context(moto_server(root)))
            make_bucket(options, "hf-write")
        index = 0
        for round_index in range(args.rounds):
            order = trees if round_index % 2 == 0 else list(reversed(trees))
            for store in stores:
                for tree in order:
                    index += 1
                    workdir = root / f"run-{index}"
                    workdir.mkdir()
                    url = f"s3://hf-write/run-{index}" if store == "s3" else str(workdir / "store")
                    result = run_child(tree, workdir, url, options if store == "s3" else {}, args)
                    shutil.rmtree(workdir)
                    results[(tree, store)].append(result)
                    print(f"round {round_index + 1} {store} {names[tree]}: {json.dumps(result)}", flush=True)
    rows = []
    for (tree, store), runs in results.items():

        def median(phase: str, key: str, runs: list[dict[str, Any]] = runs) -> float:
            return statistics.median(run[phase][key] for run in runs)

        gb = runs[0]["bytes"] / 1e9
        per_gb = statistics.median(
            (run["write"]["cpu_s"] + run["upload"]["cpu_s"]) / (run["bytes"] / 1e9) for run in runs
        )
        rows.append([
            names[tree], store, f"{gb:.2f}", f"{median('write', 'wall_s'):.2f}", f"{median('write', 'cpu_s'):.2f}",
            f"{median('write', 'sys_s'):.2f}", f"{median('write', 'thread_cpu_s'):.2f}", f"{median('upload', 'wall_s'):.2f}",
            f"{median('upload', 'cpu_s'):.2f}", f"{per_gb:.2f}", ", ".join(runs[0]["handed"]) or "none",
            str(len(runs)),
        ])  # fmt: skip
    print_rich_table(HEADERS, rows, "one staged HF checkpoint: write and upload (medians)")
    command = "python benchmarks/hf_write.py " + " ".join(sys.argv[1:])
    lines = section_head(
        "hf write: one staged Hugging Face checkpoint, the writer's and the upload's CPU",
        command, versions_line(), f" ({time.monotonic() - started:.0f} s)",
    )  # fmt: skip
    lines += [f"- Load average: {load_before} before, {load_average()} after", ""]
    lines += markdown_table(HEADERS, rows) + [""]
    record(args, lines)


if __name__ == "__main__":
    main()
