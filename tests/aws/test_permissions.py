"""The IAM policy is derived from what the code calls and what the program registers: every boto3
call in fsdpctl (found in the source, mapped to its IAM action through botocore's service model),
every resource type and look-up of the program (run under Pulumi's mocks with every optional part
on) must have its actions in fsdpctl/targets/aws/permissions.py, and the policy document built from
it must grant them and fit IAM's managed-policy limit."""

from __future__ import annotations

import ast
import fnmatch
import functools
import json
import re
from pathlib import Path

import boto3

from fsdpctl import cli
from fsdpctl.targets.aws import permissions, sweep
from fsdpctl.targets.aws.clients import AwsClients
from tests.infra.conftest import plan_of

REPO = Path(__file__).resolve().parents[2]
# Where a service's IAM prefix differs from its signing name.
IAM_PREFIX = {"tagging": "tag"}
# S3 authorizes many operations as an action of another name (the S3 user guide's "Required
# permissions for Amazon S3 API operations"): each S3 operation fsdpctl calls is mapped here.
S3_ACTIONS = {
    "HeadBucket": ("s3:ListBucket",),
    "ListObjectVersions": ("s3:ListBucketVersions",),
    # The sweep deletes every version and delete marker of the bucket's objects.
    "DeleteObjects": ("s3:DeleteObject", "s3:DeleteObjectVersion"),
    "DeleteBucket": ("s3:DeleteBucket",),
}
MANAGED_POLICY_MAX_CHARS = 6144  # IAM counts every character of a managed policy but whitespace
# Spec variants that together switch every optional part of the program on.
VARIANTS = {
    "everything": {"storage": {"fsx": {"enabled": True, "s3_import_path": "s3://acme-data/tokens",
                                       "s3_export_path": "s3://acme-data/tokens"}},
                   "access": {"public_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDemoKey op@laptop"}},
    "legacy-fsx-spot": {"capacity": {"type": "spot"},
                        "storage": {"fsx": {"enabled": True, "deployment_type": "SCRATCH_2",
                                            "s3_import_path": "s3://acme-data/tokens"}}},
    "block-in-existing-group": {"capacity": {"type": "capacity-block",
                                             "reservation_id": "cr-0123456789abcdef0"},
                                "placement_group": {"existing_name": "train-pg"}},
    "existing-vpc-ssm-only": {"network": {"vpc_id": "vpc-0abc", "private_subnet_id": "subnet-0priv"},
                              "access": {"bastion": False}},
}


@functools.cache
def _clients() -> dict[str, object]:
    """Every client AwsClients offers, by attribute name, read from clients.py (`def ec2(self): return
    self._client("ec2")`; the class itself may be patched by a fixture) and built offline."""
    session = boto3.Session(region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    tree = ast.parse((REPO / "fsdpctl" / "targets" / "aws" / "clients.py").read_text())
    [bundle] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == AwsClients.__name__]
    services = {}
    for method in (n for n in bundle.body if isinstance(n, ast.FunctionDef)):
        calls = [c for c in ast.walk(method) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                 and c.func.attr == "_client"]
        if calls:
            services[method.name] = session.client(_literal(calls[0].args[0]))
    assert {"ec2", "iam", "s3", "tagging"} <= set(services)
    return services


def _iam_actions(client_name: str, method: str) -> tuple[str, ...]:
    client = _clients()[client_name]
    operation = client.meta.method_to_api_mapping[method]
    model = client.meta.service_model
    prefix = IAM_PREFIX.get(model.signing_name, model.signing_name)
    if prefix == "s3":
        assert operation in S3_ACTIONS, f"map S3 {operation} to its IAM action(s) in S3_ACTIONS"
        return S3_ACTIONS[operation]
    return (f"{prefix}:{operation}",)


def _client_attribute(node: ast.AST) -> str | None:
    """`x.ec2` -> "ec2" when ec2 is one of AwsClients' clients."""
    return node.attr if isinstance(node, ast.Attribute) and node.attr in _clients() else None


def _literal(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def code_calls(path: Path) -> set[tuple[str, str]]:
    """(client, boto3 method) for every AWS call in one module: `aws.ec2.describe_vpcs(...)`,
    `aws.ec2.get_paginator("describe_instances")`, `aws.ec2.get_waiter(...)`, and an operation name
    handed to a helper with the client (`_paginate(aws.ec2, "describe_volumes", ...)`) or without it
    (`_tagged_iam(aws, "list_roles", ...)`, then of the clients the enclosing function uses)."""
    tree = ast.parse(path.read_text())
    calls: set[tuple[str, str]] = set()

    def operations(client: str) -> dict[str, str]:
        return _clients()[client].meta.method_to_api_mapping

    def visit(scope: ast.AST) -> None:
        used = {c for node in ast.walk(scope) if (c := _client_attribute(node))}
        for node in ast.iter_child_nodes(scope):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(node)
                continue
            for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
                target = call.func
                client = _client_attribute(target.value) if isinstance(target, ast.Attribute) else None
                if client and target.attr in operations(client):
                    calls.add((client, target.attr))
                elif client and target.attr in ("get_paginator", "get_waiter") and call.args:
                    name = _literal(call.args[0])
                    assert name, f"{path.name}:{call.lineno}: {target.attr} needs a literal name"
                    if target.attr == "get_waiter":
                        name = _clients()[client].get_waiter(name).config.operation
                        name = next(m for m, op in operations(client).items() if op == name)
                    calls.add((client, name))
                else:
                    arguments = [*call.args, *(k.value for k in call.keywords)]
                    given = {c for a in arguments if (c := _client_attribute(a))}
                    for name in filter(None, map(_literal, arguments)):
                        calls.update((c, name) for c in (given or used) if name in operations(c))

    visit(tree)
    return calls


def fsdpctl_actions() -> dict[str, set[str]]:
    """IAM action -> the modules that call it, over all of fsdpctl."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / "fsdpctl").rglob("*.py")):
        for client, method in code_calls(path):
            for action in _iam_actions(client, method):
                found.setdefault(action, set()).add(str(path.relative_to(REPO)))
    return found


def granted(document: dict, action: str) -> bool:
    """Whether any statement of the policy names the action (IAM matches actions case-insensitively,
    with * and ? wildcards)."""
    for statement in document["Statement"]:
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        if statement["Effect"] == "Allow" and any(fnmatch.fnmatch(action.lower(), pattern.lower())
                                                  for pattern in actions):
            return True
    return False


def test_only_aws_clients_creates_boto3_clients():
    """The call scan below sees every AWS call only if every client comes from AwsClients."""
    offenders = [str(p.relative_to(REPO)) for p in (REPO / "fsdpctl").rglob("*.py")
                 if re.search(r"^\s*(import boto3|from boto3)", p.read_text(), re.M)
                 and p.name != "clients.py"]
    assert not offenders, f"create AWS clients in fsdpctl/targets/aws/clients.py, not in {offenders}"


def test_the_scan_sees_every_form_of_call(tmp_path):
    module = tmp_path / "module.py"
    module.write_text(
        "def listing(aws):\n"
        "    aws.ec2.create_fleet(LaunchTemplateConfigs=[])\n"
        "    aws.ec2.get_waiter('instance_terminated').wait()\n"
        "    pages = aws.iam.get_paginator('list_users').paginate()\n"
        "    return _paginate(aws.fsx, 'describe_backups', 'Backups'), pages\n"
        "def by_name(aws):\n"
        "    aws.scheduler.get_schedule(Name='x')\n"
        "    return _helper(aws, 'list_schedules')\n"
        "def unrelated(spec):\n"
        "    return spec.storage.fsx.model_copy(), 'describe_backups'\n")
    assert code_calls(module) == {("ec2", "create_fleet"), ("ec2", "describe_instances"),
                                  ("iam", "list_users"), ("fsx", "describe_backups"),
                                  ("scheduler", "get_schedule"), ("scheduler", "list_schedules")}


def test_every_aws_call_of_fsdpctl_is_in_the_policy():
    found = fsdpctl_actions()
    # The scan finds direct calls, paginators and operation names passed to helpers.
    assert {"ec2:DeleteNetworkInterface", "ec2:DeleteVolume", "ec2:DisassociateRouteTable",
            "servicequotas:GetAWSDefaultServiceQuota", "ec2:DescribeInstances", "iam:ListRoles",
            "s3:ListBucketVersions", "iam:SimulatePrincipalPolicy"} <= set(found)
    assert "fsx:DescribeVolumes" not in found  # "describe_volumes" is handed to _paginate with aws.ec2
    listed = set(permissions.OPERATOR_CALLS)
    missing = {a: sorted(where) for a, where in found.items() if a not in listed}
    assert not missing, f"add these to OPERATOR_CALLS in fsdpctl/targets/aws/permissions.py: {missing}"
    assert sorted(listed - set(found)) == [], "OPERATOR_CALLS lists actions fsdpctl no longer calls"
    document = permissions.policy_document()
    assert [a for a in found if not granted(document, a)] == []


def _registered(name: str, expires_at: str | None) -> tuple[set[str], set[str]]:
    plan = plan_of(expires_at=expires_at, **VARIANTS[name])
    return {r.type for r in plan.mocks.resources}, {lookup.token for lookup in plan.mocks.lookups}


def test_every_resource_type_and_lookup_of_the_program_has_its_actions():
    types: set[str] = set()
    tokens: set[str] = set()
    # The pinned expiry time (fsdpctl up) and the program's own clock (plain pulumi up).
    for name in VARIANTS:
        for expires_at in ("2026-12-03T13:00:00Z", None):
            found_types, found_tokens = _registered(name, expires_at)
            types |= found_types
            tokens |= found_tokens
    # The variants do reach every optional part.
    assert {"aws:fsx/dataRepositoryAssociation:DataRepositoryAssociation", "aws:ec2/keyPair:KeyPair",
            "aws:ec2/capacityReservation:CapacityReservation", "time:index/rotating:Rotating",
            "aws:scheduler/schedule:Schedule"} <= types
    assert "aws:index/getCallerIdentity:getCallerIdentity" in tokens
    missing_types = sorted(types - set(permissions.RESOURCE_ACTIONS))
    assert not missing_types, f"add RESOURCE_ACTIONS entries (create/read/update/delete/tag): {missing_types}"
    missing_lookups = sorted(tokens - set(permissions.LOOKUP_ACTIONS))
    assert not missing_lookups, f"add LOOKUP_ACTIONS entries for {missing_lookups}"
    document = permissions.policy_document()
    ungranted = sorted(a for t in types for a in permissions.RESOURCE_ACTIONS[t].actions
                       if not granted(document, a))
    assert not ungranted


def test_what_the_provider_needs_beyond_create_is_required():
    """The read-back, in-place updates, tagging and deletes the provider makes (issue 20's list)."""
    required = set(permissions.required_actions())
    assert {"iam:TagInstanceProfile", "fsx:DeleteDataRepositoryAssociation", "ec2:ModifyCapacityReservation",
            "ec2:ReplaceRoute", "ec2:DeleteRoute", "iam:CreateServiceLinkedRole",
            "ec2:DescribeInstanceCreditSpecifications", "sqs:ReceiveMessage"} <= required
    # Each entry names real actions, "service:Action".
    assert all(re.fullmatch(r"[a-z0-9-]+:[A-Z][A-Za-z0-9]+", a) for a in required), required


def test_only_the_programs_roles_may_be_passed():
    """iam:PassRole is scoped to name patterns: every role the program creates must match one (Pulumi
    names a role <logical name>-<7 random hex>), and PassRole is in no statement on every resource."""
    document = permissions.policy_document()
    [scoped] = [s for s in document["Statement"] if "iam:PassRole" in s["Action"]]
    assert scoped["Resource"] == ["arn:*:iam::*:role/*-node-*", "arn:*:iam::*:role/*-expiry-*"]
    for name in VARIANTS:
        plan = plan_of(**VARIANTS[name])
        roles = plan.mocks.of_type("aws:iam/role:Role")
        assert roles
        own = permissions.policy_document(cluster=plan.spec.name, partition="aws")
        [own_scope] = [s for s in own["Statement"] if "iam:PassRole" in s["Action"]]
        for role in roles:
            assert "name" not in role.inputs, f"{role.name}: a fixed name would need its own PassRole pattern"
            arn = f"arn:aws:iam::123456789012:role/{role.name}-0a1b2c3"
            assert any(fnmatch.fnmatchcase(arn, pattern) for pattern in own_scope["Resource"]), arn


def test_policy_is_one_valid_managed_policy():
    document = permissions.policy_document()
    size = len("".join(json.dumps(document, separators=(",", ":")).split()))
    assert size <= MANAGED_POLICY_MAX_CHARS, f"{size} characters: split the policy or add a wildcard"
    sids = [s["Sid"] for s in document["Statement"]]
    assert len(sids) == len(set(sids)) and all(re.fullmatch(r"[A-Za-z0-9]+", s) for s in sids)
    # Only read-only metadata is granted by wildcard.
    wildcards = {a for s in document["Statement"] for a in s["Action"] if "*" in a}
    assert wildcards == {"ec2:Describe*"}


def test_simulation_covers_every_required_action():
    requests = permissions.simulation_requests("pf", "aws", "123456789012")
    assert {a for r in requests for a in r.actions} == set(permissions.required_actions())
    pass_role = next(r for r in requests if r.actions == ("iam:PassRole",))
    assert pass_role.resource_arns == ("arn:aws:iam::123456789012:role/pf-node-*",
                                       "arn:aws:iam::123456789012:role/pf-expiry-*")
    linked = [r.context_value for r in requests if r.context_key == "iam:AWSServiceName"]
    assert linked == list(permissions.SERVICE_LINKED_ROLE_SERVICES)


def test_print_policy_needs_no_credentials(no_credentials, capsys):
    assert cli.main(["preflight", "--print-policy"]) == 0
    assert json.loads(capsys.readouterr().out) == permissions.policy_document()


def test_print_policy_for_a_spec_names_its_roles(no_credentials, tmp_path, capsys):
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text("name: gov\nregion: us-gov-west-1\navailability_zone: us-gov-west-1a\n"
                         "instance_type: p4d.24xlarge\nnode_count: 2\nssh_cidr: 203.0.113.0/24\n")
    assert cli.main(["preflight", "--print-policy", str(spec_file)]) == 0
    document = json.loads(capsys.readouterr().out)
    [scoped] = [s for s in document["Statement"] if "iam:PassRole" in s["Action"]]
    assert scoped["Resource"] == ["arn:aws-us-gov:iam::*:role/gov-node-*",
                                  "arn:aws-us-gov:iam::*:role/gov-expiry-*"]


def test_preflight_without_a_spec_says_what_it_needs(no_credentials, capsys):
    assert cli.main(["preflight"]) == 2
    assert "preflight needs SPEC" in capsys.readouterr().err


def test_a_newcomer_with_the_policy_can_sweep_a_cluster(aws, monkeypatch):
    """`fsdpctl down --force` with nothing but the policy: a half-destroyed cluster is planted with
    the account's own credentials, then swept with the newcomer's while moto refuses every call the
    policy does not allow."""
    from moto.core import enable_iam_authentication
    from moto.iam.access_control import IAMRequestBase

    from .conftest import Ec2Extras
    from .test_preflight import newcomer
    from .test_sweep import CLUSTER, plant_cluster

    planted = Ec2Extras(aws.ec2)
    plant_cluster(aws, planted)
    document = permissions.policy_document()
    # Two moto quirks, neither about permissions: it authorizes the Resource Groups Tagging API under
    # its signing name, tagging:GetResources, where IAM uses tag:GetResources (the newcomer gets both
    # names), and it miscomputes the signature of REST requests such as Scheduler's (the signature
    # check is skipped; the permission check is not).
    document["Statement"].append({"Sid": "MotoTaggingName", "Effect": "Allow",
                                  "Action": "tagging:GetResources", "Resource": "*"})
    monkeypatch.setattr(IAMRequestBase, "check_signature", lambda _self: None)
    clients = newcomer(document, monkeypatch)
    extras = Ec2Extras(clients.ec2)  # the placement group and reservation moto lacks, shared
    extras.placement_groups, extras.reservations = planted.placement_groups, planted.reservations
    with enable_iam_authentication():
        report = sweep.sweep(clients, CLUSTER, force=True, out=lambda _: None)
    assert report.failed == [] and report.listing_errors == []
    assert report.clean and len(report.deleted) == 23
