#!/usr/bin/python3
"""Spot interruption watcher (installed by the fsdp-cluster `slurm` role).

Polls the instance metadata service with IMDSv2 (a token from PUT /latest/api/token, then GETs of
/latest/meta-data/spot/instance-action and /latest/meta-data/events/recommendations/rebalance).
On a notice it drains this node in Slurm (no new jobs land on it) and sends SIGUSR1 to the batch
script of every job running here; fsdpctl's job scripts forward it to the trainer workers, which
write a checkpoint and exit, and the job is requeued onto other nodes. Each notice is acted on once.

Settings (environment, from /etc/fsdp-cluster/spot-watcher.env): FSDP_IMDS_ENDPOINT (base URL),
FSDP_SPOT_POLL_S (seconds between polls), FSDP_SLURM_NODE (this node's Slurm name).
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

ENDPOINT = os.environ.get("FSDP_IMDS_ENDPOINT", "http://169.254.169.254").rstrip("/")
POLL_S = float(os.environ.get("FSDP_SPOT_POLL_S", "5"))
NODE = os.environ.get("FSDP_SLURM_NODE") or socket.gethostname().split(".")[0]
TOKEN_TTL_S = 21600
NOTICES = {
    "spot interruption": "/latest/meta-data/spot/instance-action",
    "rebalance recommendation": "/latest/meta-data/events/recommendations/rebalance",
}


def log(message):
    print(message, flush=True)


def token():
    request = urllib.request.Request(f"{ENDPOINT}/latest/api/token", method="PUT",
                                     headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
    with urllib.request.urlopen(request, timeout=2) as response:
        return response.read().decode()


def get(path, tok):
    """The document at path, or None when there is none (404: no notice)."""
    request = urllib.request.Request(f"{ENDPOINT}{path}", headers={"X-aws-ec2-metadata-token": tok})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return response.read().decode()
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


def run(argv):
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode:
        log(f"`{' '.join(argv)}` exited {result.returncode}: {result.stderr.strip()}")
    return result


def act(kind, document):
    try:
        detail = json.loads(document)
    except ValueError:
        detail = document.strip()
    reason = f"{kind} notice: {json.dumps(detail, sort_keys=True) if isinstance(detail, dict) else detail}"
    log(f"{reason}: draining {NODE} and asking its jobs to checkpoint")
    run(["scontrol", "update", f"nodename={NODE}", "state=DRAIN", f"reason={reason[:200]}"])
    jobs = run(["squeue", "--noheader", "--nodelist", NODE, "--states", "RUNNING", "--format", "%A"])
    for job in jobs.stdout.split():
        # The batch script traps USR1 and forwards it to the trainer workers on every node.
        run(["scancel", "--batch", "--signal", "USR1", job])
        log(f"job {job}: sent SIGUSR1 to its batch script")


def main():
    log(f"watching {ENDPOINT} every {POLL_S:g} s for spot interruption and rebalance notices ({NODE})")
    seen = set()
    tok, tok_time = None, 0.0
    while True:
        try:
            if tok is None or time.monotonic() - tok_time > TOKEN_TTL_S / 2:
                tok, tok_time = token(), time.monotonic()
            for kind, path in NOTICES.items():
                document = get(path, tok)
                if document is not None and (kind, document) not in seen:
                    seen.add((kind, document))
                    act(kind, document)
        except urllib.error.HTTPError as e:
            if e.code == 401:
                tok = None  # the token expired: ask for a new one
            else:
                log(f"metadata service answered {e.code}: {e.reason}")
        except (OSError, ValueError) as e:
            log(f"metadata service unreachable: {e}")
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main())
