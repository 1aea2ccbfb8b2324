"""Suite-wide set-up shared by every test area."""

import contextlib

pytest_plugins = ["tests.faults.summary", "tests.local.demo_cluster", "tests.local.leftovers",
                  "tests.scheduling"]

# torch._dynamo registers a stand-in for sys.intern when it is first imported. Ansible, which the
# template tests import in this same process, replaces sys.intern with a callable object, after
# which that registration fails (TypeError: substitute_in_graph expects a function). Importing
# dynamo first lets both live in one test process; product code never imports the two together.
with contextlib.suppress(ImportError):
    import torch._dynamo  # noqa: F401
