"""Checks that need more than one field of the spec."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Any

from infra import catalog
from infra.spec.constants import BASTION_SSM_PARAMETERS, FSX_PERSISTENT_THROUGHPUTS, REGION_RE
from infra.spec.problems import Problem


def cross_field_problems(data: Mapping[str, Any]) -> list[Problem]:
    """Checks that need more than one field. Works on raw (possibly invalid) input, with each
    section's defaults filled in under it (`load.with_section_defaults`: model.py states each default
    once), so that a spec with both a bad field and a bad combination reports both at once."""
    problems: list[Problem] = []

    def sub(key: str) -> Mapping[str, Any]:
        v = data.get(key)
        return v if isinstance(v, Mapping) else {}

    region, az = data.get("region"), data.get("availability_zone")
    if isinstance(region, str) and isinstance(az, str) and REGION_RE.match(region):
        zones = catalog.regions().zones(region)
        if not re.fullmatch(re.escape(region) + r"[a-z]", az):
            problems.append(Problem(
                "availability_zone", az, f"is not an availability zone of region {region}",
                f"use {region} followed by a zone letter, e.g. {region}a, or change region"))
        elif zones and az not in zones:
            problems.append(Problem(
                "availability_zone", az, f"is not a zone of {region}, whose zones run from {zones[0]} to "
                f"{zones[-1]} (infra/data/regions.yaml)",
                f"use one of {', '.join(zones)}"))

    cidr = data.get("ssh_cidr")
    if isinstance(cidr, str) and not data.get("allow_ssh_from_anywhere"):
        try:
            if ipaddress.ip_network(cidr, strict=False).prefixlen == 0:
                problems.append(Problem(
                    "ssh_cidr", cidr, "opens SSH to the whole internet",
                    "give your office/VPN CIDR, or set allow_ssh_from_anywhere: true to accept the risk"))
        except ValueError:
            pass  # reported by the field validator

    capacity = sub("capacity")
    ctype, reservation = capacity.get("type"), capacity.get("reservation_id")
    if ctype == "spot" and reservation:
        problems.append(Problem(
            "capacity.reservation_id", reservation, "cannot be combined with capacity.type spot",
            "remove reservation_id to use spot, or set capacity.type: capacity-reservation"))
    if ctype in ("capacity-reservation", "capacity-block") and not reservation:
        problems.append(Problem(
            "capacity.reservation_id", reservation, f"is required for capacity.type {ctype}",
            "give the reservation id (cr-...) from the EC2 console or describe-capacity-reservations"))
    if isinstance(reservation, str) and not re.fullmatch(r"cr-[0-9a-f]{8,17}", reservation):
        problems.append(Problem(
            "capacity.reservation_id", reservation, "is not a capacity reservation id",
            "use cr- followed by 17 hex digits"))
    if capacity.get("spot_max_price") is not None and ctype != "spot":
        problems.append(Problem(
            "capacity.spot_max_price", capacity.get("spot_max_price"), f"has no meaning for {ctype}",
            "remove it, or set capacity.type: spot"))

    network = sub("network")
    has_vpc = bool(network.get("vpc_id"))
    if has_vpc != bool(network.get("private_subnet_id")):
        problems.append(Problem(
            "network.private_subnet_id" if has_vpc else "network.vpc_id",
            network.get("private_subnet_id") if has_vpc else network.get("vpc_id"),
            "an existing VPC needs both vpc_id and private_subnet_id",
            "give both, or neither to let the program create the network"))
    access = sub("access")
    if has_vpc and access.get("bastion") and not network.get("public_subnet_id"):
        problems.append(Problem(
            "network.public_subnet_id", None, "a bastion in an existing VPC needs a public subnet",
            "give network.public_subnet_id, or set access.bastion: false and use SSM"))
    if not access.get("bastion") and not access.get("ssm"):
        problems.append(Problem(
            "access", {"bastion": False, "ssm": False}, "leaves no way to reach the private nodes",
            "enable access.bastion or access.ssm"))
    ssh_user = access.get("ssh_user")
    if access.get("bastion") and isinstance(ssh_user, str) and ssh_user not in BASTION_SSM_PARAMETERS:
        problems.append(Problem(
            "access.ssh_user", ssh_user,
            "has no matching bastion image (the bastion logs in as the same user)",
            f"use one of {', '.join(BASTION_SSM_PARAMETERS)}, or set access.bastion: false and use SSM"))
    if access.get("key_name") and access.get("public_key"):
        problems.append(Problem(
            "access.public_key", "<key>", "conflicts with access.key_name",
            "give either an existing key pair name or a public key to import, not both"))

    fsx = sub("storage").get("fsx")
    if isinstance(fsx, Mapping) and fsx.get("enabled"):
        problems.extend(_fsx_problems(fsx))
    problems.extend(_scaling_problems(sub("scaling"), data.get("node_count")))
    return problems


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _scaling_problems(scaling: Mapping[str, Any], node_count: Any) -> list[Problem]:
    """scaling against node_count (a bad node_count is reported by its own validator)."""
    if not _whole(node_count) or node_count < 1:
        return []
    problems = []
    min_nodes, max_nodes = scaling.get("min_nodes"), scaling.get("max_nodes")
    if _whole(min_nodes) and min_nodes > node_count:
        problems.append(Problem(
            "scaling.min_nodes", min_nodes, f"is more than node_count {node_count}",
            f"use 1 to {node_count}, or leave it out to keep every node on"))
    if _whole(max_nodes) and max_nodes != node_count:
        # Power saving stops and starts the nodes `up` made; it never launches or terminates one.
        larger = f"; for up to {max_nodes} nodes set node_count: {max_nodes}" \
            if max_nodes > node_count else ""
        problems.append(Problem(
            "scaling.max_nodes", max_nodes,
            f"differs from node_count {node_count}: `up` creates every node and idle ones are stopped, "
            "not terminated, so node_count nodes is the most that run",
            f"set it to {node_count} or leave it out{larger}"))
    return problems


def _fsx_problems(fsx: Mapping[str, Any]) -> list[Problem]:
    problems = []
    dtype = fsx.get("deployment_type")
    cap = fsx.get("capacity_gib")
    if isinstance(cap, int) and not (cap in (1200, 2400) or (cap > 2400 and cap % 2400 == 0)):
        lower = max(1200, (cap // 2400) * 2400) if cap > 1200 else 1200
        upper = 2400 if cap < 2400 else lower + 2400
        problems.append(Problem(
            "storage.fsx.capacity_gib", cap, f"is not a size FSx for Lustre {dtype} accepts "
            "(1200, 2400, then steps of 2400 GiB)", f"use {lower} or {upper}"))
    tput = fsx.get("throughput_per_tib")
    allowed = FSX_PERSISTENT_THROUGHPUTS.get(dtype)
    if allowed and tput not in allowed:
        problems.append(Problem(
            "storage.fsx.throughput_per_tib", tput, f"is not offered for {dtype}",
            f"use one of {', '.join(map(str, allowed))} MB/s/TiB"))
    export, imported = fsx.get("s3_export_path"), fsx.get("s3_import_path")
    if dtype == "PERSISTENT_2" and export and imported and export != imported:
        problems.append(Problem(
            "storage.fsx.s3_export_path", export,
            "differs from s3_import_path; PERSISTENT_2 links one S3 path for import and export",
            f"set it to {imported}, or leave it empty for import only"))
    if fsx.get("s3_export_path") and not fsx.get("s3_import_path"):
        problems.append(Problem(
            "storage.fsx.s3_export_path", fsx.get("s3_export_path"), "needs an import path too",
            "set storage.fsx.s3_import_path (usually the same bucket and prefix)"))
    # FSx for Lustre backs up persistent file systems that are not linked to S3 only (the Lustre
    # guide, "Working with backups"); the expiry's DeleteFileSystem would fail, deleting nothing.
    if fsx.get("at_expiry") == "backup":
        if not str(dtype).startswith("PERSISTENT"):
            problems.append(Problem(
                "storage.fsx.at_expiry", "backup", f"FSx takes no backups of {dtype} file systems",
                "use delete, or keep (it bills until fsdpctl down), or deployment_type PERSISTENT_2"))
        elif imported:
            problems.append(Problem(
                "storage.fsx.at_expiry", "backup",
                "FSx takes no backups of a file system linked to S3 (s3_import_path)",
                "use delete with s3_export_path (changes are exported to S3), or keep (it bills until "
                "fsdpctl down)"))
    return problems

