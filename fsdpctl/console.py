"""What fsdpctl says to its user: progress lines, warnings, JSON, and the yes/no question.

Every command prints through these few functions, so output is flushed line by line (a pipe to tee
or a CI log shows progress as it happens), warnings go to stderr, and a command that costs or destroys
money asks in one way everywhere (and never takes a missing terminal for a yes).
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable
from typing import Any

from fsdpctl.errors import CommandError, UsageError

Out = Callable[[str], None]
"""A sink for progress lines; stages take one so that callers (and tests) can redirect them."""


def say(message: str = "") -> None:
    """One line (or block) of output on stdout, flushed at once."""
    print(message, flush=True)


def stage(name: str) -> Out:
    """A progress sink whose lines start with `[name]`, for stages that run for minutes."""
    return lambda message: say(f"[{name}] {message}")


def warn(message: str) -> None:
    error(f"warning: {message}")


def error(message: str) -> None:
    """A line on stderr: errors, and notes that must not mix into machine-readable stdout."""
    print(message, file=sys.stderr, flush=True)


def print_json(data: Any) -> None:
    say(json.dumps(data, indent=2, default=str))


def line_buffered() -> None:
    """Progress lines reach a pipe as they happen, not when the buffer fills."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)


def confirm(question: str, *, yes: bool) -> None:
    """Ask `question` on the terminal unless `yes` (the command's --yes). Without a terminal the
    answer is no, and the error says to pass --yes; a no stops the command before anything is done.
    The CLI puts the command's name before either message."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise UsageError(f"this needs a yes to {question!r}, and there is no terminal to ask on: run it "
                         "again with --yes to go ahead")
    try:
        answer = input(f"{question} [y/N] ").strip().lower()
    except EOFError:
        answer = ""
    if answer not in ("y", "yes"):
        raise CommandError("not confirmed; nothing was done")
