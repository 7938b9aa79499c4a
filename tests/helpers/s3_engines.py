"""Engines on the moto S3 server of the ``s3_server`` fixture, for the resume's request-counting tests."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from spot_callbacks import SpotConfig
from spot_callbacks.engine import SpotEngine


def s3_engine(s3_server: Any, run: str, scratch: Path) -> SpotEngine:
    """An engine of the run folder ``run`` in the server's bucket, its scratch in ``scratch``, no notices."""
    config = SpotConfig(
        dirpath=f"s3://{s3_server.bucket}/{run}", storage_options=dict(s3_server.storage_options),
        scratch_dir=str(scratch), preemption=[], interval=None,
    )  # fmt: skip
    return SpotEngine(config, framework="test")


def committed_s3_run(s3_server: Any, run: str, scratch: Path, steps: Iterable[int], numel: int) -> SpotEngine:
    """A run that committed ``steps`` (each state ``{"w": torch.full((numel,), step)}``) and finished."""
    writer = s3_engine(s3_server, run, scratch)
    writer.start()
    for step in steps:
        writer.save_state(step, 0, {"w": torch.full((numel,), float(step))}, reason="steps")
        writer.wait_for_commit()
    writer.finish()
    return writer
