"""The error of a check, or of the set-up before the checks, that could not run at all."""

from __future__ import annotations

from fsdpctl.errors import CommandError


class CheckError(CommandError):
    """A check (or the set-up before the checks) could not run at all."""
