"""The Hugging Face Trainer adapter: :class:`SpotCheckpointCallback` and what it needs.

- ``callback.py``  SpotCheckpointCallback: Trainer events -> engine calls
- ``checkpoint.py`` two phases: stage what a resume needs at the step, write ``checkpoint-N`` in the background
- ``saves.py``     the saves asked of the Trainer until ``on_save`` shows them; the end of ``train()``
- ``metrics.py``   the ``spot/*`` rows, logged through ``Trainer.log`` (every ``report_to`` integration)
- ``_compat.py``   every private Transformers API touched, in one place
"""

from spot_callbacks.hf.callback import SpotCheckpointCallback
from spot_callbacks.preemption import PREEMPTED_EXIT_CODE

SpotCheckpointCallback.__module__ = __name__  # the public import path, as HfArgumentParser/YAML name it

__all__ = ["PREEMPTED_EXIT_CODE", "SpotCheckpointCallback"]
