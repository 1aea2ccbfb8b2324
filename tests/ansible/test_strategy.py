"""The two strategies `fsdpctl configure` can run the playbook with (fsdpctl/checkout.py
ANSIBLE_STRATEGIES), told apart by what they do, on localhost: Mitogen's keeps one Python per host for
the run and runs every module in it, Ansible's own linear starts a new Python for each module call."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from fsdpctl.configure import strategy_environment
from tests.ansible.conftest import BIN, REPO, ansible_env

# Each task prints the process that ran its module: the parent of the shell the command module starts.
PLAYBOOK = """
- name: Which process runs each module
  hosts: all
  gather_facts: false
  tasks:
    - name: Module call {n}
      ansible.builtin.shell: echo "module process $PPID"
      register: call
      changed_when: false
      loop: [1, 2, 3]
      loop_control:
        loop_var: n
    - name: Say them
      ansible.builtin.debug:
        msg: "{{ call.results | map(attribute='stdout') | list }}"
"""


def module_processes(tmp_path, strategy: str) -> list[str]:
    tmp_path.mkdir(exist_ok=True)
    play = tmp_path / "play.yml"
    play.write_text(PLAYBOOK)
    result = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local",
         "-e", f"ansible_python_interpreter={sys.executable}", str(play)],
        cwd=REPO, env={**ansible_env(tmp_path), **strategy_environment(strategy)},
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    return re.findall(r"module process (\d+)", result.stdout)


def test_mitogen_runs_every_module_in_one_python_and_linear_starts_one_each(tmp_path):
    mitogen = module_processes(tmp_path / "mitogen", "mitogen")
    linear = module_processes(tmp_path / "linear", "linear")
    assert len(mitogen) == len(linear) == 3
    assert len(set(mitogen)) == 1, mitogen
    assert len(set(linear)) == 3, linear


def test_an_unknown_strategy_is_refused_naming_the_ones_there_are():
    from fsdpctl.errors import UsageError

    with pytest.raises(UsageError, match=r"^--strategy 'free' is not one of mitogen, linear$"):
        strategy_environment("free")
