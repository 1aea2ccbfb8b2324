"""The errors fsdpctl reports to its user, and the exit status each one ends the command with.

A leaf module: it imports nothing of the project, so every module can raise these without depending
on the CLI or on each other. The CLI (`fsdpctl.cli`) turns them into one line on stderr, prefixed
with the command, and the exit status below (also in `fsdpctl --help` and docs/commands.md).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1  # the command ran and what it did or checked failed (a smoke check, pulumi up, ...)
EXIT_USAGE = 2  # bad arguments, a bad spec, an unknown cluster: nothing was done
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM
EXIT_BROKEN_PIPE = 141  # the reader of stdout went away (`fsdpctl plan x | head`)

EXIT_CODES = {
    EXIT_OK: "success",
    EXIT_FAILED: "the command ran and failed (a check failed, a cloud or node operation failed)",
    EXIT_USAGE: "usage, spec or state error: bad arguments, a bad spec, an unknown cluster; nothing was done",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C, SIGTERM)",
    EXIT_BROKEN_PIPE: "stdout was closed by its reader (e.g. piped into head)",
}


class CommandError(RuntimeError):
    """A failure the user can act on: the message says what failed, why, and what to run next."""

    exit_code = EXIT_FAILED


class UsageError(CommandError):
    """The command was asked for something it cannot do as asked; nothing was changed."""

    exit_code = EXIT_USAGE


class StateError(UsageError):
    """The cluster's state is missing, unreadable or of another version; the message says how to
    repair it."""
