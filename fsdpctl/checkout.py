"""Where the repository's non-Python parts are: the Pulumi project, the playbooks, pyproject.toml.

fsdpctl runs from a checkout (`pip install -e .`): `pulumi up` needs Pulumi.yaml and infra/ beside it,
configure needs ansible/, deploy builds the trainer wheel from the sources. A leaf module, so every
stage finds them the same way.
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
ANSIBLE_DIR = REPO_ROOT / "ansible"
PYPROJECT = REPO_ROOT / "pyproject.toml"
