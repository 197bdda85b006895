"""The ``shardsafe`` command: one parser, one error boundary.

Each subcommand lives in its own module here and adds itself with ``add_parser(s)``; whatever a
command raises on a bad input becomes one ``error: ...`` line on stderr and exit status 1, never a
traceback. Exit codes: 0 success, 1 a problem with the input or a failed demo stage, 2 bad usage
(argparse), 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys

from shardsafe._version import __version__
from shardsafe.cli import checkpoints, convert, demo_command, export, inspect, push
from shardsafe.errors import ShardsafeError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardsafe",
        description="Inspect, verify, export, convert and push shardsafe checkpoints, or run the preempt/crash/resume/reshard demo.",
        epilog="Exit status: 0 ok, 1 the input has a problem (or a demo stage failed), 2 bad usage.",
    )
    parser.add_argument("--version", action="version", version=f"shardsafe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    inspect.add_parsers(sub)  # inspect, verify
    demo_command.add_parser(sub)
    push.add_parser(sub)
    export.add_parser(sub)
    checkpoints.add_parsers(sub)  # list, gc
    convert.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardsafe`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:  # `shardsafe inspect ... | head`: not an error worth a message
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout at exit
        return 1
    except (ShardsafeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
