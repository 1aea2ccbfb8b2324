"""Shared fixtures: the spec as a dict, and the offline planner (infra.offline.run_offline, the product's
own recording mocks) to run the Pulumi program for a variant of it.

Every run sets fresh Pulumi mocks (preview=False) and a fresh event loop, and builds the program
only after set_mocks. pulumi_aws is imported once per session (Python caches the module); a plan of
a spec variant takes well under a second after that.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.offline import OfflinePlan, run_offline
from infra.spec import parse_spec

REPO = Path(__file__).resolve().parents[2]
EXPIRES_AT = "2026-12-03T13:00:00Z"


def demo_data(**overrides: Any) -> dict[str, Any]:
    """examples/demo.yaml as a dict, with top-level fields replaced (nested dicts merged one level)."""
    data = yaml.safe_load((REPO / "examples" / "demo.yaml").read_text())
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = copy.deepcopy(value)
    return data


_PLANS: dict[str, OfflinePlan] = {}


def plan_of(expires_at: str | None = EXPIRES_AT, **overrides: Any) -> OfflinePlan:
    """The offline plan of the demo spec with `overrides`. Plans are read-only results, so one per
    distinct variant is kept for the session (each was built under its own fresh mocks and loop)."""
    key = json.dumps([expires_at, overrides], sort_keys=True)
    if key not in _PLANS:
        spec = parse_spec(demo_data(**overrides))
        _PLANS[key] = run_offline(spec, expires_at if spec.expiry_hours else None)
    return _PLANS[key]


@pytest.fixture
def demo_plan() -> OfflinePlan:
    """The demo spec (4 x p4d, every default); tests only read it."""
    return plan_of()
