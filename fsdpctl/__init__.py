"""fsdpctl, the operator tool: builds a cluster (fsdpctl.targets), configures it (Ansible), deploys the
trainer, checks it (fsdpctl.checks) and tears it down. `fsdpctl.cli` is its command line."""

from importlib import metadata

try:
    __version__ = metadata.version("fsdp-cluster")
except metadata.PackageNotFoundError:  # a checkout that is not installed
    __version__ = "0+unknown"
