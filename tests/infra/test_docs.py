"""docs/cluster-spec.md documents every field of the spec, with the default the code really has and
the meaning its docstring gives."""

from __future__ import annotations

import re

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from infra.spec import ClusterSpec
from tests.docstrings import field_docstrings
from tests.infra.conftest import REPO, plan_of

DOC = (REPO / "docs" / "cluster-spec.md").read_text()


def _field_paths(model: type[BaseModel], prefix: str = "") -> list[tuple[str, object]]:
    return [(path, info.default) for path, info, _ in _fields(model, prefix)]


def _fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, FieldInfo, str | None]]:
    """Every leaf field under `model`: (dotted path, its FieldInfo, the docstring under it)."""
    found = []
    docstrings = field_docstrings(model)
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found += _fields(annotation, f"{prefix}{name}.")
        else:
            found.append((f"{prefix}{name}", info, docstrings.get(name)))
    return found


def _meaning(path: str) -> str:
    """The meaning column of a field's row (the second column of a required field's table)."""
    required = DOC.split("## Required fields", 1)[1].split("## ", 1)[0]
    for line in DOC.splitlines():
        if line.startswith(f"| `{path}` |"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            return cells[1] if line in required else cells[2]
    raise AssertionError(f"{path} is not documented in docs/cluster-spec.md")


def test_every_spec_field_has_a_docstring_that_the_docs_repeat():
    def words(text: str) -> str:
        return " ".join(text.split())

    for path, _, docstring in _fields(ClusterSpec):
        assert docstring, f"{path} has no docstring under it in infra/spec/model.py"
        assert words(docstring) == words(_meaning(path)), path


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


# What each expiry call stops, as the expiry_hours docstring names it.
STOPPED_BY = {
    "ec2:terminateInstances": ("nodes", "bastion"),
    "ec2:cancelCapacityReservation": ("reservation",),
    "ec2:deleteNatGateway": ("NAT gateway",),
    "ec2:releaseAddress": ("Elastic IP",),
    "fsx:deleteFileSystem": ("FSx",),
}


def test_expiry_hours_says_what_the_expiry_stops_and_what_stays():
    """The expiry_hours docstring (and so docs/cluster-spec.md) against the program's schedules:
    everything they stop is named, and nothing they stop is among what it says stays or keeps
    billing."""
    plan = plan_of(storage={"fsx": {"enabled": True}})
    calls = {s.inputs["target"]["arn"].split(":aws-sdk:")[1]
             for s in plan.mocks.of_type("aws:scheduler/schedule:Schedule")}
    assert calls == set(STOPPED_BY)
    doc = " ".join(field_docstrings(ClusterSpec)["expiry_hours"].split())
    staying = [s for s in re.split(r"(?<=\.) ", doc) if "stay" in s or "keeps billing" in s]
    assert staying, doc
    for call in calls:
        for word in STOPPED_BY[call]:
            assert word in doc, (call, word)
            assert not [s for s in staying if word in s], (call, word, staying)
