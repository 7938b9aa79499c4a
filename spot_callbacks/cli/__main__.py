"""``python -m spot_callbacks.cli``: the same as the ``spot-callbacks`` command."""

import sys

from spot_callbacks.cli.commands import main

sys.exit(main())
