"""The ``omniflow`` command line: one entry point, one module per subcommand.

    $ omniflow plan graphs/fig3.py
    $ omniflow plan graphs/fig3.py --format dot | dot -Tsvg > fig3.svg

A subcommand lives in its own module (``omniflow/_cli_plan.py``, ...) that exposes
``register(subparsers)``: it adds its parser and sets ``handler`` — ``(args) -> int`` — as a
default. Adding a command is adding its module to ``SUBCOMMANDS``. Keep heavy imports inside the
handler so that ``omniflow --help`` stays fast and never needs the optional dependencies of
another command.

Exit status: 0 on success, 2 for a usage error or a declaration the user must fix (GraphError,
InputError), 1 for any other omniflow error, 130 on Ctrl-C. Errors are one line on stderr,
never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import TypeAlias

from omniflow import __version__
from omniflow._exceptions import GraphError, InputError, OmniflowError

__all__ = ["SUBCOMMANDS", "Handler", "Subparsers", "build_parser", "main"]

#: What a subcommand module's ``register`` receives.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
#: What a subcommand sets as ``handler``: runs the command, returns the exit status.
Handler: TypeAlias = Callable[[argparse.Namespace], int]

#: Modules that each define ``register(subparsers: Subparsers) -> None``, in help order.
SUBCOMMANDS: tuple[str, ...] = (
    "omniflow._cli_plan",
    "omniflow._cli_run",
    "omniflow._cli_serve",
    "omniflow._cli_story",
    "omniflow._cli_worker",
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand of SUBCOMMANDS registered."""
    parser = argparse.ArgumentParser(
        prog="omniflow",
        description="Serve multimodal inference pipelines declared as dataflow graphs.",
    )
    parser.add_argument("--version", action="version", version=f"omniflow {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``) and return its exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version or a usage error: argparse already printed
        return exc.code if isinstance(exc.code, int) else 2
    handler: Handler = args.handler
    try:
        return handler(args)
    except (GraphError, InputError) as exc:
        _error(args.command, exc)
        return 2
    except OmniflowError as exc:
        _error(args.command, exc)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (``omniflow plan ... | head``); silence the flush at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _error(command: str, exc: BaseException) -> None:
    print(f"omniflow {command}: error: {exc}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
