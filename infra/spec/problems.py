"""What is wrong with a spec: `Problem` (field, value, message, fix) and `SpecError` (all of them)."""

from __future__ import annotations

import difflib
import reprlib
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError


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
    """One thing wrong with a spec: where, what was given, and how to fix it."""

    field: str
    value: Any
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message} (got {echo(self.value)}). Fix: {self.fix}"


class SpecError(ValueError):
    def __init__(self, problems: list[Problem], source: str = "cluster spec"):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source} has {len(problems)} problem(s):\n{lines}")


# pydantic's error types, in the words of a spec's author: (message, fix); {name} takes the error's
# context (the bound, the allowed values). pydantic's own text names Python types and classes.
_MAPPING = ("is not a mapping of keys", "write it as `key: value` lines indented under it{keys}")
_WORDING = {
    **dict.fromkeys(("model_type", "model_attributes_type", "dict_type", "mapping_type"), _MAPPING),
    **dict.fromkeys(("int_type", "int_parsing", "int_from_float", "int_parsing_size"),
                    ("is not a whole number", "write a whole number, without quotes")),
    **dict.fromkeys(("float_type", "float_parsing", "finite_number"),
                    ("is not a number", "write a number, without quotes")),
    **dict.fromkeys(("bool_type", "bool_parsing"), ("is not true or false", "write true or false")),
    "string_type": ("is not text", "write it as text (in quotes where it would read as a number)"),
    **dict.fromkeys(("list_type", "tuple_type", "set_type"),
                    ("is not a list", "write it as a YAML list: `[a, b]` or one `- item` per line")),
    **dict.fromkeys(("enum", "literal_error"), ("is not one of the allowed values", "use {expected}")),
    "greater_than_equal": ("is below the minimum, {ge}", "use {ge} or more"),
    "greater_than": ("must be more than {gt}", "use a value above {gt}"),
    "less_than_equal": ("is above the maximum, {le}", "use {le} or less"),
    "less_than": ("must be less than {lt}", "use a value below {lt}"),
}


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _section_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str] | None:
    """The keys of the section at `loc` under `model`, when it is a section (a model) of it; a
    mapping of sections (`regions: {name: section}`) is stepped through by its keys."""
    annotation: Any = model
    for part in loc:
        if _is_model(annotation):
            field = annotation.model_fields.get(str(part))
            if field is None:
                return None
            annotation = field.annotation
        elif typing.get_origin(annotation) is dict:
            annotation = typing.get_args(annotation)[1]
        else:
            return None
    return list(annotation.model_fields) if _is_model(annotation) else None


def problems_from_validation(err: ValidationError, model: type[BaseModel] | None = None,
                             docs: str = "docs/cluster-spec.md") -> list[Problem]:
    """pydantic's errors as Problems in the spec's words: the field, what is wrong with the value,
    and the fix (an unknown key gets the nearest key of its section). `model` is the validated model
    (for the keys of a section), `docs` the page that lists every field."""
    problems = []
    for e in err.errors():
        loc = tuple(e["loc"])
        if loc and loc[-1] == "[key]":  # a bad key of a mapping: the path ends with the key itself
            loc = loc[:-1]
        field = ".".join(str(p) for p in loc) or "(spec)"
        value = e.get("input")
        ctx = e.get("ctx") or {}
        if isinstance(ctx.get("error"), SpecError):
            problems.extend(ctx["error"].problems)
            continue
        msg = e["msg"].removeprefix("Value error, ")
        etype = e["type"]
        if etype == "extra_forbidden":
            keys = (_section_keys(model, loc[:-1]) if model else None) or []
            near = difflib.get_close_matches(str(loc[-1]), keys, n=1)
            fix = (f"did you mean `{near[0]}`?" if near else
                   f"remove it; the keys here are {', '.join(keys)}" if keys else
                   f"remove it or check its spelling against {docs}")
            problems.append(Problem(field, value, "is not a known field", fix))
        elif etype == "missing":
            problems.append(Problem(field, None, "is required", f"add it (see {docs})"))
        elif etype == "value_error" and ";" in msg:
            what, fix = msg.split(";", 1)
            problems.append(Problem(field, value, what.strip(), fix.strip()))
        elif etype in _WORDING:
            message, fix = _WORDING[etype]
            keys = _section_keys(model, loc) if model else None
            words = {**{k: str(v) for k, v in ctx.items()},
                     "keys": f" (its keys: {', '.join(keys)})" if keys else ""}
            problems.append(Problem(field, value, message.format(**words), fix.format(**words)))
        else:
            problems.append(Problem(field, value, msg.replace("Input should be", "must be"),
                                    f"see {docs} for the allowed values"))
    return problems
