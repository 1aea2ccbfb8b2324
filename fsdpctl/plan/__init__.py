"""`fsdpctl plan SPEC.yaml`: what `pulumi up` would create, and what it would cost, offline.

The real Pulumi program runs under Pulumi's mocks (`infra.offline`); `cost` prices the recorded
resources, `render` prints them grouped by component, `fit` checks a trainer config's memory on the
cluster, and `tokens` (--tokens) turns it into the hours and dollars of training on N tokens.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from fsdpctl.console import error, say
from fsdpctl.errors import CommandError, UsageError
from fsdpctl.plan.cost import CostEstimate, CostLine, PriceTable, estimate_cost, load_prices
from fsdpctl.plan.fit import memory_fit, misfit, render_fit
from fsdpctl.plan.render import describe, render_json, render_summary, render_text
from fsdpctl.plan.tokens import parse_mfu, parse_tokens, plan_tokens, render_tokens
from infra.spec import load_spec

__all__ = ["CostEstimate", "CostLine", "PriceTable", "cmd_plan", "describe", "estimate_cost", "load_prices",
           "render_json", "render_summary", "render_text"]


def _require_pulumi() -> None:
    try:
        import pulumi  # noqa: F401
        import pulumi_aws  # noqa: F401
    except ImportError as e:
        raise UsageError(
            f"fsdpctl plan runs the Pulumi program offline and needs the Python packages pulumi and "
            f"pulumi-aws ({e}). Install them with: pip install -e '.[aws]' (or `make plan`)."
        ) from None


def cmd_plan(args: Any) -> int:
    # Validation first: a bad spec raises SpecError (exit 2, every problem listed) before the
    # program registers anything.
    tokens = None if args.tokens is None else parse_tokens(args.tokens)
    if args.mfu is not None and tokens is None:
        raise UsageError(f"--mfu {args.mfu} applies only to --tokens; add --tokens N (e.g. 1e9) or drop "
                         "--mfu")
    mfu = None if args.mfu is None else parse_mfu(args.mfu)
    spec = load_spec(args.spec)
    prices = load_prices(args.prices)
    _require_pulumi()
    from infra.offline import run_offline
    from infra.program import expiry_time

    if not args.json:
        error(f"Running the Pulumi program for {args.spec} offline (Pulumi mocks; no AWS calls)...")
    plan = run_offline(spec, expiry_time(spec))
    cost = estimate_cost(plan, prices)
    # The spec's trainer config runs only in the smoke test and scale-test, which set its batch from
    # the world size; a config named here is checked as it is, as `fsdpctl train` would run it.
    config = args.trainer_config or spec.trainer.config
    fit = memory_fit(spec, config, smoke_test_batch=not args.trainer_config)
    if args.trainer_config and "skipped" in fit and "trainer is not installed" not in fit["skipped"]:
        raise UsageError(f"--trainer-config {args.trainer_config}: {fit['skipped']}")
    training = None if tokens is None else plan_tokens(spec, cost, prices, config,
                                                        smoke_test_batch=not args.trainer_config,
                                                        tokens=tokens, mfu_override=mfu)
    if args.json:
        extra = {} if training is None else {"training": dataclasses.asdict(training)}
        say(json.dumps({**json.loads(render_json(plan, cost)), "memory_fit": fit, **extra}, indent=2))
    else:
        say("\n".join([render_text(plan, cost), render_fit(fit),
                       *([] if training is None else [render_tokens(training)])]))
    unfit = misfit(fit)
    if unfit:  # the plan is printed in full; the run it is for would not start
        raise CommandError(unfit)
    return 0
