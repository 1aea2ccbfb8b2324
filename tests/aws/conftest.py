"""moto in-process for everything it implements; botocore Stubber or a thin before-call fake for
the calls moto lacks (service quotas for EC2, capacity reservations, placement groups)."""

from __future__ import annotations

from functools import cache

import boto3
import pytest
from botocore.awsrequest import AWSResponse
from botocore.stub import Stubber
from moto import mock_aws
from moto.core import DEFAULT_ACCOUNT_ID
from moto.ec2.models import ec2_backends
from moto.ec2.models.amis import Ami
from moto.ec2.utils import random_ami_id

from fsdpctl.targets.aws.clients import AwsClients
from infra.spec import parse_spec

REGION = "us-east-1"


@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # moto's ~1300 built-in AMIs cost seconds per test; the tests seed the few they need.
    monkeypatch.setenv("MOTO_EC2_LOAD_DEFAULT_AMIS", "false")
    with mock_aws():
        yield


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    """No AWS credentials anywhere boto3 looks: environment, files, instance and container metadata."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def seed_image(architecture: str, name: str) -> str:
    """An AMI with a given architecture (moto's register_image cannot set one)."""
    backend = ec2_backends[DEFAULT_ACCOUNT_ID][REGION]
    image = Ami(backend, ami_id=random_ami_id(), name=name, architecture=architecture,
                root_device_type="ebs", owner_id=DEFAULT_ACCOUNT_ID)
    backend.amis[image.id] = image
    return image.id


@cache
def _shared_session() -> boto3.Session:
    """One session for all tests: it caches the parsed service models (EC2's alone takes about a
    second to load). Every test sets the same fake credentials; moto's state is still per test."""
    return boto3.Session(region_name=REGION)


@pytest.fixture
def aws(aws_env) -> AwsClients:
    return AwsClients(_shared_session())


@pytest.fixture
def stub_quotas(monkeypatch):
    """Every AwsClients bundle answers the EC2 P-instance quota (moto has no EC2 quotas) with 768
    vCPUs; returns the Stubber so a test can assert the request was made."""
    client = boto3.client("service-quotas", region_name=REGION)
    stubber = Stubber(client)
    stubber.add_response("get_service_quota", {"Quota": {"Value": 768.0}})
    stubber.activate()
    monkeypatch.setattr(AwsClients, "service_quotas", property(lambda _: client))
    return stubber


def make_spec(**overrides):
    data = {
        "name": "pf", "region": REGION, "availability_zone": "us-east-1b",
        "instance_type": "p4d.24xlarge", "node_count": 2, "ssh_cidr": "203.0.113.0/24",
    }
    data.update(overrides)
    return parse_spec(data)


class Ec2Extras:
    """Placement groups and capacity reservations, which moto does not implement, answered on the
    moto-backed EC2 client through botocore's before-call hook (the request never leaves it)."""

    def __init__(self, client):
        self.placement_groups: dict[str, dict] = {}
        self.reservations: dict[str, dict] = {}
        self.calls: list[str] = []
        events = client.meta.events
        for operation, answer in (("CreatePlacementGroup", self._create_pg),
                                  ("DescribePlacementGroups", self._describe_pgs),
                                  ("DeletePlacementGroup", self._delete_pg),
                                  ("DescribeCapacityReservations", self._describe_reservations),
                                  ("CancelCapacityReservation", self._cancel_reservation)):
            # before-call sees only the serialized request: keep the caller's parameters for it.
            events.register(f"before-parameter-build.ec2.{operation}", self._keep_params)
            events.register(f"before-call.ec2.{operation}",
                            lambda context, answer=answer, **_: answer(context["fake_params"]))

    @staticmethod
    def _keep_params(params, context, **_):
        context["fake_params"] = dict(params)

    @staticmethod
    def _ok(body: dict):
        return (AWSResponse(None, 200, {}, None), {**body, "ResponseMetadata": {"HTTPStatusCode": 200}})

    @staticmethod
    def _error(code: str, message: str):
        return (AWSResponse(None, 400, {}, None), {"Error": {"Code": code, "Message": message},
                                                   "ResponseMetadata": {"HTTPStatusCode": 400}})

    def _create_pg(self, params):
        name = params["GroupName"]
        tags = [t for spec in params.get("TagSpecifications", []) for t in spec["Tags"]]
        self.placement_groups[name] = {"GroupName": name, "Strategy": params.get("Strategy", "cluster"),
                                       "State": "available", "Tags": tags}
        return self._ok({"PlacementGroup": self.placement_groups[name]})

    def _describe_pgs(self, params):
        groups = list(self.placement_groups.values())
        if names := params.get("GroupNames"):
            if unknown := [n for n in names if n not in self.placement_groups]:
                return self._error("InvalidPlacementGroup.Unknown", f"'{unknown[0]}' is unknown")
            groups = [self.placement_groups[n] for n in names]
        for f in params.get("Filters", []):
            if f["Name"].startswith("tag:"):
                key = f["Name"][4:]
                groups = [g for g in groups if any(t["Key"] == key and t["Value"] in f["Values"]
                                                   for t in g["Tags"])]
        return self._ok({"PlacementGroups": groups})

    def _delete_pg(self, params):
        self.calls.append("DeletePlacementGroup")
        if self.placement_groups.pop(params["GroupName"], None) is None:
            return self._error("InvalidPlacementGroup.Unknown", f"{params['GroupName']} unknown")
        return self._ok({})

    def _describe_reservations(self, params):
        wanted = params.get("CapacityReservationIds") or list(self.reservations)
        missing = [r for r in wanted if r not in self.reservations]
        if missing:
            return self._error("InvalidCapacityReservationId.NotFound", f"{missing[0]} not found")
        found = [self.reservations[r] for r in wanted]
        for f in params.get("Filters", []):
            if f["Name"].startswith("tag:"):
                key = f["Name"][4:]
                found = [r for r in found if any(t["Key"] == key and t["Value"] in f["Values"]
                                                 for t in r.get("Tags", []))]
            elif f["Name"] == "state":
                found = [r for r in found if r.get("State") in f["Values"]]
        return self._ok({"CapacityReservations": found})

    def _cancel_reservation(self, params):
        self.calls.append("CancelCapacityReservation")
        reservation = self.reservations.get(params["CapacityReservationId"])
        if reservation is None:
            return self._error("InvalidCapacityReservationId.NotFound", "not found")
        reservation["State"] = "cancelled"
        return self._ok({"Return": True})


class IamSimulation:
    """iam:SimulatePrincipalPolicy, which moto does not implement, answered on an IAM client through
    the before-call hook: every action allowed except `denied`; `refuse` makes the call itself fail
    with that error code (a caller without the right to simulate)."""

    def __init__(self, client):
        self.denied: set[str] = set()
        self.refuse: str | None = None
        self.principals: list[str] = []
        events = client.meta.events
        events.register("before-parameter-build.iam.SimulatePrincipalPolicy", Ec2Extras._keep_params)
        events.register("before-call.iam.SimulatePrincipalPolicy",
                        lambda context, **_: self._answer(context["fake_params"]))

    def _answer(self, params):
        self.principals.append(params["PolicySourceArn"])
        if self.refuse:
            return Ec2Extras._error(self.refuse, "not authorized to perform iam:SimulatePrincipalPolicy")
        return Ec2Extras._ok({"IsTruncated": False, "EvaluationResults": [
            {"EvalActionName": action, "EvalResourceName": "*",
             "EvalDecision": "explicitDeny" if action in self.denied else "allowed"}
            for action in params["ActionNames"]]})


class _LazyIam:
    """The IAM client with the simulation, created on first use (after the credentials are set)."""

    def __init__(self):
        self.client = None
        self.fake = IamSimulation.__new__(IamSimulation)
        self.fake.denied, self.fake.refuse, self.fake.principals = set(), None, []

    def get(self, _clients=None):
        if self.client is None:
            self.client = _shared_session().client("iam", region_name=REGION)
            denied, refuse, principals = self.fake.denied, self.fake.refuse, self.fake.principals
            self.fake.__init__(self.client)
            self.fake.denied, self.fake.refuse, self.fake.principals = denied, refuse, principals
        return self.client


@pytest.fixture(autouse=True)
def iam_simulation(monkeypatch) -> IamSimulation:
    lazy = _LazyIam()
    monkeypatch.setattr(AwsClients, "iam", property(lazy.get))
    return lazy.fake
