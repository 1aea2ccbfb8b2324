"""The SSH key fsdpctl reaches AWS nodes with: one it generates per cluster, or the user's own
(access.key_name / access.public_key), found before anything is created."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from fsdpctl.errors import UsageError
from fsdpctl.state import ClusterState
from infra.spec import ClusterSpec

GENERATED_KEY_NAME = "id_ed25519"
# Where a user's own private key is looked for (access.key_name / access.public_key), in order.
SSH_KEY_ENV = "FSDPCTL_SSH_KEY"


def ssh_key(state: ClusterState, spec: ClusterSpec) -> tuple[Path, ClusterSpec]:
    """The private key fsdpctl connects with, and the spec to deploy (with the public key to import
    when fsdpctl generated the pair). A user's own key (key_name / public_key) must be findable
    before anything is created."""
    access = spec.access
    if access.key_name or access.public_key:
        return _users_private_key(spec), spec
    key = state.keys_dir / GENERATED_KEY_NAME
    if not key.exists():
        if not shutil.which("ssh-keygen"):
            raise UsageError("ssh-keygen is missing (package openssh-client): it generates the cluster's "
                             "SSH key. Install it, or set access.key_name / access.public_key in the spec.")
        state.keys_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"fsdp-cluster-{spec.name}",
                        "-f", str(key)], check=True)
    public = key.with_suffix(".pub").read_text().strip()
    return key, spec.model_copy(update={"access": access.model_copy(update={"public_key": public})})


def _users_private_key(spec: ClusterSpec) -> Path:
    ssh_dir = Path.home() / ".ssh"
    if os.environ.get(SSH_KEY_ENV):
        candidates = [Path(os.environ[SSH_KEY_ENV]).expanduser()]
    elif spec.access.key_name:
        candidates = [ssh_dir / f"{spec.access.key_name}.pem", ssh_dir / spec.access.key_name]
    else:
        # The private key next to the .pub file whose content is the spec's public key.
        wanted = spec.access.public_key.split()[:2]
        candidates = [pub.with_suffix("") for pub in sorted(ssh_dir.glob("*.pub"))
                      if pub.read_text().split()[:2] == wanted]
    for path in candidates:
        if path.is_file():
            return path
    what = (f"key pair {spec.access.key_name!r}" if spec.access.key_name else "access.public_key")
    looked = ", ".join(map(str, candidates)) or f"{ssh_dir}/*.pub"
    raise UsageError(f"cannot find the private key for {what} (looked at {looked}); set {SSH_KEY_ENV}="
                     "/path/to/private-key and run the command again. Nothing was created.")


