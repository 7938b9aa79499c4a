"""Every private (or unexported) Transformers API spot_callbacks touches, in one place (checked on 4.5x-5.24).

- ``transformers.trainer_jit_checkpoint.CheckpointManager``: ``TrainingArguments(enable_jit_checkpoint=True)``
  installs its bound method as the SIGTERM handler and keeps the previous one in
  ``_original_sigterm_handler``; it saves locally, without rank agreement, ~3 s later.
- ``checkpoint-is-incomplete.txt``: the marker that JIT handler leaves in a folder it has not finished.
- ``TrainingArguments.save_strategy``: an enum (``.value``) or a plain string, depending on the version.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

log = logging.getLogger("spot_callbacks")

JIT_INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"


def save_strategy(args: Any) -> str:
    """``args.save_strategy`` as a plain string (``"no"``, ``"steps"``, ``"epoch"``, ``"best"``)."""
    strategy = getattr(args, "save_strategy", "no")
    return str(getattr(strategy, "value", strategy))


def jit_checkpoint_enabled(args: Any) -> bool:
    return bool(getattr(args, "enable_jit_checkpoint", False))


def jit_checkpoint_complete(folder: Path) -> bool:
    """The Trainer's JIT save finished this folder (it exists and has no "incomplete" marker)."""
    return folder.is_dir() and not (folder / JIT_INCOMPLETE_MARKER).exists()


def bypass_jit_sigterm_handler(store_url: str) -> None:
    """Take the Trainer's JIT-checkpoint SIGTERM handler out of the chain, if it is installed.

    Our handler would otherwise chain to it and the same step would be saved twice; ours runs
    the same Trainer save, persisted and agreed by every rank.
    """
    try:
        from transformers.trainer_jit_checkpoint import CheckpointManager
    except ImportError:  # a transformers without enable_jit_checkpoint
        return
    manager = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    if isinstance(manager, CheckpointManager):
        original = getattr(manager, "_original_sigterm_handler", None)
        signal.signal(signal.SIGTERM, original if original is not None else signal.SIG_DFL)
        log.info(
            "spot_callbacks: enable_jit_checkpoint is on; SpotCheckpointCallback handles SIGTERM "
            "(one save, persisted to %s) and the Trainer's JIT handler stays idle",
            store_url,
        )


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    """The Trainer's folder of ``step``: ``output_dir/checkpoint-N``."""
    return Path(output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"


def local_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """The ``checkpoint-N`` folders in ``output_dir``, with their steps."""
    found = []
    for folder in Path(output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
        suffix = folder.name[len(PREFIX_CHECKPOINT_DIR) + 1 :]
        if suffix.isdigit():
            found.append((int(suffix), folder))
    return found
