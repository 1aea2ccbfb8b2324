"""fsdpctl: the operator CLI over one cluster spec and one state directory per cluster.

Each sub-command lives in its own module and is imported only when it runs, so `fsdpctl plan`
does not pay for Ansible and `fsdpctl configure` does not pay for pulumi_aws.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from infra.spec import SpecError
from infra.state import StateError

# sub-command -> "module:function"; each function takes the parsed arguments and returns an exit code.
HANDLERS = {
    "plan": "infra.plan:cmd_plan",
    "preflight": "infra.aws.preflight:cmd_preflight",
    "up": "infra.lifecycle:cmd_up",
    "configure": "infra.configure:cmd_configure",
    "inventory": "infra.inventory:cmd_inventory",
    "ssh": "infra.remote:cmd_ssh",
    "deploy": "infra.deploy:cmd_deploy",
    "smoke": "infra.smoke:cmd_smoke",
    "scale-test": "infra.scaling:cmd_scale_test",
    "status": "infra.lifecycle:cmd_status",
    "down": "infra.lifecycle:cmd_down",
    "exclude": "infra.lifecycle:cmd_exclude",
    "replace": "infra.aws.stack:cmd_replace",
    "demo": "infra.demo:cmd_demo",
}


class CommandError(RuntimeError):
    """A failure the user can act on: the message says what failed, why, and what to run next."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fsdpctl", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def cmd(name: str, help_text: str, cluster: bool = True) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if cluster:
            sp.add_argument("--cluster", help="cluster name (default: the one brought up last)")
        return sp

    sp = cmd("plan", "Show what `pulumi up` would create, and its cost, without AWS or the pulumi CLI.",
             cluster=False)
    sp.add_argument("spec", type=Path)
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.add_argument("--prices", type=Path, help="YAML price table overriding the built-in one")

    sp = cmd("preflight", "Check quotas, offerings, AMI, key pair, subnets and reservations with real "
             "credentials, before anything is created.", cluster=False)
    sp.add_argument("spec", type=Path)

    sp = cmd("up", "Create the cluster (AWS through Pulumi, or local nodes) and write its inventory.",
             cluster=False)
    sp.add_argument("spec", type=Path)
    sp.add_argument("--target", choices=["aws", "local"], default="aws")
    sp.add_argument("--nodes", type=int, help="local target: number of nodes (overrides node_count)")

    sp = cmd("configure", "Configure every node with ansible/site.yml through ansible-runner.")
    sp.add_argument("--tags", help="comma-separated Ansible tags to run")
    sp.add_argument("--limit", help="Ansible host pattern to limit the run to")
    sp.add_argument("--extra-vars", "-e", action="append", default=[], metavar="KEY=VALUE",
                    help="extra Ansible variable (repeatable)")

    sp = cmd("inventory", "Print the cluster's Ansible inventory (usable with ansible-playbook -i).")
    sp.add_argument("--format", choices=["ini", "json"], default="ini")

    sp = cmd("ssh", "Run a command on the node with this rank: fsdpctl ssh RANK -- CMD")
    sp.add_argument("rank", type=int)
    sp.add_argument("remote_command", nargs=argparse.REMAINDER)

    cmd("deploy", "Build the trainer wheel and wheelhouse and install them on every node (offline).")

    sp = cmd("smoke", "Run the acceptance checks on every node and write report.json / report.html.")
    sp.add_argument("--skip", action="append", default=[], help="check to skip (repeatable)")
    sp.add_argument("--steps", type=int, help="training steps for the FSDP run check")

    sp = cmd("scale-test", "Strong- and weak-scaling runs over 1..N nodes, with plots.")
    sp.add_argument("--steps", type=int, default=20)

    cmd("status", "Show the cluster's target, nodes and last results.")

    sp = cmd("down", "Tear the cluster down and sweep for leftovers; safe to run twice.")
    sp.add_argument("--force", action="store_true", help="aws: also delete leftovers the sweep finds")

    sp = cmd("exclude", "Record a bad node in the cluster's blacklist.")
    sp.add_argument("rank", type=int)
    sp.add_argument("--reason", required=True)

    sp = cmd("replace", "aws: terminate a node and let Pulumi recreate it with the same rank, "
             "then configure and deploy to it.")
    sp.add_argument("rank", type=int)

    sp = cmd("demo", "The main job on the local target: up -> configure -> deploy -> smoke -> down.",
             cluster=False)
    sp.add_argument("spec", type=Path, nargs="?", default=Path("examples/local.yaml"))
    sp.add_argument("--nodes", type=int, default=2)
    sp.add_argument("--keep", action="store_true", help="leave the cluster up afterwards")
    sp.add_argument("--smoke-steps", type=int, help="training steps for the smoke test's FSDP run")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module_name, func_name = HANDLERS[args.command].split(":")
    handler = getattr(importlib.import_module(module_name), func_name)
    try:
        return int(handler(args) or 0)
    except (SpecError, StateError, CommandError) as e:
        print(f"fsdpctl {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fsdpctl {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # Run through the importable module, so the CommandError that handlers raise (infra.cli's) is
    # the one main() catches, not a second copy defined in __main__.
    from infra.cli import main as _main

    sys.exit(_main())
