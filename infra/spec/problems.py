"""What is wrong with a spec: `Problem` (field, value, message, fix) and `SpecError` (all of them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec: where, what was given, and how to fix it."""

    field: str
    value: Any
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message} (got {self.value!r}). Fix: {self.fix}"


class SpecError(ValueError):
    def __init__(self, problems: list[Problem], source: str = "cluster spec"):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source} has {len(problems)} problem(s):\n{lines}")



def problems_from_validation(err: ValidationError) -> list[Problem]:
    problems = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(spec)"
        value = e.get("input")
        ctx_err = (e.get("ctx") or {}).get("error")
        if isinstance(ctx_err, SpecError):
            problems.extend(ctx_err.problems)
            continue
        msg = e["msg"].removeprefix("Value error, ")
        etype = e["type"]
        if etype == "extra_forbidden":
            problems.append(Problem(field, value, "is not a known field",
                                    "remove it or check its spelling against docs/cluster-spec.md"))
        elif etype == "missing":
            problems.append(Problem(field, None, "is required", "add it (see docs/cluster-spec.md)"))
        elif etype == "value_error" and ";" in msg:
            what, fix = msg.split(";", 1)
            problems.append(Problem(field, value, what.strip(), fix.strip()))
        else:
            problems.append(Problem(field, value, msg, "see docs/cluster-spec.md for the allowed values"))
    return problems

