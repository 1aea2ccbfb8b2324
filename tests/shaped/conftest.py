"""Hardware-shaped local nodes: the local target's nodes given a Deep Learning AMI p4d/p5 shape by a
node layer built here (dlami.py). Needs what the local-target tests need (root, systemd-nspawn)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.local.conftest import prerequisites  # noqa: F401 (a fixture the tests here use)


def cached_facts(run_dir: Path, host: str) -> dict:
    """The facts a configure run (its run directory) left for `host`: ansible-runner keeps Ansible's jsonfile
    fact cache in the run's artifacts (one file per host, named with the cache's prefix, e.g. s1_HOST, the
    facts as a JSON payload)."""
    (cache,) = (run_dir / "artifacts/ansible/fact_cache").glob(f"*{host}")
    stored = json.loads(cache.read_text())
    return json.loads(stored["__payload__"]) if "__payload__" in stored else stored
