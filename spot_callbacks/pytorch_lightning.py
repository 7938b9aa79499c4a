"""`SpotCheckpoint` for projects that import the standalone ``pytorch_lightning`` package.

Its ``Trainer`` rejects callbacks from ``lightning.pytorch``; this is the same callback, built
from the same code, against ``pytorch_lightning``.

Example:
    >>> from spot_callbacks.pytorch_lightning import SpotCheckpoint
    >>> import pytorch_lightning
    >>> issubclass(SpotCheckpoint, pytorch_lightning.callbacks.Checkpoint)
    True
"""

import pytorch_lightning as _pl

from spot_callbacks.lightning import build_spot_checkpoint

SpotCheckpoint = build_spot_checkpoint(_pl)
SpotCheckpoint.__module__ = __name__

__all__ = ["SpotCheckpoint"]
