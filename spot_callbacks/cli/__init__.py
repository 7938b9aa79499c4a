"""The ``spot-callbacks`` command line (entry point ``spot_callbacks.cli:main``).

- ``commands.py``  parsing and the commands: ls, verify, pull, rm, report, plan
- ``redaction.py`` storage option values and URL passwords kept out of what it prints
- ``tables.py``    tables and the spinner: rich on a terminal, plain text when piped
"""

from spot_callbacks.cli.commands import CliError, build_parser, main

__all__ = ["CliError", "build_parser", "main"]
