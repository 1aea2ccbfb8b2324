"""The errors fsdpctl reports to its user, and the exit status each one ends the command with.

A leaf module: it imports nothing of the project, so every module can raise these without depending
on the CLI or on each other. The CLI (`fsdpctl.cli`) turns them into one line on stderr, prefixed
with the command, and the exit status below (also in `fsdpctl --help` and docs/commands.md).
"""

from __future__ import annotations

import importlib.metadata
import re

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


class Interrupted(CommandError):
    """Ctrl-C or SIGTERM stopped the command part-way; the message says what may be half done and
    what to run again."""

    exit_code = EXIT_INTERRUPTED


class UsageError(CommandError):
    """The command was asked for something it cannot do as asked; nothing was changed."""

    exit_code = EXIT_USAGE


class StateError(UsageError):
    """The cluster's state is missing, unreadable or of another version; the message says how to
    repair it."""


class MissingPackage(UsageError):
    """An optional Python package the command needs is not installed; the message names the extra of
    fsdp-cluster that installs it."""


PROJECT_PACKAGES = ("fsdpctl", "infra", "trainer")
# Modules that come with a package the extras list rather than with one of their own name.
_INSTALLED_WITH = {"botocore": "boto3", "s3transfer": "boto3", "mlflow": "mlflow-skinny", "yaml": "PyYAML",
                   "ansible_mitogen": "mitogen"}


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def missing_package(error: ModuleNotFoundError) -> MissingPackage | None:
    """What to install for an import that failed (a plain `pip install -e .` installs no extra), from
    fsdp-cluster's own requirements (pyproject.toml); None for a module that is the project's own or
    that no requirement provides (a bug, not a missing install)."""
    module = (error.name or "").split(".")[0]
    if not module or module in PROJECT_PACKAGES:
        return None
    wanted = _normalized(_INSTALLED_WITH.get(module, module))
    try:
        requirements = importlib.metadata.requires("fsdp-cluster") or []
    except importlib.metadata.PackageNotFoundError:
        requirements = []
    for requirement in requirements:
        name = re.match(r"[A-Za-z0-9._-]+", requirement)
        if name and _normalized(name.group(0)) == wanted:
            extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", requirement)
            install = f"pip install -e '.[{extra.group(1)}]'" if extra else "pip install -e ."
            return MissingPackage(f"the Python package {name.group(0)} is not installed here (import "
                                  f"{module} failed); install it with `{install}` in the repository")
    return None
