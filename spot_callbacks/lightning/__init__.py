"""The Lightning adapter: :class:`SpotCheckpoint` for ``lightning.pytorch``.

- ``callback.py`` the hooks (one class body) joined with a Lightning package's ``Checkpoint``
- ``_compat.py``  every private Lightning API touched, in one place

:mod:`spot_callbacks.pytorch_lightning` builds the same class against ``pytorch_lightning``.
"""

import lightning.pytorch as _pl

from spot_callbacks.lightning.callback import spot_checkpoint_class
from spot_callbacks.preemption import PREEMPTED_EXIT_CODE

# __module__ is the public path: LightningCLI writes class_path: spot_callbacks.lightning.SpotCheckpoint
SpotCheckpoint = spot_checkpoint_class(_pl, __name__)

__all__ = ["PREEMPTED_EXIT_CODE", "SpotCheckpoint", "spot_checkpoint_class"]
