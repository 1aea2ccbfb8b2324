"""The cluster's network: one VPC in the spec's single availability zone (EFA does not cross AZs).

Nodes live in a private subnet: an instance with several network cards cannot get a public IP, and
GPU nodes should not have one anyway. The public subnet holds the NAT gateway (the nodes' egress for
packages and installers) and the optional bastion. An S3 gateway endpoint keeps checkpoint traffic
off the NAT gateway (free, and faster). With `network.vpc_id` the user's VPC and subnets are used
as they are and nothing is created.
"""

from __future__ import annotations

import ipaddress

import pulumi
import pulumi_aws as aws

from infra.components.context import COMPONENT_PREFIX, ClusterContext, child_options

ANYWHERE = "0.0.0.0/0"


def subnet_cidrs(vpc_cidr: str) -> tuple[str, str]:
    """(private, public): the private subnet takes the first half of the VPC (nodes, FSx), the
    public one a quarter of the second half (NAT gateway, bastion)."""
    first_half, second_half = ipaddress.ip_network(vpc_cidr).subnets(prefixlen_diff=1)
    public = next(second_half.subnets(prefixlen_diff=1))
    return str(first_half), str(public)


class Network(pulumi.ComponentResource):
    vpc_id: pulumi.Output[str]
    private_subnet_id: pulumi.Output[str]
    # None when an existing VPC is used without a public subnet (no bastion).
    public_subnet_id: pulumi.Output[str] | None
    # The NAT gateway and its Elastic IP allocation (billed by the hour); None in an existing VPC.
    nat_gateway_id: pulumi.Output[str] | None = None
    nat_allocation_id: pulumi.Output[str] | None = None

    def __init__(self, ctx: ClusterContext, opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{COMPONENT_PREFIX}:Network", ctx.resource_name("network"), None, opts)
        net = ctx.spec.network
        if net.creates_vpc:
            self._create(ctx)
        else:
            self.vpc_id = pulumi.Output.from_input(net.vpc_id)
            self.private_subnet_id = pulumi.Output.from_input(net.private_subnet_id)
            self.public_subnet_id = (pulumi.Output.from_input(net.public_subnet_id)
                                     if net.public_subnet_id else None)
        self.register_outputs({"vpc_id": self.vpc_id, "private_subnet_id": self.private_subnet_id})

    def _create(self, ctx: ClusterContext) -> None:
        spec, opts = ctx.spec, child_options(self)
        az = spec.availability_zone
        private_cidr, public_cidr = subnet_cidrs(spec.network.vpc_cidr)
        vpc = aws.ec2.Vpc(
            ctx.resource_name("vpc"), cidr_block=spec.network.vpc_cidr,
            # FSx for Lustre and SSM need DNS resolution and hostnames inside the VPC.
            enable_dns_support=True, enable_dns_hostnames=True,
            tags=ctx.tags_named("vpc"), opts=opts)
        private = aws.ec2.Subnet(
            ctx.resource_name("private"), vpc_id=vpc.id, cidr_block=private_cidr, availability_zone=az,
            map_public_ip_on_launch=False, tags=ctx.tags_named("private"), opts=opts)
        public = aws.ec2.Subnet(
            ctx.resource_name("public"), vpc_id=vpc.id, cidr_block=public_cidr, availability_zone=az,
            # The bastion asks for its public IP explicitly; nothing else here should get one.
            map_public_ip_on_launch=False, tags=ctx.tags_named("public"), opts=opts)
        igw = aws.ec2.InternetGateway(
            ctx.resource_name("igw"), vpc_id=vpc.id, tags=ctx.tags_named("igw"), opts=opts)
        nat_ip = aws.ec2.Eip(ctx.resource_name("nat-ip"), domain="vpc", tags=ctx.tags_named("nat-ip"),
                             opts=child_options(self, depends_on=[igw]))
        nat = aws.ec2.NatGateway(
            ctx.resource_name("nat"), allocation_id=nat_ip.allocation_id, subnet_id=public.id,
            connectivity_type="public", tags=ctx.tags_named("nat"),
            opts=child_options(self, depends_on=[igw]))
        public_routes = aws.ec2.RouteTable(
            ctx.resource_name("public-routes"), vpc_id=vpc.id,
            routes=[{"cidr_block": ANYWHERE, "gateway_id": igw.id}],
            tags=ctx.tags_named("public-routes"), opts=opts)
        private_routes = aws.ec2.RouteTable(
            ctx.resource_name("private-routes"), vpc_id=vpc.id,
            routes=[{"cidr_block": ANYWHERE, "nat_gateway_id": nat.id}],
            tags=ctx.tags_named("private-routes"), opts=opts)
        aws.ec2.RouteTableAssociation(ctx.resource_name("public-routes"), subnet_id=public.id,
                                      route_table_id=public_routes.id, opts=opts)
        aws.ec2.RouteTableAssociation(ctx.resource_name("private-routes"), subnet_id=private.id,
                                      route_table_id=private_routes.id, opts=opts)
        aws.ec2.VpcEndpoint(
            ctx.resource_name("s3"), vpc_id=vpc.id, vpc_endpoint_type="Gateway",
            service_name=f"{ctx.reverse_dns_prefix}.{spec.region}.s3",
            route_table_ids=[private_routes.id, public_routes.id],
            tags=ctx.tags_named("s3"), opts=opts)
        self.vpc_id = vpc.id
        self.nat_gateway_id, self.nat_allocation_id = nat.id, nat_ip.allocation_id
        self.private_subnet_id = private.id
        self.public_subnet_id = public.id
