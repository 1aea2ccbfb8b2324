"""The trainer's own error for a bad config: every problem at once, each with its key, value and fix.

The trainer is installed alone on the nodes (`fsdp-trainer`), so it shares no code with the operator
tool; this mirrors the cluster spec's errors so both read the same to a user.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Any

import yaml


def _echo_repr() -> reprlib.Repr:
    shown = reprlib.Repr()
    shown.maxlevel, shown.maxstring, shown.maxother, shown.maxlong = 2, 80, 80, 40
    shown.maxdict = shown.maxlist = shown.maxtuple = shown.maxset = 4
    return shown


_ECHO = _echo_repr()


def echo(value: Any) -> str:
    """A given value as an error shows it: its repr, cut to a line (a value read from YAML may be a
    megabyte string, or a list its aliases repeat a billion times)."""
    return _ECHO.repr(value)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a trainer config."""

    key: str
    """The config key (`optim.lr`), or `(file)`, `--set`, `--config` for where it came from."""
    value: Any
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message} (got {echo(self.value)}). Fix: {self.fix}"


class ConfigError(ValueError):
    """Every problem of a trainer config."""

    def __init__(self, problems: list[Problem], source: str = "trainer config"):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source} has {len(self.problems)} problem(s):\n{lines}")


def yaml_problem(path: str, error: yaml.YAMLError) -> Problem:
    """A YAML syntax error as a Problem that names the file and the line."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    what = getattr(error, "problem", None) or str(error).splitlines()[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return Problem("(file)", path, f"is not valid YAML{where}: {what}", "fix the YAML there")
