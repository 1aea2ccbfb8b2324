"""Field docstrings of the pydantic models, read from their source as pydantic's
`use_attribute_docstrings` would. The models do not ask pydantic to: it parses each class's source at
import, which every `fsdpctl` start and every trainer rank would pay for descriptions nothing reads at
run time. The tests that hold the docstrings to the docs read them here."""

from __future__ import annotations

import ast
import inspect
import itertools
import textwrap

from pydantic import BaseModel


def field_docstrings(model: type[BaseModel]) -> dict[str, str]:
    """The docstring under each field of `model` and of the models it derives from, by field name; a
    field without one is left out."""
    docs: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if not issubclass(cls, BaseModel) or cls.__module__.startswith("pydantic"):
            continue  # object and BaseModel itself
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        for field, after in itertools.pairwise(body):
            if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str) and after.value.value.strip()):
                docs[field.target.id] = after.value.value
    return docs
