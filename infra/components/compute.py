"""The GPU nodes, their launch template and placement group, and the bastion.

One launch template per instance type carries everything a node is launched with: the EFA layout
(one EFA per network card), IMDSv2, the encrypted gp3 root volume, the instance profile, the
placement group and how the capacity is bought (spot, reservation, Capacity Block). Each node is an
`aws.ec2.Instance` from that template whose logical name is `spec.node_name(rank)`, so a node keeps
its rank (and `fsdpctl replace RANK` can target exactly one URN). When the cluster powers idle nodes
down (spec `scaling`), rank 0, the Slurm controller that starts and stops them, runs with its own
instance profile instead of the template's (infra/components/identity.py).

Each billed instance and the reservation get their expiry schedule (infra/components/expiry.py) as
soon as they exist, and GPU capacity is bought last: the bastion and its schedule first, then the
reservation, then the nodes, each waiting for every schedule made before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.components.context import COMPONENT_PREFIX, ClusterContext, child_options
from infra.components.expiry import Expiry
from infra.spec import BASTION_SSM_PARAMETERS, RANK_TAG, CapacityType

# Only programs on the node itself (not containers behind a bridge, which add a hop) may read
# instance metadata; raise to 2 if training runs in containers that need the node role.
IMDS_HOP_LIMIT = 1
BASTION_ROOT_GIB = 10
# The node property that pins its launch template version (ignored after creation; see Compute).
NODE_TEMPLATE_PROPERTY = "launchTemplate"
# The rank that runs the Slurm controller, and with power saving the programs that start and stop nodes.
CONTROLLER_RANK = 0
EFA_INTERFACE_TYPES = ("efa", "efa-only")


@dataclass(frozen=True)
class InterfaceSlot:
    network_card_index: int
    device_index: int
    interface_type: str


def efa_interface_layout(network_cards: int, layout: str = "basic") -> list[InterfaceSlot]:
    """The network interfaces of a node, one EFA per network card, as the EC2 user guide
    ("Maximize network bandwidth on Amazon EC2 instances with multiple network cards",
    efa-acc-inst-types) prescribes:

    - "basic" (p4d/p4de): card 0 carries the ENA primary interface (device 0, the node's IP) and an
      `efa-only` interface (device 1); every other card one `efa-only` interface (device 0).
    - "p5" (p5/p5e/p5en, section "EFA configuration for P5, P5e and P5en instances", use case 1:
      one private IP, up to 3200 Gbps EFA): card 0 device 0 is an `efa` (EFA with ENA) interface,
      the node's only IP; cards 1..N-1 carry an `efa-only` interface at device 1.
    4 EFA on p4d/p4de, 32 on p5/p5e, 16 on p5en."""
    if layout == "p5":
        return [InterfaceSlot(0, 0, "efa")] + [InterfaceSlot(card, 1, "efa-only")
                                                for card in range(1, network_cards)]
    slots = [InterfaceSlot(0, 0, "interface"), InterfaceSlot(0, 1, "efa-only")]
    slots += [InterfaceSlot(card, 0, "efa-only") for card in range(1, network_cards)]
    return slots


def efa_count(slots: list[InterfaceSlot]) -> int:
    return sum(slot.interface_type in EFA_INTERFACE_TYPES for slot in slots)


def resolve_ami(ctx: ClusterContext, ssm_parameter: str) -> str:
    return aws.ssm.get_parameter(name=ssm_parameter, opts=ctx.invoke_options()).value


class Compute(pulumi.ComponentResource):
    nodes: list[aws.ec2.Instance]
    efa_count: int
    requested_ami: str
    ami_id: pulumi.Output[str]
    placement_group_name: pulumi.Output[str] | None
    # The all-or-nothing On-Demand Capacity Reservation the program creates, or None.
    capacity_reservation_id: pulumi.Output[str] | None
    bastion_public_ip: pulumi.Output[str] | None

    def __init__(self, ctx: ClusterContext, *, private_subnet_id: pulumi.Input[str],
                 public_subnet_id: pulumi.Input[str] | None, node_security_group_id: pulumi.Input[str],
                 bastion_security_group_id: pulumi.Input[str] | None,
                 instance_profile_arn: pulumi.Input[str], key_name: pulumi.Input[str] | None,
                 controller_instance_profile: pulumi.Input[str] | None = None,
                 expiry: Expiry | None = None, retemplate: frozenset[int] = frozenset(),
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{COMPONENT_PREFIX}:Compute", ctx.resource_name("compute"), None, opts)
        spec = ctx.spec
        self._expiry = expiry
        self.requested_ami = spec.image.ami_id or resolve_ami(ctx, spec.image.ssm_parameter)
        self.placement_group_name, placement_group_arn = self._placement_group(ctx)
        # The bastion first: its expiry schedule must exist before any GPU capacity is asked for.
        self.bastion_public_ip = None
        if spec.access.bastion:
            bastion = self._bastion(ctx, public_subnet_id, bastion_security_group_id, key_name)
            self.bastion_public_ip = bastion.public_ip
            if expiry is not None:
                expiry.terminate("bastion", bastion.id)
        self.capacity_reservation_id = self._all_or_nothing(ctx, placement_group_arn)
        slots = efa_interface_layout(spec.instance.network_cards, spec.instance.efa_layout)
        self.efa_count = efa_count(slots)
        template = self._launch_template(ctx, slots, private_subnet_id, node_security_group_id,
                                         instance_profile_arn, key_name)
        # The AMI the nodes actually run (pinned in the template; see _launch_template).
        self.ami_id = template.image_id
        # Each node records the template version it was created with (the number, not "$Default"
        # or "$Latest", which would hide which nodes run what). Changes to it are ignored
        # afterwards: a template change (new AMI, volume size, EFA layout) creates a new template
        # version but replaces no running node. It reaches a node only through an explicit
        # `fsdpctl replace RANK`, which names the rank in `retemplate` for that one run, or on
        # nodes created later (scale-up, a fresh cluster).
        version = template.latest_version.apply(str)
        after_expiries = self._after_expiries()
        self.nodes = []
        for rank in range(spec.node_count):
            # The instance's own profile (by name) wins over the template's; changing it later is an
            # in-place association change, not a new instance.
            own_profile = controller_instance_profile if rank == CONTROLLER_RANK else None
            node = aws.ec2.Instance(
                spec.node_name(rank),
                launch_template={"id": template.id, "version": version},
                iam_instance_profile=own_profile,
                tags={**ctx.tags, RANK_TAG: str(rank), "Name": spec.node_name(rank)},
                opts=child_options(self, ignore_changes=[] if rank in retemplate
                                   else [NODE_TEMPLATE_PROPERTY], depends_on=after_expiries))
            if expiry is not None:
                expiry.terminate(f"node{rank}", node.id)
            self.nodes.append(node)
        self.register_outputs({"node_ids": [n.id for n in self.nodes]})

    def _after_expiries(self) -> list[pulumi.Resource]:
        """What GPU capacity waits for: the expiry schedule of everything billed created so far.
        Pulumi starts no new step once one has failed, and buying capacity is the step that fails
        (InsufficientInstanceCapacity); a schedule made after it would never exist."""
        return list(self._expiry.schedules) if self._expiry is not None else []

    def _placement_group(self, ctx: ClusterContext) -> tuple[pulumi.Output[str] | None,
                                                             pulumi.Output[str] | None]:
        """(name, ARN) of the cluster placement group, or (None, None)."""
        spec = ctx.spec
        if not spec.uses_placement_group:
            return None, None
        if spec.placement_group.existing_name:
            name = spec.placement_group.existing_name
            account = aws.get_caller_identity(opts=ctx.invoke_options()).account_id
            return (pulumi.Output.from_input(name), pulumi.Output.from_input(
                f"arn:{ctx.partition}:ec2:{spec.region}:{account}:placement-group/{name}"))
        group = aws.ec2.PlacementGroup(
            ctx.resource_name("placement"), strategy="cluster", tags=ctx.tags_named("placement"),
            opts=child_options(self))
        return group.name, group.arn

    def _all_or_nothing(self, ctx: ClusterContext,
                        placement_group_arn: pulumi.Output[str] | None) -> pulumi.Output[str] | None:
        """On-demand nodes: one On-Demand Capacity Reservation for all node_count instances, in the
        placement group. EC2 grants a reservation request whole or refuses it
        (InsufficientInstanceCapacity), and the nodes are launched only after it exists, into it
        (`targeted`: nothing else in the account can use it), so a short region fails the whole
        cluster before any GPU node bills, instead of leaving 3 of 4 nodes running. Each node stays
        its own instance with its own rank (`fsdpctl replace RANK` terminates one, freeing its slot,
        and launches the new one into the same reservation)."""
        spec = ctx.spec
        if not spec.capacity.reserves_on_demand:
            return None
        reservation = aws.ec2.CapacityReservation(
            ctx.resource_name("capacity"),
            instance_type=spec.instance_type,
            instance_platform="Linux/UNIX",
            availability_zone=spec.availability_zone,
            instance_count=spec.node_count,
            instance_match_criteria="targeted",
            end_date_type="unlimited",
            placement_group_arn=placement_group_arn,
            tags=ctx.tags_named("capacity"),
            opts=child_options(self, depends_on=self._after_expiries()))
        if self._expiry is not None:
            self._expiry.cancel_reservation(reservation.id)
        return reservation.id

    def _launch_template(self, ctx: ClusterContext, slots: list[InterfaceSlot],
                         subnet_id: pulumi.Input[str], security_group_id: pulumi.Input[str],
                         instance_profile_arn: pulumi.Input[str],
                         key_name: pulumi.Input[str] | None) -> aws.ec2.LaunchTemplate:
        spec = ctx.spec
        # By exact id (a safe filter); deprecated images included, as a pinned DLAMI ages.
        root_device = aws.ec2.get_ami(filters=[{"name": "image-id", "values": [self.requested_ami]}],
                                      include_deprecated=True, opts=ctx.invoke_options()).root_device_name
        interfaces = [
            {
                "network_card_index": slot.network_card_index,
                "device_index": slot.device_index,
                "interface_type": slot.interface_type,
                "subnet_id": subnet_id,
                "security_groups": [security_group_id],
                "delete_on_termination": "true",
                # No associate_public_ip_address: RunInstances refuses it (even "false") with more
                # than one interface. Nodes get no public IP; reach them through the bastion or SSM.
            }
            for slot in slots
        ]
        capacity = spec.capacity
        market: dict | None = None
        if capacity.type is CapacityType.SPOT:
            spot_options: dict = {"spot_instance_type": "one-time",
                                  "instance_interruption_behavior": "terminate"}
            if capacity.spot_max_price is not None:
                spot_options["max_price"] = str(capacity.spot_max_price)
            market = {"market_type": "spot", "spot_options": spot_options}
        elif capacity.type is CapacityType.CAPACITY_BLOCK:
            market = {"market_type": "capacity-block"}
        reservation = None
        reservation_id = (capacity.reservation_id if capacity.uses_reservation
                          else self.capacity_reservation_id)
        if reservation_id is not None:
            reservation = {"capacity_reservation_target": {"capacity_reservation_id": reservation_id}}
        placement = {"group_name": self.placement_group_name} if self.placement_group_name else None
        return aws.ec2.LaunchTemplate(
            ctx.resource_name(spec.instance_type.replace(".", "-")),
            description=f"fsdp-cluster {spec.name}: {spec.instance_type} with {efa_count(slots)} EFA",
            image_id=self.requested_ami,
            instance_type=spec.instance_type,
            key_name=key_name,
            iam_instance_profile={"arn": instance_profile_arn},
            metadata_options={"http_endpoint": "enabled", "http_tokens": "required",
                              "http_put_response_hop_limit": IMDS_HOP_LIMIT,
                              "instance_metadata_tags": "disabled"},
            block_device_mappings=[{
                "device_name": root_device,
                "ebs": {"volume_size": spec.storage.root_volume_gib, "volume_type": "gp3",
                        "encrypted": "true", "delete_on_termination": "true"},
            }],
            network_interfaces=interfaces,
            placement=placement,
            instance_market_options=market,
            capacity_reservation_specification=reservation,
            # Volumes and ENIs are tagged at launch so the teardown sweep can find any that survive.
            tag_specifications=[{"resource_type": "volume", "tags": ctx.tags},
                                {"resource_type": "network-interface", "tags": ctx.tags}],
            update_default_version=True,
            tags=ctx.tags_named(spec.instance_type.replace(".", "-")),
            # An image found through an SSM parameter ("latest DLAMI") is pinned at creation: a new
            # release must not give later nodes a different driver than the running ones. Set
            # image.ami_id to move the cluster to another image deliberately.
            opts=child_options(self, ignore_changes=[] if spec.image.ami_id else ["imageId"]))

    def _bastion(self, ctx: ClusterContext, subnet_id: pulumi.Input[str] | None,
                 security_group_id: pulumi.Input[str] | None,
                 key_name: pulumi.Input[str] | None) -> aws.ec2.Instance:
        access = ctx.spec.access
        # The bastion's image matches the node user, so one `ssh_user@bastion` ProxyJump works.
        ami = resolve_ami(ctx, BASTION_SSM_PARAMETERS[access.ssh_user])
        bastion = aws.ec2.Instance(
            ctx.resource_name("bastion"),
            ami=ami,
            instance_type=access.bastion_instance_type,
            subnet_id=subnet_id,
            vpc_security_group_ids=[security_group_id],
            associate_public_ip_address=True,
            key_name=key_name,
            metadata_options={"http_endpoint": "enabled", "http_tokens": "required",
                              "http_put_response_hop_limit": IMDS_HOP_LIMIT},
            root_block_device={"volume_type": "gp3", "volume_size": BASTION_ROOT_GIB, "encrypted": True,
                               "delete_on_termination": True, "tags": ctx.tags_named("bastion")},
            tags=ctx.tags_named("bastion"),
            # A new Ubuntu/Amazon Linux release must not replace the bastion (and its address).
            opts=child_options(self, ignore_changes=["ami"]))
        return bastion
