"""The aws target: EFA GPU nodes built by the Pulumi program (infra/), pre-flight checks against the
account, and the teardown sweep. Its verbs are in `stack`; see `fsdpctl.targets` for the contract."""

from fsdpctl.targets.aws.stack import (
    UPDATES_IN_PLACE,
    check_prerequisites,
    destruction,
    down,
    health,
    node_destruction,
    replace_node,
    up,
)

NAME = "aws"

__all__ = ["NAME", "UPDATES_IN_PLACE", "check_prerequisites", "destruction", "down", "health",
           "node_destruction", "replace_node", "up"]
