"""What every ``inferline`` command shares: its exit codes, what its parser is added to, and ``--config``.

Each command's module has one ``add_NAME_parser(subcommands)`` that adds its parser (and its actions) to
``inferline``'s subcommands and sets its ``handler``; ``main`` calls each and runs the handler it parsed to.
"""

from __future__ import annotations

import argparse

#: Exit codes: success; a failure the command reports (a file invalid, an answer changed, a chain broken, a
#: request refused); a command line that cannot be run as written.
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

#: What ``main`` hands each ``add_NAME_parser``: ``inferline``'s subcommands.
Subcommands = argparse._SubParsersAction


def config_option(parser: argparse.ArgumentParser) -> None:
    """``--config FILE``, as every command that reads the server's settings takes it."""
    parser.add_argument("--config", "-c", metavar="FILE",
                        help="server config (default: $INFERLINE_CONFIG, else ./inferline.yaml if present, "
                             "else built-in defaults)")
