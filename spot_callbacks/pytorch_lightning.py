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

from spot_callbacks.lightning import spot_checkpoint_class

SpotCheckpoint = spot_checkpoint_class(_pl, __name__)

__all__ = ["SpotCheckpoint"]
