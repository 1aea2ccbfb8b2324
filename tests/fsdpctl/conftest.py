"""The operator tool's tests share the offline plans of tests/infra (the Pulumi program under mocks)."""

from tests.infra.conftest import demo_plan  # noqa: F401 - a fixture
