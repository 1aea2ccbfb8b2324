"""The forked ranks of the numerical tests (rank_launcher.py) against the real torchrun: the same
environment contract, and a launch that ends as torchrun's does when a rank fails or time runs out."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fsdpctl.processes import alive
from tests.trainer.conftest import REPO, torchrun

# What a worker reads from torchrun (torch.distributed.elastic.agent.server.local_elastic_agent).
CONTRACT = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
            "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RESTART_COUNT",
            "TORCHELASTIC_MAX_RESTARTS")
PER_LAUNCH = ("MASTER_PORT", "TORCHELASTIC_RUN_ID")
# One write per rank, so that the two ranks' lines cannot interleave (print writes the newline apart).
SHOW_ENVIRONMENT = f"""import json, os, sys
sys.stdout.write(json.dumps({{name: os.environ.get(name) for name in {CONTRACT + PER_LAUNCH!r}}}) + "\\n")
"""


def _environments(stdout: str) -> list[dict]:
    return sorted((json.loads(line) for line in stdout.splitlines() if line.startswith("{")),
                  key=lambda env: env["RANK"])


def test_the_ranks_get_what_torchrun_gives_its_workers(tmp_path):
    script = tmp_path / "show_environment.py"
    script.write_text(SHOW_ENVIRONMENT)
    forked = torchrun(2, [str(script)])
    assert forked.returncode == 0, forked.stderr
    real = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", str(script)], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert real.returncode == 0, real.stderr
    ours, theirs = _environments(forked.stdout), _environments(real.stdout)
    def contract(envs: list[dict]) -> list[dict]:
        return [{name: env[name] for name in CONTRACT} for env in envs]

    assert contract(ours) == contract(theirs)
    assert [env["RANK"] for env in ours] == ["0", "1"]
    # One store port and one run id per launch, as under torchrun.
    assert len({(env["MASTER_PORT"], env["TORCHELASTIC_RUN_ID"]) for env in ours}) == 1


def test_a_failed_rank_ends_the_others_and_the_launch_exits_1(tmp_path):
    script = tmp_path / "one_fails.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1':\n    sys.exit('rank 1: broken')\n"
                      "time.sleep(120)\nprint('rank 0 finished')\n")
    done = torchrun(2, [str(script)], timeout=100)
    assert done.returncode == 1
    assert "rank 1: broken" in done.stderr and "rank 0 finished" not in done.stdout


def test_a_launch_past_its_timeout_is_killed_whole(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    script = tmp_path / "hangs.py"
    script.write_text(f"import os, time\nopen(os.path.join({str(pids)!r}, str(os.getpid())), 'w').close()\n"
                      "time.sleep(120)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        torchrun(2, [str(script)], timeout=3)
    ranks = [int(p.name) for p in pids.iterdir()]
    assert len(ranks) == 2
    assert not [pid for pid in ranks if alive(pid)]
