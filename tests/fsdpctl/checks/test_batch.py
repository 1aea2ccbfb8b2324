"""The batch of the smoke test's and scale-test's runs: the trainer's own layout check accepts it on
every instance type and node count a spec allows (1 to 256), and on the local target's 1 to 8 ranks
per node."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdpctl.checks.batch import SMOKE_ACCUMULATION, SMOKE_MICRO_BATCH, assignments, batch_settings
from fsdpctl.checks.context import CheckContext
from fsdpctl.checks.scaling import (
    MICRO_BATCH,
    STRONG_MICRO_BATCH_MAX,
    node_counts,
    strong_global_batch,
    strong_settings,
    weak_settings,
)
from fsdpctl.checks.training import trainer_args
from fsdpctl.state import ClusterRecord, ClusterState
from infra.catalog import CATALOG
from infra.spec import ClusterSpec
from tests.infra.conftest import demo_data
from trainer.config import ConfigError, derive_layout, load_config

NODE_COUNTS = range(1, 257)  # the spec's node_count limit
LOCAL_RANKS_PER_NODE = range(1, 9)  # the spec's local.nproc_per_node limit
LOCAL_NODE_COUNTS = range(1, 33)  # containers on one host; 2 in the demo


def _contexts(spec: ClusterSpec, target: str, sizes: range = NODE_COUNTS) -> list[CheckContext]:
    """A check context per node count, as `check_context` makes one from the cluster's inventory."""
    # The record's target is what the ranks per node depend on; nothing here reads the state's files.
    record = ClusterRecord(name=spec.name, target=target, created_at=0.0)
    return [CheckContext(state=ClusterState(name=spec.name, root=Path("/unused")), record=record, spec=spec,
                         ranks=list(range(nodes)), run_dir=Path("/unused"),
                         work_dir="/shared/smoke", shared=True, steps=20) for nodes in sizes]


def _smoke_config(ctx: CheckContext):
    """The config the trainer builds from the fsdp check's command line (its parser and flags)."""
    from trainer.__main__ import FLAG_KEYS, build_parser

    args = trainer_args(ctx, steps=ctx.steps, checkpoint_dir=f"{ctx.work_dir}/ckpt", interval=10,
                        metrics=f"{ctx.work_dir}/metrics.jsonl", resume="none")
    assert args[:2] == ["-m", "trainer"]
    parsed = build_parser().parse_args(args[2:])
    flags = {key: getattr(parsed, flag) for flag, key in FLAG_KEYS.items()
             if getattr(parsed, flag) is not None}
    return load_config(parsed.config, parsed.overrides, flags)


def test_the_smoke_config_alone_does_not_split_over_two_8_gpu_nodes():
    """The defect: 16 sequences / 2 accumulation steps / 16 ranks."""
    with pytest.raises(ConfigError, match="make it a multiple of 32"):
        derive_layout(load_config("smoke"), 16, 8)


def test_the_smoke_batch_is_the_smoke_configs_on_the_cluster_it_was_sized_for():
    """2 nodes x 1 rank (the local demo) runs exactly the config's batch; larger clusters give every
    rank the same work."""
    cfg = load_config("smoke")
    assert derive_layout(cfg, 2, 1).micro_batch_size == SMOKE_MICRO_BATCH
    assert cfg.training.gradient_accumulation == SMOKE_ACCUMULATION >= 2  # so grad_sync is measured
    assert batch_settings(2)["training.global_batch_size"] == cfg.training.global_batch_size


@pytest.mark.parametrize("instance_type", sorted(CATALOG))
def test_the_smoke_job_trains_on_every_node_count_of_every_instance_type(instance_type):
    spec = ClusterSpec.model_validate(demo_data(instance_type=instance_type))
    for ctx in _contexts(spec, "aws"):
        assert ctx.world_size == len(ctx.ranks) * CATALOG[instance_type].gpus
        cfg = _smoke_config(ctx)
        layout = derive_layout(cfg, ctx.world_size, ctx.nproc)  # raises what the trainer would
        assert (layout.micro_batch_size, cfg.training.gradient_accumulation) == (SMOKE_MICRO_BATCH,
                                                                                 SMOKE_ACCUMULATION)


@pytest.mark.parametrize("ranks_per_node", LOCAL_RANKS_PER_NODE)
def test_the_smoke_job_trains_on_every_local_cluster(ranks_per_node):
    spec = ClusterSpec.model_validate(demo_data(local={"nproc_per_node": ranks_per_node}))
    for ctx in _contexts(spec, "local", LOCAL_NODE_COUNTS):
        assert ctx.nproc == ranks_per_node
        layout = derive_layout(_smoke_config(ctx), ctx.world_size, ctx.nproc)
        assert layout.micro_batch_size == SMOKE_MICRO_BATCH


def test_the_trainer_derives_the_micro_batch_whatever_the_config_or_a_later_override_says():
    """A config may fix training.micro_batch_size, and callers (the monitoring tests) append their own
    `--set training.global_batch_size`: the smoke settings empty the micro-batch, so it follows."""
    cfg = load_config("smoke", ["training.micro_batch_size=3", *assignments(batch_settings(2))])
    assert derive_layout(cfg, 2, 1).micro_batch_size == SMOKE_MICRO_BATCH
    cfg = load_config("smoke", [*assignments(batch_settings(2)), "training.global_batch_size=64"])
    assert derive_layout(cfg, 2, 1).micro_batch_size == 16


@pytest.mark.parametrize("ranks_per_node", sorted({t.gpus for t in CATALOG.values()} | {1, 2}))
def test_scale_test_batches_split_on_every_world_size_of_every_sweep(ranks_per_node):
    """Strong scaling keeps one global batch over the sweep, in micro-batches of at most
    STRONG_MICRO_BATCH_MAX; weak scaling keeps MICRO_BATCH per rank. Both pass the trainer's check."""
    base = load_config("smoke")

    def layout(settings: dict[str, int | None], world_size: int):
        training = base.training.model_copy(update={key.removeprefix("training."): value
                                                    for key, value in settings.items()})
        return derive_layout(base.model_copy(update={"training": training}), world_size, ranks_per_node)

    for n in NODE_COUNTS:
        counts = node_counts(n)
        global_batch = strong_global_batch(counts, ranks_per_node)
        for k in counts:
            world = k * ranks_per_node
            strong = strong_settings(global_batch, world)
            assert strong["training.global_batch_size"] == global_batch, (n, k)
            assert layout(strong, world).micro_batch_size <= STRONG_MICRO_BATCH_MAX
            assert layout(weak_settings(world), world).micro_batch_size == MICRO_BATCH


def test_strong_scaling_accumulates_a_large_share_instead_of_one_huge_micro_batch():
    """255 nodes of 8 GPUs: the LCM is 261,120 sequences, 32,640 per rank on one node."""
    global_batch = strong_global_batch(node_counts(255), 8)
    assert global_batch == 261_120
    one_node = strong_settings(global_batch, 8)
    assert one_node["training.gradient_accumulation"] == 64  # 510 sequences per micro-batch
    assert strong_settings(global_batch, 2040)["training.gradient_accumulation"] == 1  # 128 per rank
