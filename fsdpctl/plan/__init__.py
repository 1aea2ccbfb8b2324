"""`fsdpctl plan SPEC.yaml`: what `pulumi up` would create, and what it would cost, offline.

The real Pulumi program runs under Pulumi's mocks (`infra.offline`); `cost` prices the recorded
resources, `render` prints them grouped by component, `fit` checks a trainer config's memory on the
cluster, and `tokens` (--tokens) turns it into the hours and dollars of training on N tokens.
"""

from __future__ import annotations

import dataclasses
import json
from argparse import Namespace
from pathlib import Path
from typing import TYPE_CHECKING

from fsdpctl.console import Out, error, say
from fsdpctl.errors import CommandError, UsageError
from fsdpctl.plan.cost import CostEstimate, CostLine, ElasticCost, PriceTable, estimate_cost, load_prices
from fsdpctl.plan.fit import MemoryFit, memory_fit, misfit, render_fit
from fsdpctl.plan.render import describe, render_json, render_summary, render_text
from fsdpctl.plan.tokens import (
    TokensNotPlanned,
    TokensPlan,
    parse_mfu,
    parse_tokens,
    plan_tokens,
    render_tokens,
)
from infra.spec import load_spec

if TYPE_CHECKING:  # pulumi is an optional extra (_require_pulumi says so)
    from infra.offline import OfflinePlan

__all__ = [
    "ClusterPlan",
    "CostEstimate",
    "CostLine",
    "ElasticCost",
    "PriceTable",
    "cmd_plan",
    "describe",
    "estimate_cost",
    "load_prices",
    "plan",
    "render_json",
    "render_summary",
    "render_text",
]


def _require_pulumi() -> None:
    try:
        import pulumi  # noqa: F401
        import pulumi_aws  # noqa: F401
    except ImportError as e:
        raise UsageError(
            f"fsdpctl plan runs the Pulumi program offline and needs the Python packages pulumi and "
            f"pulumi-aws ({e}). Install them with: pip install -e '.[aws]' (or `make plan`)."
        ) from None


@dataclasses.dataclass(frozen=True)
class ClusterPlan:
    """What `fsdpctl plan` shows: the resources `pulumi up` would create, their cost, the trainer
    config's memory fit and, when tokens were given, the hours and dollars of training on them."""

    resources: OfflinePlan
    cost: CostEstimate
    memory_fit: MemoryFit
    training: TokensPlan | TokensNotPlanned | None

    @property
    def misfit(self) -> str | None:
        """Why the trainer config does not fit the planned GPUs; None when it fits or was not computed."""
        return misfit(self.memory_fit)


def plan(spec_file: Path, *, prices: Path | None = None, trainer_config: str | None = None,
         tokens: str | int | None = None, mfu: str | float | None = None,
         progress: Out | None = None) -> ClusterPlan:
    """Run the Pulumi program for `spec_file` offline (Pulumi's mocks; no AWS call, no pulumi CLI)
    and price it with the built-in price table, or `prices` (a YAML table merged over it). The
    memory fit is `trainer_config`'s as it is, or the spec's trainer.config with the smoke test's
    batch; `tokens` (e.g. "1e9") adds the time and cost of training on that many, at `mfu` (0-1; by
    default the GPU check's measurement). A bad spec or argument raises before the program runs, and
    `progress` hears when it starts."""
    parsed_tokens = None if tokens is None else parse_tokens(str(tokens))
    if mfu is not None and parsed_tokens is None:
        raise UsageError(f"--mfu {mfu} applies only to --tokens; add --tokens N (e.g. 1e9) or drop --mfu")
    parsed_mfu = None if mfu is None else parse_mfu(str(mfu))
    spec = load_spec(spec_file)
    price_table = load_prices(prices)
    _require_pulumi()
    from infra.offline import run_offline
    from infra.program import expiry_time

    if progress is not None:
        progress(f"Running the Pulumi program for {spec_file} offline (Pulumi mocks; no AWS calls)...")
    resources = run_offline(spec, expiry_time(spec))
    cost = estimate_cost(resources, price_table)
    # The spec's trainer config runs only in the smoke test and scale-test, which set its batch from
    # the world size; a config named here is checked as it is, as `fsdpctl train` would run it.
    config = trainer_config or spec.trainer.config
    fit = memory_fit(spec, config, smoke_test_batch=not trainer_config)
    if trainer_config and fit.skipped is not None and "trainer is not installed" not in fit.skipped:
        raise UsageError(f"--trainer-config {trainer_config}: {fit.skipped}")
    training = None if parsed_tokens is None else plan_tokens(
        spec, cost, price_table, config, smoke_test_batch=not trainer_config, tokens=parsed_tokens,
        mfu_override=parsed_mfu)
    return ClusterPlan(resources, cost, fit, training)


def cmd_plan(args: Namespace) -> int:
    result = plan(args.spec, prices=args.prices, trainer_config=args.trainer_config, tokens=args.tokens,
                  mfu=args.mfu, progress=None if args.json else error)
    if args.json:
        extra = {} if result.training is None else {"training": dataclasses.asdict(result.training)}
        say(json.dumps({**json.loads(render_json(result.resources, result.cost)),
                        "memory_fit": result.memory_fit.as_json(), **extra}, indent=2))
    else:
        say("\n".join([render_text(result.resources, result.cost), render_fit(result.memory_fit),
                       *([] if result.training is None else [render_tokens(result.training)])]))
    if result.misfit:  # the plan is printed in full; the run it is for would not start
        raise CommandError(result.misfit)
    return 0
