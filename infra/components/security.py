"""Security groups.

The node group is the EFA group: EFA needs ALL traffic allowed in and out between members of the
same group (the AWS EFA guide requires both self rules; a missing egress rule makes NCCL hang). SSH
is the only other way in: from `ssh_cidr` to the bastion, and from the bastion's group to the nodes
(or from `ssh_cidr` to the nodes directly when there is no bastion, e.g. over a VPN). Nothing else
accepts traffic from anywhere. FSx for Lustre joins the node group, so its ports (988,
1018-1023) are covered by the self rule.
"""

from __future__ import annotations

import pulumi
import pulumi_aws as aws

from infra.components.context import COMPONENT_PREFIX, ClusterContext, child_options
from infra.components.network import ANYWHERE

SSH_PORT = 22
ALL_PROTOCOLS = "-1"


def _all_traffic(description: str, **peer: object) -> dict:
    return {"protocol": ALL_PROTOCOLS, "from_port": 0, "to_port": 0, "description": description, **peer}


def _ssh(description: str, **peer: object) -> dict:
    return {"protocol": "tcp", "from_port": SSH_PORT, "to_port": SSH_PORT, "description": description,
            **peer}


class Security(pulumi.ComponentResource):
    node_security_group_id: pulumi.Output[str]
    bastion_security_group_id: pulumi.Output[str] | None

    def __init__(self, ctx: ClusterContext, vpc_id: pulumi.Input[str],
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{COMPONENT_PREFIX}:Security", ctx.resource_name("security"), None, opts)
        spec = ctx.spec
        child = child_options(self)
        self.bastion_security_group_id = None
        node_ssh = _ssh("SSH from the operator network", cidr_blocks=[spec.ssh_cidr])
        if spec.access.bastion:
            bastion = aws.ec2.SecurityGroup(
                ctx.resource_name("bastion"), vpc_id=vpc_id,
                description=f"fsdp-cluster {spec.name}: SSH from {spec.ssh_cidr} to the bastion",
                ingress=[_ssh("SSH from the operator network", cidr_blocks=[spec.ssh_cidr])],
                egress=[_all_traffic("ProxyJump to the nodes, SSM and updates", cidr_blocks=[ANYWHERE])],
                tags=ctx.tags_named("bastion"), opts=child)
            self.bastion_security_group_id = bastion.id
            node_ssh = _ssh("SSH through the bastion", security_groups=[bastion.id])
        nodes = aws.ec2.SecurityGroup(
            ctx.resource_name("efa"), vpc_id=vpc_id,
            description=f"fsdp-cluster {spec.name}: EFA (all traffic within the group) and SSH",
            ingress=[_all_traffic("EFA and NCCL between nodes (and FSx)", self=True), node_ssh],
            egress=[_all_traffic("EFA and NCCL between nodes (and FSx)", self=True),
                    _all_traffic("Egress through the NAT gateway (packages, S3, SSM)",
                                 cidr_blocks=[ANYWHERE])],
            tags=ctx.tags_named("efa"), opts=child)
        self.node_security_group_id = nodes.id
        self.register_outputs({"node_security_group_id": nodes.id})
