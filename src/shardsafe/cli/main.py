"""The ``shardsafe`` command: one parser, one error boundary.

Each subcommand lives in its own module here and adds itself with ``add_parser(s)``; whatever a
command raises becomes one ``error: ...`` message on stderr and exit status 1, never a traceback:

* a :class:`~shardsafe.errors.ShardsafeError` or an ``OSError`` is the expected answer to a bad
  input (a malformed field, a missing file, a refused path) and already names the file and the
  field: its message is printed as it is (control characters escaped);
* any other exception is a bug in shardsafe (a malformed input that no check caught first, so it
  reached Python's own ``int()`` or ``json``): it is printed as ``error: <command>: internal error
  <Type>: <message> (at <file>:<line>); please report it``, the message cut short, so a bug report
  can name the place without a traceback.

What a command prints goes through the same kind of boundary: while it runs, stdout escapes
every control character but newline and tab (names, keys, metrics and tags come from files an
attacker may have written; an ANSI escape or ``\r`` in one could rewrite what the terminal shows).

``SHARDSAFE_DEBUG=1`` re-raises instead, for the full traceback. Exit codes: 0 success, 1 a
problem with the input (or a failed demo stage), 2 bad usage (argparse), 130 interrupted.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import traceback
from pathlib import Path
from typing import TextIO

from shardsafe._version import __version__
from shardsafe.cli import checkpoints, convert, demo_command, export, inspect, push
from shardsafe.cli.formatting import printable
from shardsafe.errors import ShardsafeError

__all__ = ["build_parser", "describe_error", "main"]

DEBUG_ENV = "SHARDSAFE_DEBUG"
MAX_INTERNAL_MESSAGE = 160  # characters of an unexpected exception's message shown


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardsafe",
        description="Inspect, verify, export, convert and push shardsafe checkpoints, or run the "
        "preempt/crash/resume/reshard demo.",
        epilog=f"Exit status: 0 ok, 1 the input has a problem (or a demo stage failed), 2 bad usage. Set {DEBUG_ENV}=1 "
        "to see "
        "the traceback behind an error.",
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
    _tolerate_unencodable_output()
    command, stdout = "shardsafe", sys.stdout
    try:
        args = build_parser().parse_args(argv)  # bad usage: argparse prints it and exits 2
        command = args.command
        sys.stdout = EscapingWriter(stdout)
        code = int(args.func(args))
        sys.stdout.flush()  # a closed pipe shows here, inside the boundary, not at interpreter exit
        return code
    except BrokenPipeError:  # `shardsafe inspect ... | head`: not an error worth a message
        # no second error when Python flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        print(f"error: {describe_error(exc, command)}", file=sys.stderr)
        return 1
    finally:
        sys.stdout = stdout


class EscapingWriter(io.TextIOBase):
    """A text stream that writes to ``inner`` what :func:`printable` makes of it (newlines and tabs kept)."""

    def __init__(self, inner: TextIO) -> None:
        self._inner = inner

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._inner.write(printable(text, newlines=True))
        return len(text)

    def flush(self) -> None:
        self._inner.flush()

    def fileno(self) -> int:
        return self._inner.fileno()

    def isatty(self) -> bool:
        return self._inner.isatty()


def describe_error(exc: BaseException, command: str) -> str:
    """The text after ``error:`` for an exception a command raised (see the module docstring)."""
    if isinstance(exc, (ShardsafeError, OSError)):
        return printable(exc, newlines=True)
    message = " ".join(printable(exc, newlines=True).split())
    if len(message) > MAX_INTERNAL_MESSAGE:
        message = message[: MAX_INTERNAL_MESSAGE - 3] + "..."
    return (
        f"{command}: internal error {type(exc).__name__}: {message}{_raised_at(exc)}; please report it "
        f"({DEBUG_ENV}=1 shows the traceback)"
    )


def _raised_at(exc: BaseException) -> str:
    """`` (at shardsafe/cli/inspect.py:42)``: the innermost frame inside shardsafe, if any."""
    package = Path(__file__).resolve().parents[1]
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(package):
            return f" (at shardsafe/{path.relative_to(package).as_posix()}:{frame.lineno})"
    return ""


def _tolerate_unencodable_output() -> None:
    """A path or name that is not valid UTF-8 (a surrogate in ``str``) is printed escaped instead of
    failing the command with ``UnicodeEncodeError`` halfway through its output."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):  # a stream that cannot change (closed, or not a real text file)
                pass


if __name__ == "__main__":
    raise SystemExit(main())
