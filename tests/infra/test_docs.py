"""docs/cluster-spec.md documents every field of the spec, with the default the code really has."""

from __future__ import annotations

from pydantic import BaseModel

from infra.spec import ClusterSpec
from tests.infra.conftest import REPO

DOC = (REPO / "docs" / "cluster-spec.md").read_text()


def _field_paths(model: type[BaseModel], prefix: str = "") -> list[tuple[str, object]]:
    paths = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            paths += _field_paths(annotation, f"{prefix}{name}.")
        else:
            paths.append((f"{prefix}{name}", info.default))
    return paths


def test_every_spec_field_is_documented_with_its_default():
    paths = _field_paths(ClusterSpec)
    assert len(paths) > 40
    for path, default in paths:
        row = next((line for line in DOC.splitlines() if line.startswith(f"| `{path}` |")), None)
        assert row is not None, f"{path} is not documented in docs/cluster-spec.md"
        if isinstance(default, bool):
            assert f"`{str(default).lower()}`" in row, (path, default)
        elif isinstance(default, (int, str)) and not isinstance(default, bool) and default != "":
            assert f"`{getattr(default, 'value', default)}`" in row, (path, default)
