"""Hardware-shaped local nodes: the local target's nodes given a Deep Learning AMI p4d/p5 shape by a
node layer built here (dlami.py). Needs what the local-target tests need (root, systemd-nspawn)."""

from tests.local.conftest import prerequisites  # noqa: F401 (a fixture the tests here use)
