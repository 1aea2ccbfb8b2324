"""fsdpctl: the operator CLI over one cluster spec and one state directory per cluster.

This module is the parser and the dispatch, nothing else, and nothing imports it (but `__main__`).
Each sub-command's handler lives in the module of its stage and is imported only when it runs, so
`fsdpctl plan` does not pay for Ansible and `fsdpctl configure` does not pay for pulumi_aws.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import sys
from pathlib import Path

from fsdpctl import __version__
from fsdpctl.checkout import ANSIBLE_STRATEGIES, DEFAULT_ANSIBLE_STRATEGY
from fsdpctl.console import error, say
from fsdpctl.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_CODES,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    CommandError,
    UsageError,
    missing_package,
)
from fsdpctl.state import TARGET_NAMES
from infra.spec import SpecError

# sub-command -> "module:function"; each function takes the parsed arguments and returns an exit code.
HANDLERS = {
    "plan": "fsdpctl.plan:cmd_plan",
    "preflight": "fsdpctl.targets.aws.preflight:cmd_preflight",
    "up": "fsdpctl.lifecycle:cmd_up",
    "configure": "fsdpctl.configure:cmd_configure",
    "inventory": "fsdpctl.inventory:cmd_inventory",
    "ssh": "fsdpctl.remote:cmd_ssh",
    "deploy": "fsdpctl.deploy:cmd_deploy",
    "smoke": "fsdpctl.checks.smoke:cmd_smoke",
    "scale-test": "fsdpctl.checks.scaling:cmd_scale_test",
    "monitor": "fsdpctl.monitor:cmd_monitor",
    "status": "fsdpctl.lifecycle:cmd_status",
    "list": "fsdpctl.lifecycle:cmd_list",
    "down": "fsdpctl.lifecycle:cmd_down",
    "exclude": "fsdpctl.lifecycle:cmd_exclude",
    "replace": "fsdpctl.lifecycle:cmd_replace",
    "heal": "fsdpctl.heal:cmd_heal",
    "extend": "fsdpctl.lifecycle:cmd_extend",
    "train": "fsdpctl.train:cmd_train",
    "jobs": "fsdpctl.jobs:cmd_jobs",
    "logs": "fsdpctl.jobs:cmd_logs",
    "cancel": "fsdpctl.jobs:cmd_cancel",
    "demo": "fsdpctl.cli:cmd_demo",
    "completion": "fsdpctl.cli:cmd_completion",
}
# Commands that take the cluster's name first too (`fsdpctl down demo`, as `sky down NAME`): those
# with no positional argument of their own.
NAMED_FIRST = ("configure", "inventory", "deploy", "smoke", "scale-test", "monitor", "status", "down", "heal",
               "extend", "jobs")
SHELLS = ("bash", "zsh", "tcsh")
_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")


class Parser(argparse.ArgumentParser):
    """argparse with a "did you mean" for a mistyped command or choice."""

    def error(self, message: str):  # type: ignore[override]
        match = _INVALID_CHOICE.search(message)
        if match:
            choices = re.findall(r"'([^']*)'", match.group(2))
            near = difflib.get_close_matches(match.group(1), choices, n=1, cutoff=0.5)
            if near:
                message += f"; did you mean {near[0]!r}?"
        super().error(message)


def _epilog() -> str:
    codes = "\n".join(f"  {code:<4} {meaning}" for code, meaning in EXIT_CODES.items())
    return (f"exit status:\n{codes}\n\nFSDPCTL_HOME (default ~/.fsdpctl) holds every cluster's state and "
            "reports. Shell completion: `fsdpctl completion bash` (docs/commands.md).")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="fsdpctl", description=__doc__.splitlines()[0], epilog=_epilog(),
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"fsdpctl {__version__}",
                   help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)

    def cmd(name: str, help_text: str, cluster: bool = True) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_text, description=help_text, epilog=_epilog(),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        if name in NAMED_FIRST:
            sp.add_argument("cluster_name", nargs="?", metavar="NAME",
                            help="the cluster to act on, as --cluster NAME")
        if cluster:
            sp.add_argument("--cluster", metavar="NAME",
                            help="the cluster to act on (default: the one brought up last; `fsdpctl list`)")
        return sp

    def spec_argument(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("spec", type=Path, metavar="SPEC",
                        help="the cluster spec YAML (docs/cluster-spec.md)")

    def yes_argument(sp: argparse.ArgumentParser, what: str) -> None:
        sp.add_argument("--yes", "-y", action="store_true",
                        help=f"{what} without asking (needed when there is no terminal to ask on)")

    sp = cmd("plan", "Show what `pulumi up` would create, and its cost, without AWS or the pulumi CLI.",
             cluster=False)
    spec_argument(sp)
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.add_argument("--prices", type=Path, metavar="FILE",
                    help="YAML price table merged over the built-in one (infra/data/prices.yaml)")
    sp.add_argument("--trainer-config", metavar="NAME",
                    help="the trainer config whose memory fit to show (default: the spec's trainer.config; "
                         "e.g. gpt-7b)")
    sp.add_argument("--tokens", metavar="N",
                    help="also show how long and how much training the config on N tokens takes, here and "
                         "on the cheapest cluster that fits (e.g. 1e9)")
    sp.add_argument("--mfu", metavar="FRACTION",
                    help="with --tokens: the model FLOPs utilisation to assume, 0-1 (default: the GPU "
                         "check's measurement, docs/gpu-check.md)")

    sp = cmd("preflight", "Check quotas, offerings, AMI, key pair, subnets, reservations and IAM permissions "
             "with real credentials, before anything is created.", cluster=False)
    sp.add_argument("spec", type=Path, metavar="SPEC", nargs="?",
                    help="the cluster spec YAML (docs/cluster-spec.md); optional with --print-policy")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.add_argument("--print-policy", action="store_true",
                    help="print the IAM policy the aws target needs and exit (no credentials needed; with "
                         "SPEC, its role statements name only that cluster's roles)")

    sp = cmd("up", "Create the cluster (AWS through Pulumi, or local nodes) and write its inventory.",
             cluster=False)
    spec_argument(sp)
    sp.add_argument("--target", choices=TARGET_NAMES, default="aws",
                    help="where the nodes come from: aws (Pulumi) or local (systemd-nspawn nodes here)")
    sp.add_argument("--nodes", type=int, metavar="N",
                    help="local target: number of nodes (overrides node_count)")
    yes_argument(sp, "create or update the AWS resources")

    sp = cmd("configure", "Configure every node with ansible/site.yml through ansible-runner.")
    sp.add_argument("--tags", help="comma-separated Ansible tags to run (e.g. network,nccl)")
    sp.add_argument("--limit", metavar="PATTERN", help="Ansible host pattern to limit the run to")
    sp.add_argument("--extra-vars", "-e", action="append", default=[], metavar="KEY=VALUE",
                    help="extra Ansible variable (repeatable)")
    sp.add_argument("--check", action="store_true",
                    help="Ansible's check mode: report what would change, change nothing on the nodes")
    sp.add_argument("--strategy", choices=ANSIBLE_STRATEGIES, default=DEFAULT_ANSIBLE_STRATEGY,
                    help="how Ansible runs the tasks: Mitogen for Ansible (default: about half the CPU) or "
                         "Ansible's own linear strategy")

    sp = cmd("inventory", "Print the cluster's Ansible inventory (usable with ansible-playbook -i).")
    sp.add_argument("--format", choices=["ini", "json"], default="ini", help="inventory format")

    sp = cmd("ssh", "Run a command on the node with this rank: fsdpctl ssh RANK -- CMD")
    sp.add_argument("rank", type=int, metavar="RANK", help="the node's rank (`fsdpctl status` lists them)")
    sp.add_argument("remote_command", nargs=argparse.REMAINDER, metavar="CMD",
                    help="the command to run (none: an interactive shell)")

    cmd("deploy", "Build the trainer wheel and wheelhouse and install them on every node (offline).")

    sp = cmd("smoke", "Run the acceptance checks on every node and write report.json / report.html.")
    sp.add_argument("--skip", action="append", default=[], metavar="CHECK",
                    help="check to skip: inventory, bandwidth, fsdp, monitoring or recovery (repeatable)")
    sp.add_argument("--steps", type=int, help="training steps for the FSDP run check")

    sp = cmd("scale-test", "Strong- and weak-scaling runs over 1..N nodes, with plots.")
    sp.add_argument("--steps", type=int, default=20, help="training steps per run (default 20)")

    sp = cmd("monitor", "Per-node GPU, CPU, memory, network, EFA and tokens/s from Prometheus on node 0.")
    sp.add_argument("--once", action="store_true", help="print one view and exit (default: refresh)")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.add_argument("--interval", type=float, default=5.0, help="seconds between refreshes (default 5)")

    sp = cmd("status", "Show the cluster's target, nodes, health, expiry and last results.")
    sp.add_argument("--json", action="store_true", help="machine-readable output")

    sp = cmd("list", "List every cluster: target, nodes, age, expiry and cost per hour.", cluster=False)
    sp.add_argument("--json", action="store_true", help="machine-readable output")

    sp = cmd("down", "Tear the cluster down and sweep for leftovers; its reports are kept.")
    sp.add_argument("--force", action="store_true", help="aws: also delete leftovers the sweep finds")
    yes_argument(sp, "destroy the cluster")

    sp = cmd("exclude", "Record a bad node in the cluster's blacklist (left out of every later stage).")
    sp.add_argument("rank", type=int, metavar="RANK", help="the node's rank")
    sp.add_argument("--reason", required=True, help="why, e.g. 'ECC errors' (kept in the state)")

    sp = cmd("replace", "Replace a node with a new one of the same rank, then configure and deploy to it.")
    sp.add_argument("rank", type=int, metavar="RANK", help="the node's rank")
    yes_argument(sp, "destroy the old node")

    sp = cmd("heal", "Replace each node a spot notice drained, once its jobs have checkpointed and left "
             "(docs/slurm.md).")
    sp.add_argument("--watch", type=float, metavar="SECONDS",
                    help="keep going: a pass every SECONDS (at least 10; needs --yes)")
    yes_argument(sp, "destroy the drained nodes")

    sp = cmd("extend", "Move an aws cluster's expiry N hours later (the AWS-side schedules move with it).")
    sp.add_argument("--hours", type=int, required=True, metavar="N", help="hours to add to the expiry")
    yes_argument(sp, "keep the cluster billing longer")
    sp = cmd("train", "Submit a training run to the cluster's Slurm as a requeueable batch job "
             "(docs/slurm.md).")
    sp.add_argument("config", metavar="CONFIG", nargs="?", help="trainer config: a shipped name (tiny, "
                    "smoke, gpt-1b, ...) or a YAML file (copied next to the job)")
    sp.add_argument("--command", metavar="CMD", dest="user_command",
                    help="run your own program instead of the trainer: a command line every node runs "
                    "(with MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK, NPROC_PER_NODE, CHECKPOINT_DIR and "
                    "JOB_DIR set), or a local script, copied next to the job (.py: run under torchrun)")
    sp.add_argument("--nodes", type=int, metavar="N", help="nodes to train on (default: every usable node)")
    sp.add_argument("--steps", type=int, metavar="S", help="optimizer steps (default: the config's)")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                    help="trainer config override, e.g. optim.lr=1e-3 (repeatable)")
    sp.add_argument("--name", help="job name, also its directory on the shared file system "
                    "(default: CONFIG-<UTC time>, or the script's name or `command`)")
    sp.add_argument("--checkpoint-interval", type=int, metavar="STEPS",
                    help="steps between checkpoints (default: the config's checkpoint.interval)")

    sp = cmd("jobs", "List the training jobs: Slurm state, nodes, last step, loss, tokens/s.")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.add_argument("--all", action="store_true",
                    help="every Slurm job the cluster runs or ran (plain sbatch too), from the queue and the "
                    "controller's job-completion log: state, nodes, start, end, exit code, runs")

    sp = cmd("logs", "Print a training job's output (Slurm's slurm-JOB.out in the job's directory).")
    sp.add_argument("job", type=int, metavar="JOB", help="the Slurm job id (`fsdpctl jobs`)")
    sp.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")

    sp = cmd("cancel", "Cancel a training job (its workers get SIGTERM and checkpoint first).")
    sp.add_argument("job", type=int, metavar="JOB", help="the Slurm job id (`fsdpctl jobs`)")

    sp = cmd("demo", "The main job on the local target: up -> configure -> deploy -> smoke -> down.",
             cluster=False)
    sp.add_argument("spec", type=Path, nargs="?", default=Path("examples/local.yaml"), metavar="SPEC",
                    help="the cluster spec (default examples/local.yaml)")
    sp.add_argument("--nodes", type=int, default=2, help="number of local nodes (default 2)")
    sp.add_argument("--keep", action="store_true", help="leave the cluster up afterwards")
    sp.add_argument("--smoke-steps", type=int, help="training steps for the smoke test's FSDP run")

    sp = cmd("completion", "Print a shell completion script: fsdpctl completion bash > "
             "/etc/bash_completion.d/fsdpctl", cluster=False)
    sp.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    return p


def cmd_demo(args: argparse.Namespace) -> int:
    from fsdpctl.demo import run_demo

    run_demo(args.spec, nodes=args.nodes, keep=args.keep, smoke_steps=args.smoke_steps)
    return 0


def cmd_completion(args: argparse.Namespace) -> int:
    try:
        import shtab
    except ImportError:
        raise CommandError("shell completion needs the shtab package: pip install shtab") from None
    say(shtab.complete(build_parser(), shell=args.shell).rstrip("\n"))
    return 0


def _cluster_named(args: argparse.Namespace) -> None:
    """`fsdpctl down demo`: the positional NAME is --cluster NAME."""
    name = getattr(args, "cluster_name", None)
    if name is None:
        return
    if args.cluster is not None and args.cluster != name:
        raise UsageError(f"NAME {name!r} and --cluster {args.cluster!r} name different clusters; give one of "
                         f"them, e.g. `fsdpctl {args.command} {name}`")
    args.cluster = name


def main(argv: list[str] | None = None) -> int:
    """Every failure a user can cause ends here as one `fsdpctl COMMAND: ...` line on stderr and its
    exit status (fsdpctl/errors.py): a CommandError, a bad spec, an optional package not installed."""
    args = build_parser().parse_args(argv)
    try:
        _cluster_named(args)
        module_name, func_name = HANDLERS[args.command].split(":")
        handler = getattr(importlib.import_module(module_name), func_name)
        code = int(handler(args) or 0)
        sys.stdout.flush()
        return code
    except SpecError as e:
        error(f"fsdpctl {args.command}: {e}")
        return EXIT_USAGE
    except CommandError as e:
        error(f"fsdpctl {args.command}: {e}")
        return e.exit_code
    except ModuleNotFoundError as e:  # an extra not installed (`pip install -e .` alone), anywhere below
        missing = missing_package(e)
        if missing is None:
            raise
        error(f"fsdpctl {args.command}: {missing}")
        return missing.exit_code
    except KeyboardInterrupt:
        error(f"fsdpctl {args.command}: interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader of stdout went away (`| head`): stop quietly, and keep the interpreter's final
        # flush from failing on the same pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
