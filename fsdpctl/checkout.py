"""Where the repository's non-Python parts are: the Pulumi project, the playbooks (and how they can be run),
pyproject.toml.

fsdpctl runs from a checkout (`pip install -e .`): `pulumi up` needs Pulumi.yaml and infra/ beside it,
configure needs ansible/, deploy builds the trainer wheel from the sources. A leaf module, so every
stage finds them the same way.
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
ANSIBLE_DIR = REPO_ROOT / "ansible"
PYPROJECT = REPO_ROOT / "pyproject.toml"
ANSIBLE_STRATEGIES = ("mitogen", "linear")
"""How `fsdpctl configure` can have Ansible run the tasks: `mitogen` (Mitogen for Ansible's `mitogen_linear`,
one Python per node kept for the run, modules cached there; about half the CPU of a run,
docs/ansible.md) or `linear`, Ansible's own (a new Python per module call over SSH pipelining), which plain
`ansible-playbook` with ansible/ansible.cfg uses."""
DEFAULT_ANSIBLE_STRATEGY = "mitogen"
