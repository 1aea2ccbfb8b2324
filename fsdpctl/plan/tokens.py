"""`fsdpctl plan SPEC --tokens N`: how long training on N tokens takes and what it costs, on the
planned cluster and on the cheapest cluster that fits.

Time is N x the config's training FLOPs per token (TrainConfig.flops_per_token: 6 x the active
non-embedding parameters, 4 x those LoRA freezes, plus attention, as the trainer's MFU metric counts
them) over the cluster's
GPUs x their dense bf16 peak (infra/data/instance_types.yaml) x the MFU; dollars are that time at the
cluster's hourly cost from the price table (`cost.py`, the whole graph as `fsdpctl plan` prices it).

The cheapest option: for each instance type the region offers, the smallest cluster of 1 to
MAX_NODES nodes on which the trainer accepts the config (the global batch splits) and the estimator
says it fits, priced like the spec with that type and node count. At a fixed MFU the GPU-hours for N
tokens are the same at every node count, so a larger cluster of the same type costs the same for its
GPUs and only finishes sooner (in practice at a lower MFU, as communication grows); the types are
compared at their smallest fitting size.
"""

from __future__ import annotations

import bisect
import math
import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fsdpctl.errors import UsageError
from fsdpctl.plan.cost import CostEstimate, PriceTable, amount_text, estimate_cost
from fsdpctl.plan.fit import ESTIMATOR_GPUS, load_trainer_config, trainer_missing
from fsdpctl.plan.render import WIDTH
from infra.catalog import CATALOG, InstanceType, offerings
from infra.spec import ClusterSpec, parse_spec

if TYPE_CHECKING:  # the trainer is an optional extra (plan_tokens says when it is missing)
    from trainer.config import TrainConfig

MAX_NODES = 64
"""The largest cluster the cheapest-option search considers (a quarter of a spec's 256-node limit)."""


@dataclass(frozen=True)
class MeasuredMfu:
    """An MFU the GPU check measured (docs/gpu-check.md, "Results")."""

    mfu: float
    compiled: bool
    experts: bool
    """Measured on a mixture-of-experts model: the stand-in for configs with model.n_experts."""
    config: str
    gpu: str
    date: str


GPU_CHECK_MFU = (
    MeasuredMfu(0.344, compiled=False, experts=False, config="gpt-1b", gpu="one H200", date="2026-12-04"),
    MeasuredMfu(0.486, compiled=True, experts=False, config="gpt-1b", gpu="one H200", date="2026-12-04"),
    MeasuredMfu(0.131, compiled=False, experts=True, config="gpt-oss-20b cut to 4 blocks", gpu="one H200",
                date="2026-12-05"),
    MeasuredMfu(0.142, compiled=True, experts=True, config="gpt-oss-20b cut to 4 blocks", gpu="one H200",
                date="2026-12-05"))
"""Dense: gpt-1b, seq 2048, 8 x 2048 tokens per step, bf16, eager and with parallel.compile (the first row
of docs/gpu-check.md's results). Mixture of experts: the gpt_oss_layers step, gpt-oss-20b's widths cut to
4 blocks, random weights, 4 x 2048 tokens, activation checkpointing (the 2026-12-05 results).
tests/fsdpctl/test_plan_tokens.py keeps these equal to the document."""


def parse_tokens(text: str) -> int:
    """--tokens as a whole number of tokens: 2000000000, 2_000_000_000 or 2e9."""
    try:
        tokens = int(text)
    except ValueError:
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        tokens = int(number) if math.isfinite(number) and number.is_integer() else 0
    if tokens < 1:
        raise UsageError(f"--tokens {text} is not a positive whole number of tokens; give e.g. 1e9 or "
                         "2000000000")
    return tokens


def parse_mfu(text: str) -> float:
    """--mfu as a fraction in (0, 1]."""
    try:
        mfu = float(text)
    except ValueError:
        mfu = math.nan
    if not 0 < mfu <= 1:  # NaN fails too
        fix = (f"give it as a fraction: {mfu / 100:g} for {mfu:g}%" if 1 < mfu <= 100
               else "give a fraction, e.g. 0.4 for 40%")
        raise UsageError(f"--mfu {text} is not a model FLOPs utilisation between 0 and 1; {fix}")
    return mfu


@dataclass(frozen=True)
class TrainingRun:
    """N tokens on one cluster: its size, how the config fits, the time at the MFU and its price."""

    instance_type: str
    nodes: int
    world_size: int
    gpu: str
    per_rank_gib: float
    usable_gib: float
    peak_flops_per_gpu: float
    hours: float
    currency: str
    per_hour: float | None
    """The whole cluster's hourly cost (CostEstimate.per_hour): None where a price is not fixed."""
    max_per_hour: float | None
    """The most it can cost per hour (a spot cap), or None where even that is unknown."""
    dollars: float | None
    max_dollars: float | None
    price: str
    """The cost of `hours`: "about X USD", "at most X USD" or "an unknown amount"."""
    cost_per_hour: str
    """CostEstimate.headline(): the hourly cost, and why it is a cap or unknown."""


@dataclass(frozen=True)
class NoFit:
    """An instance type with no cluster of 1 to MAX_NODES nodes that runs the config, and why."""

    instance_type: str
    reason: str


@dataclass(frozen=True)
class TokensPlan:
    config: str
    tokens: int
    seq_len: int
    flops_per_token: int
    mfu: float
    mfu_source: str
    region: str
    capacity: str
    expiry_hours: int | None
    on_spec: TrainingRun | None
    """On the spec's cluster; None when the config does not run or fit there (`on_spec_problem`)."""
    on_spec_problem: str | None
    smallest_per_type: list[TrainingRun]
    no_fit: list[NoFit]
    cheapest: TrainingRun | None
    """Of `smallest_per_type`, the lowest cost (a cap counts as its bound; ties: fewer nodes); None
    when none has a price."""


@dataclass(frozen=True)
class TokensNotPlanned:
    tokens: int
    skipped: str


def choose_mfu(config: str, compiled: bool, experts: bool, override: float | None) -> tuple[float, str]:
    """The MFU and where it comes from: --mfu, else the GPU check's measurement for the config's
    compile setting on a model with experts or without, said to be a stand-in wherever it was not
    measured."""
    if override is not None:
        return override, "given with --mfu"
    measured = next(m for m in GPU_CHECK_MFU if m.compiled == compiled and m.experts == experts)
    mode = "with parallel.compile" if compiled else "eager"
    model = "" if config == measured.config else ", a different model,"
    return measured.mfu, (f"measured by the GPU check on {measured.date}, docs/gpu-check.md: "
                          f"{measured.config} in bf16, {mode}, on {measured.gpu}; a stand-in for "
                          f"{config}{model} on whole nodes, likely high where communication grows; --mfu "
                          "sets your own")


class _Sizes:
    """The trainer config's layout check and per-rank bytes by cluster size, kept across instance
    types (the GPU changes what fits, not what a rank holds)."""

    def __init__(self, config: str, smoke_test_batch: bool):
        self.config, self.smoke_test_batch = config, smoke_test_batch
        self._problems: dict[tuple[int, int], str | None] = {}
        self._totals: dict[tuple[int, int], int] = {}

    def load(self, world_size: int) -> TrainConfig:
        return load_trainer_config(self.config, world_size, smoke_test_batch=self.smoke_test_batch)

    def problem(self, world_size: int, ranks_per_node: int) -> str | None:
        """The trainer's refusal of this many ranks (a batch that does not split), or None."""
        from trainer.config import derive_layout
        from trainer.errors import ConfigError

        key = (world_size, ranks_per_node)
        if key not in self._problems:
            try:
                derive_layout(self.load(world_size), world_size, min(ranks_per_node, world_size))
                self._problems[key] = None
            except ConfigError as e:
                self._problems[key] = str(e.problems[0])
        return self._problems[key]

    def total(self, world_size: int, ranks_per_node: int) -> int:
        from trainer.estimate import estimate

        key = (world_size, ranks_per_node)
        if key not in self._totals:
            self._totals[key] = estimate(self.load(world_size), world_size,
                                         ranks_per_node=ranks_per_node).total
        return self._totals[key]


def _usable_bytes(gpu: str) -> int:
    """What the estimator compares a rank's bytes with (trainer/estimate.py; imported here because the
    trainer is an optional extra of fsdpctl)."""
    from trainer.estimate import usable_bytes

    return usable_bytes(gpu)


def _gib(value: int) -> float:
    from trainer.estimate import GIB

    return round(value / GIB, 1)


def _run(sizes: _Sizes, instance: InstanceType, nodes: int, ranks_per_node: int, cost: CostEstimate,
         work: float, mfu: float) -> TrainingRun:
    """`work` FLOPs on `nodes` x `instance` at `mfu`, priced by `cost` (that cluster's estimate)."""
    gpu = ESTIMATOR_GPUS[instance.gpu_model]
    world_size = nodes * ranks_per_node
    peak = instance.peak_bf16_tflops_per_gpu * 1e12
    hours = work / (world_size * peak * mfu) / 3600
    per_hour, max_per_hour = cost.per_hour, cost.max_per_hour
    return TrainingRun(
        instance_type=instance.name, nodes=nodes, world_size=world_size, gpu=gpu,
        per_rank_gib=_gib(sizes.total(world_size, ranks_per_node)), usable_gib=_gib(_usable_bytes(gpu)),
        peak_flops_per_gpu=peak, hours=hours, currency=cost.currency, per_hour=per_hour,
        max_per_hour=max_per_hour,
        dollars=None if per_hour is None else per_hour * hours,
        max_dollars=None if max_per_hour is None else max_per_hour * hours,
        price=amount_text(per_hour, max_per_hour, hours, cost.currency), cost_per_hour=cost.headline())


def _smallest_fit(sizes: _Sizes, instance: InstanceType, ranks_per_node: int) -> int | str:
    """The fewest nodes (up to MAX_NODES) the config runs and fits on, or why there are none."""
    gpu = ESTIMATOR_GPUS[instance.gpu_model]
    usable = _usable_bytes(gpu)
    runnable = [n for n in range(1, MAX_NODES + 1)
                if sizes.problem(n * ranks_per_node, ranks_per_node) is None]
    if not runnable:
        return (f"the trainer refuses {sizes.config} on every cluster of 1-{MAX_NODES} nodes: "
                f"{sizes.problem(ranks_per_node, ranks_per_node)}")
    # A rank's bytes never grow with more ranks (smaller shards, an equal or smaller micro-batch).
    first = bisect.bisect_left(runnable, True,
                               key=lambda n: sizes.total(n * ranks_per_node, ranks_per_node) <= usable)
    if first < len(runnable):
        return runnable[first]
    largest = runnable[-1]
    needs = _gib(sizes.total(largest * ranks_per_node, ranks_per_node))
    reason = (f"does not fit on up to {nodes_text(largest)} ({needs} GiB per {gpu} of {_gib(usable)} usable "
              "there)")
    if largest < MAX_NODES:
        reason += f"; the global batch splits over no larger cluster of up to {MAX_NODES} nodes"
    return reason


def _priced(spec: ClusterSpec, instance_type: str, nodes: int, prices: PriceTable) -> CostEstimate:
    """The hourly cost of the spec with another instance type and node count: the Pulumi program run
    offline and priced as `fsdpctl plan` prices the spec."""
    from infra.offline import run_offline
    from infra.program import expiry_time

    candidate = parse_spec({**spec.model_dump(mode="json"), "instance_type": instance_type,
                            "node_count": nodes}, source=f"the spec with {nodes} x {instance_type}")
    return estimate_cost(run_offline(candidate, expiry_time(candidate)), prices)


def plan_tokens(spec: ClusterSpec, spec_cost: CostEstimate, prices: PriceTable, config: str, *,
                smoke_test_batch: bool, tokens: int, mfu_override: float | None
                ) -> TokensPlan | TokensNotPlanned:
    """Hours and dollars for `tokens` tokens of `config` on the spec's cluster (priced by
    `spec_cost`) and on the smallest fitting cluster of each instance type, and the cheapest."""
    try:
        from trainer.errors import ConfigError
    except ImportError as e:
        return TokensNotPlanned(tokens, trainer_missing(e))
    sizes = _Sizes(config, smoke_test_batch)
    ranks_per_node = spec.trainer.nproc_per_node or spec.instance.gpus
    world_size = spec.node_count * ranks_per_node
    try:
        cfg = sizes.load(world_size)
    except ConfigError as e:
        return TokensNotPlanned(tokens, f"trainer config {config!r}: {e.problems[0]}")
    if cfg.parallel.param_dtype == "fp32":
        return TokensNotPlanned(tokens, f"trainer config {config} computes in fp32 (parallel.param_dtype), "
                                        "far below the dense bf16 peak the time is figured from; name a bf16 "
                                        "config with --trainer-config (the presets are bf16)")
    mfu, mfu_source = choose_mfu(config, cfg.parallel.compile, cfg.model.n_experts > 0, mfu_override)
    flops_per_token = cfg.flops_per_token()
    work = float(tokens) * flops_per_token

    on_spec, on_spec_problem = None, sizes.problem(world_size, ranks_per_node)
    if on_spec_problem is not None:
        on_spec_problem = f"the trainer refuses it on {world_size} ranks: {on_spec_problem}"
    elif sizes.total(world_size, ranks_per_node) > _usable_bytes(ESTIMATOR_GPUS[spec.instance.gpu_model]):
        on_spec_problem = "it does not fit (the memory fit above)"
    else:
        on_spec = _run(sizes, spec.instance, spec.node_count, ranks_per_node, spec_cost, work, mfu)

    table = offerings()
    smallest, no_fit = [], []
    for instance in CATALOG.values():
        if not table.offered(instance.name, spec.region):
            no_fit.append(NoFit(instance.name, f"not offered in {spec.region} (offerings table of "
                                               f"{table.as_of})"))
            continue
        per_node = spec.trainer.nproc_per_node or instance.gpus
        nodes = _smallest_fit(sizes, instance, per_node)
        if isinstance(nodes, str):
            no_fit.append(NoFit(instance.name, nodes))
            continue
        same = (instance.name, nodes) == (spec.instance_type, spec.node_count)
        cost = spec_cost if same else _priced(spec, instance.name, nodes, prices)
        smallest.append(_run(sizes, instance, nodes, per_node, cost, work, mfu))
    bounded = [run for run in smallest if run.max_dollars is not None]
    cheapest = min(bounded, key=lambda run: (round(run.max_dollars, 2), run.nodes), default=None)
    return TokensPlan(config=config, tokens=tokens, seq_len=cfg.data.seq_len, flops_per_token=flops_per_token,
                      mfu=mfu, mfu_source=mfu_source,
                      region=spec.region, capacity=spec.capacity.type.value, expiry_hours=spec.expiry_hours,
                      on_spec=on_spec, on_spec_problem=on_spec_problem, smallest_per_type=smallest,
                      no_fit=no_fit, cheapest=cheapest)


def nodes_text(nodes: int) -> str:
    return f"{nodes} node" if nodes == 1 else f"{nodes} nodes"


def duration_text(hours: float) -> str:
    if hours < 1:
        return f"{hours * 60:.0f} minutes"
    if hours < 48:
        return f"{hours:.1f} hours"
    return f"{hours:,.0f} hours ({hours / 24:,.1f} days)"


def render_tokens(plan: TokensPlan | TokensNotPlanned) -> str:
    def wrapped(text: str, indent: int = 0) -> list[str]:
        return textwrap.wrap(text, WIDTH, initial_indent=" " * indent, subsequent_indent=" " * (indent + 2),
                             break_on_hyphens=False, break_long_words=False)

    if isinstance(plan, TokensNotPlanned):
        return "\n".join(wrapped(f"Training on {plan.tokens:,} tokens: not computed: {plan.skipped}"))
    out = wrapped(f"Training on {plan.tokens:,} tokens (--tokens) with trainer config {plan.config}: "
                  f"{plan.flops_per_token / 1e9:,.4g} GFLOP per token (6 per active non-embedding parameter, "
                  f"4 per one LoRA freezes, plus attention at seq_len {plan.seq_len}), at "
                  f"{plan.mfu:.1%} MFU of the GPUs' dense bf16 peak ({plan.mfu_source}).")
    if plan.on_spec is None:
        out += wrapped(f"On this cluster: {plan.on_spec_problem}", 2)
    else:
        run = plan.on_spec
        line = (f"On this cluster, {run.nodes} x {run.instance_type} ({run.world_size} x {run.gpu}): "
                f"{duration_text(run.hours)}, {run.price}; the "
                f"cluster costs {run.cost_per_hour}")
        if plan.expiry_hours is not None and run.hours > plan.expiry_hours:
            line += (f"; longer than its expiry_hours {plan.expiry_hours}: the expiry stops it first "
                     "(raise expiry_hours, or `fsdpctl extend --hours N`)")
        out += wrapped(line, 2)
    out += wrapped(f"Smallest cluster that fits, per instance type ({plan.region}, {plan.capacity}, "
                   f"1-{MAX_NODES} nodes):", 2)
    for run in plan.smallest_per_type:
        out += wrapped(f"{run.instance_type:<14} {nodes_text(run.nodes):>8}, {run.world_size:>3} x "
                       f"{run.gpu:<9} "
                       f"{run.per_rank_gib:6.1f} of {run.usable_gib:5.1f} GiB "
                       f"{duration_text(run.hours):>12}  {run.price}", 4)
    for unfit in plan.no_fit:
        out += wrapped(f"{unfit.instance_type:<14} {unfit.reason}", 4)
    if plan.cheapest is None:
        why = "nothing fits" if not plan.smallest_per_type else "no cluster that fits has a price"
        out += wrapped(f"Cheapest instance type: unknown ({why}).", 2)
    else:
        run = plan.cheapest
        out += wrapped(f"Cheapest instance type: {run.instance_type}, at its smallest cluster that fits, "
                       f"{nodes_text(run.nodes)} ({run.world_size} x {run.gpu}): {duration_text(run.hours)}, "
                       f"{run.price}. At a fixed MFU more nodes of a type use the same GPU-hours and "
                       "finish sooner for about the same cost (the NAT gateway and bastion bill for a "
                       "shorter time); in practice MFU falls as nodes are added.", 2)
    return "\n".join(out)
