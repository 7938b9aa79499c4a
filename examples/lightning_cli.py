"""LightningCLI with SpotCheckpoint: train from examples/lightning_cli.yaml; to resume, run the same command.

    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml
    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml    # continues the run

The YAML sets ``ckpt_path: latest``: a run whose store holds a committed checkpoint continues from
it, on this machine or on a fresh one (an empty store: it starts from scratch). LightningCLI saves
the config it ran with as ``config.yaml`` in the log folder and by default refuses to overwrite
one (``SaveConfigCallback expected .../config.yaml to NOT exist``), which would stop every resume
of a run that logs to the same folder. Here it is overwritten: a resume is the same run with the
same config. To keep each run's config, give each run its own log folder instead (a logger with
versions, e.g. ``--trainer.logger=CSVLogger``, or ``--trainer.default_root_dir``).

Use your own LightningModule and LightningDataModule in place of the demo ones.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel


def main() -> None:
    LightningCLI(BoringModel, BoringDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
