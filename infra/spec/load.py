"""Reading a spec: from a mapping (`parse_spec`) or a YAML file (`load_spec`), and YAML files the
operator writes (`parse_yaml`: a key given twice, or aliases expanding without bound, are refused)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from infra.spec.model import ClusterSpec
from infra.spec.problems import Problem, SpecError, problems_from_validation
from infra.spec.rules import cross_field_problems

MAX_YAML_VALUES = 100_000
"""The most values a YAML file may hold once its aliases (`*name`) are expanded. A spec or a price
table holds a few hundred; a few hundred bytes of nested aliases can stand for billions, which every
reader (validation, an error message) would walk."""


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error: PyYAML keeps
    the last one silently, so `node_count: 4` then `node_count: 8` would plan 8 nodes."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _value in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                if key in first_line:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice (also on line {first_line[key] + 1}); "
                        "keep one", key_node.start_mark)
            except TypeError:
                continue  # an unhashable key: the safe loader's own error names it
            first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _expands_beyond(data: Any, limit: int) -> bool:
    """Whether `data`, walked as its readers walk it (a shared alias once per use), holds more than
    `limit` values. Stops at the limit, so a bomb costs `limit` steps."""
    todo, count = [data], 0
    while todo:
        item = todo.pop()
        count += 1
        if count > limit:
            return True
        if isinstance(item, dict):
            todo += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            todo += item
    return False


def parse_yaml(text: str) -> Any:
    """YAML text as data. Raises yaml.YAMLError for bad syntax, a key given twice in one mapping, or
    aliases that expand to more than MAX_YAML_VALUES values (`yaml_error_text` words it)."""
    data = yaml.load(text, Loader=_StrictLoader)
    if _expands_beyond(data, MAX_YAML_VALUES):
        raise yaml.YAMLError(f"its aliases (*name) expand to more than {MAX_YAML_VALUES:,} values; write "
                             "the values out, or repeat fewer of them")
    return data


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """`override` over `base`, mappings merged key by key at every depth."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def with_section_defaults(data: Mapping[str, Any]) -> dict[str, Any]:
    """A raw spec with the defaults of its sections (capacity, access, storage, ...) under what it
    gives, as validation would fill them in; what is not a mapping is left for validation to refuse."""
    filled = dict(data)
    for name, field in ClusterSpec.model_fields.items():
        default = field.get_default(call_default_factory=True)
        given = data.get(name, {})
        if isinstance(default, BaseModel) and isinstance(given, Mapping):
            filled[name] = deep_merge(default.model_dump(mode="json"), given)
    return filled


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
        problems = problems_from_validation(e, ClusterSpec)
    seen = {(p.field, p.message) for p in problems}
    problems += [p for p in cross_field_problems(with_section_defaults(data))
                 if (p.field, p.message) not in seen]
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
    except UnicodeDecodeError:
        raise SpecError([Problem("(file)", str(path), "is not a text file (not UTF-8)",
                                 "pass the spec YAML, e.g. examples/demo.yaml")]) from None
    except OSError as e:
        raise SpecError([Problem("(file)", str(path), f"cannot be read ({e.strerror})",
                                 "check the path and its permissions")]) from None
    try:
        data = parse_yaml(text)
    except yaml.YAMLError as e:
        raise SpecError([Problem("(file)", str(path), f"is not valid YAML: {yaml_error_text(e)}",
                                 "fix the YAML at that line")], str(path)) from None
    return parse_spec({} if data is None else data, source=str(path))


def yaml_error_text(error: yaml.YAMLError) -> str:
    """A YAML error as `line L, column C: what`, without PyYAML's `<unicode string>` file names."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    what = " ".join(str(part) for part in (getattr(error, "context", None), getattr(error, "problem", None))
                    if part) or str(error).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {what}" if mark else what
