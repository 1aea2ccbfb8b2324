"""Reading a spec: from a mapping (`parse_spec`) or a YAML file (`load_spec`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from infra.spec.model import ClusterSpec
from infra.spec.problems import Problem, SpecError, problems_from_validation
from infra.spec.rules import cross_field_problems


def parse_spec(data: Mapping[str, Any], source: str = "cluster spec") -> ClusterSpec:
    """Validate a mapping (YAML file or Pulumi config object) into a spec, or raise SpecError
    listing every problem."""
    if not isinstance(data, Mapping):
        raise SpecError([Problem("(spec)", data, "must be a mapping of fields",
                                 "write the spec as YAML keys: name, region, ...")], source)
    try:
        return ClusterSpec.model_validate(dict(data))
    except SpecError as e:
        raise SpecError(e.problems, source) from None
    except ValidationError as e:
        problems = problems_from_validation(e)
    seen = {(p.field, p.message) for p in problems}
    problems += [p for p in cross_field_problems(data) if (p.field, p.message) not in seen]
    raise SpecError(problems, source) from None


def load_spec(path: str | Path) -> ClusterSpec:
    """Read and validate a spec file. Every way a file can be wrong (missing, a directory, not YAML,
    not a mapping, bad fields) is a SpecError naming the file, and the line for a YAML error."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError([Problem("(file)", str(path), "does not exist",
                                 "pass the path of a spec YAML, e.g. examples/demo.yaml")]) from None
    except IsADirectoryError:
        raise SpecError([Problem("(file)", str(path), "is a directory, not a spec file",
                                 "pass the path of a spec YAML in it, e.g. examples/demo.yaml")]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError([Problem("(file)", str(path), f"cannot be read ({e})",
                                 "check the path and its permissions")]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError([Problem("(file)", str(path), f"is not valid YAML: {yaml_error_text(e)}",
                                 "fix the YAML syntax at that line")], str(path)) from None
    return parse_spec({} if data is None else data, source=str(path))


def yaml_error_text(error: yaml.YAMLError) -> str:
    """A YAML error as `line L, column C: what`, without PyYAML's `<unicode string>` file names."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    what = " ".join(str(part) for part in (getattr(error, "context", None), getattr(error, "problem", None))
                    if part) or str(error).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {what}" if mark else what
