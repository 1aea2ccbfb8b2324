"""`fsdpctl plan SPEC --tokens N`: hours and dollars for training on N tokens, on the planned cluster
and on the cheapest instance type that fits, against figures computed here by hand."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from fsdpctl.cli import main
from fsdpctl.plan import tokens as tokens_module
from fsdpctl.plan.fit import ESTIMATOR_GPUS
from fsdpctl.plan.tokens import GPU_CHECK_MFU
from infra import offline
from infra.catalog import CATALOG
from tests.infra.conftest import REPO, demo_data

# A 2-block model of the project's GPT shape in bf16, whose 32 sequences per micro-step split over
# 8, 16 and 32 ranks.
SMALL = {"model": {"vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4, "ffn_dim": 176,
                   "max_seq_len": 64},
         "parallel": {"strategy": "FULL_SHARD", "param_dtype": "bf16"},
         "training": {"global_batch_size": 64, "gradient_accumulation": 2}, "data": {"seq_len": 64}}
# Training FLOPs per token (PaLM appendix B): 6 x the non-embedding parameters (per block: q/k/v
# 64 x 192, output 64 x 64, two norms of 64, SwiGLU 3 x 64 x 176; the final norm; the 64 x 256 output
# projection) plus 6 x layers x heads x (2 x head size 16) x seq_len for the attention products.
SMALL_FLOPS_PER_TOKEN = (6 * (2 * (64 * 192 + 64 * 64 + 2 * 64 + 3 * 64 * 176) + 64 + 64 * 256)
                         + 6 * 2 * 4 * 32 * 64)
# Every cluster's fixed hourly cost under PRICES: NAT gateway 1.0, two public IPv4 addresses (NAT,
# bastion) at 0.25, the t3.micro bastion 0.5; EBS free.
FIXED_PER_HOUR = 1.0 + 2 * 0.25 + 0.5
A100, H100 = 312e12, 989e12  # dense bf16 FLOP/s per GPU (NVIDIA data sheets)


def write(tmp_path, name: str, data: dict) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def prices(tmp_path, p4d: float = 10.0, p5: float = 40.0) -> str:
    return write(tmp_path, "prices.yaml", {"regions": {"us-east-1": {
        "instance_hour": {"p4d.24xlarge": p4d, "p5.48xlarge": p5, "t3.micro": 0.5},
        "nat_gateway_hour": 1.0, "public_ipv4_hour": 0.25, "ebs_gp3_gib_month": 0.0}}})


@pytest.fixture
def two_types(monkeypatch):
    """A catalog of p4d (8 x A100 40 GB) and p5 (8 x H100 80 GB) only."""
    monkeypatch.setattr(tokens_module, "CATALOG", {t: CATALOG[t] for t in ("p4d.24xlarge", "p5.48xlarge")})


def plan(capsys, *args: str, fits: bool = True) -> tuple[dict, str]:
    """The `training` section of `plan --json` and the text plan's block from "Training on". A config
    that does not fit the planned cluster fails the plan (exit 1), after printing all of it."""
    assert main(["plan", *args, "--json"]) == (0 if fits else 1)
    training = json.loads(capsys.readouterr().out)["training"]
    assert main(["plan", *args]) == (0 if fits else 1)
    text, err = capsys.readouterr()
    assert fits or "does not fit: it needs" in err
    return training, text[text.index("Training on"):]


def flat(text: str) -> str:
    return " ".join(text.split())


def test_hours_and_dollars_on_the_planned_cluster_are_the_hand_computed_ones(tmp_path, capsys, two_types):
    """9e13 tokens on the demo's 4 x p4d (32 A100s) at 50% MFU, at 4 x 10.0 plus the fixed costs."""
    config = write(tmp_path, "small.yaml", SMALL)
    training, text = plan(capsys, write(tmp_path, "spec.yaml", demo_data()), "--trainer-config", config,
                          "--tokens", "9e13", "--mfu", "0.5", "--prices", prices(tmp_path))
    hours = 9e13 * SMALL_FLOPS_PER_TOKEN / (32 * A100 * 0.5) / 3600
    per_hour = 4 * 10.0 + FIXED_PER_HOUR
    assert (training["tokens"], training["flops_per_token"], training["seq_len"]) == (
        90_000_000_000_000, SMALL_FLOPS_PER_TOKEN, 64)
    assert (training["mfu"], training["mfu_source"]) == (0.5, "given with --mfu")
    spec_run = training["on_spec"]
    assert (spec_run["instance_type"], spec_run["nodes"], spec_run["world_size"], spec_run["gpu"]) == (
        "p4d.24xlarge", 4, 32, "a100-40gb")
    assert spec_run["hours"] == pytest.approx(hours, rel=1e-9)
    assert spec_run["per_hour"] == pytest.approx(per_hour)
    assert spec_run["dollars"] == pytest.approx(hours * per_hour, rel=1e-9)
    assert spec_run["max_dollars"] == spec_run["dollars"]
    assert training["on_spec_problem"] is None
    assert f"On this cluster, 4 x p4d.24xlarge (32 x a100-40gb): {hours:.1f} hours, about " \
           f"{hours * per_hour:,.2f} USD" in flat(text)
    assert f"{SMALL_FLOPS_PER_TOKEN / 1e9:.4g} GFLOP per token" in flat(text)
    assert all(len(line) <= 100 for line in text.splitlines())


@pytest.mark.parametrize("p5_price, cheapest", [(40.0, "p4d.24xlarge"), (25.0, "p5.48xlarge")])
def test_the_cheapest_type_is_the_lowest_cost_of_its_smallest_fitting_cluster(tmp_path, capsys, two_types,
                                                                                p5_price, cheapest):
    """The small model fits one node of either type. 9e13 tokens at 50% MFU: 8 A100s at 10.0 + 2.0 per
    hour, or 8 H100s at 40.0 (25.0) + 2.0: the H100s are 3.17x faster, so p5 wins at 25 and not at 40."""
    config = write(tmp_path, "small.yaml", SMALL)
    training, text = plan(capsys, write(tmp_path, "spec.yaml", demo_data()), "--trainer-config", config,
                          "--tokens", "9e13", "--mfu", "0.5", "--prices", prices(tmp_path, p5=p5_price))
    work = 9e13 * SMALL_FLOPS_PER_TOKEN / 0.5 / 3600  # GPU-FLOP-hours at 50% MFU
    expected = {"p4d.24xlarge": (work / (8 * A100), 10.0 + FIXED_PER_HOUR),
                "p5.48xlarge": (work / (8 * H100), p5_price + FIXED_PER_HOUR)}
    runs = {run["instance_type"]: run for run in training["smallest_per_type"]}
    assert set(runs) == set(expected) and training["no_fit"] == []
    for itype, (hours, per_hour) in expected.items():
        assert (runs[itype]["nodes"], runs[itype]["world_size"]) == (1, 8)
        assert runs[itype]["hours"] == pytest.approx(hours, rel=1e-9)
        assert runs[itype]["dollars"] == pytest.approx(hours * per_hour, rel=1e-9)
    assert (training["cheapest"]["instance_type"], training["cheapest"]["nodes"]) == (cheapest, 1)
    hours, per_hour = expected[cheapest]
    assert (f"Cheapest instance type: {cheapest}, at its smallest cluster that fits, 1 node (8 x "
            f"{runs[cheapest]['gpu']}): {hours:.1f} hours, about {hours * per_hour:,.2f} USD.") in flat(text)


def test_a_cheaper_type_the_config_does_not_fit_is_not_chosen(tmp_path, capsys, two_types):
    """A 20B model whose 8 sequences split over 8 ranks only (one node): 44 GiB per GPU fits an H100's
    72 usable, not an A100-40's 36, so the p5 is named although p4d is priced at 1.0 per hour."""
    config = write(tmp_path, "big.yaml", {
        "model": {"vocab_size": 32000, "dim": 6144, "n_layers": 44, "n_heads": 48, "ffn_dim": 16384,
                  "max_seq_len": 2048},
        "parallel": {"strategy": "FULL_SHARD", "param_dtype": "bf16", "activation_checkpointing": True},
        "training": {"global_batch_size": 8, "gradient_accumulation": 1}, "data": {"seq_len": 2048}})
    spec = write(tmp_path, "spec.yaml", demo_data(node_count=1))
    training, text = plan(capsys, spec, "--trainer-config", config, "--tokens", "1e9", "--prices",
                          prices(tmp_path, p4d=1.0), fits=False)
    (unfit,) = training["no_fit"]
    assert unfit["instance_type"] == "p4d.24xlarge"
    assert re.fullmatch(r"does not fit on up to 1 node \([\d.]+ GiB per a100-40gb of 36\.0 usable there\); "
                        r"the global batch splits over no larger cluster of up to 64 nodes", unfit["reason"])
    assert training["on_spec"] is None
    assert training["on_spec_problem"] == "it does not fit (the memory fit above)"
    assert [(r["instance_type"], r["nodes"]) for r in training["smallest_per_type"]] == [("p5.48xlarge", 1)]
    assert training["cheapest"]["instance_type"] == "p5.48xlarge"
    assert "On this cluster: it does not fit" in flat(text)


def test_without_mfu_the_gpu_checks_measurement_is_used_and_named(tmp_path, capsys, two_types):
    config = write(tmp_path, "small.yaml", SMALL)
    compiled = write(tmp_path, "compiled.yaml", {**SMALL, "parallel": {**SMALL["parallel"], "compile": True}})
    spec = write(tmp_path, "spec.yaml", demo_data())
    for path, mfu, mode in ((config, 0.344, "eager"), (compiled, 0.486, "with parallel.compile")):
        training, text = plan(capsys, spec, "--trainer-config", path, "--tokens", "1e9")
        assert training["mfu"] == mfu
        assert (f"measured by the GPU check on 2026-12-04, docs/gpu-check.md: gpt-1b in bf16, {mode}, on one "
                f"H200; a stand-in for {path}, a different model, on whole nodes") in training["mfu_source"]
        assert f"at {mfu:.1%} MFU" in flat(text)
        hours = 1e9 * SMALL_FLOPS_PER_TOKEN / (32 * A100 * mfu) / 3600
        assert training["on_spec"]["hours"] == pytest.approx(hours, rel=1e-9)


def test_a_config_with_experts_is_timed_at_the_gpu_checks_mixture_of_experts_measurement(tmp_path, capsys):
    """A config with model.n_experts gets the MFU measured on gpt-oss's blocks, not the dense gpt-1b's."""
    moe = {**SMALL, "model": {**SMALL["model"], "n_experts": 4, "n_active_experts": 2, "moe_ffn_dim": 32}}
    config = write(tmp_path, "moe.yaml", moe)
    spec = write(tmp_path, "spec.yaml", demo_data())
    training, text = plan(capsys, spec, "--trainer-config", config, "--tokens", "1e9")
    assert training["mfu"] == 0.131
    assert ("measured by the GPU check on 2026-12-05, docs/gpu-check.md: gpt-oss-20b cut to 4 blocks in "
            f"bf16, eager, on one H200; a stand-in for {config}, a different model") in training["mfu_source"]
    assert "at 13.1% MFU" in flat(text)


def test_the_measured_mfu_is_the_gpu_check_documents():
    """GPU_CHECK_MFU is docs/gpu-check.md's results: the first row's bf16 eager and compiled MFU of gpt-1b,
    and the gpt_oss_layers rows of 2026-12-05, eager and compiled."""
    lines = (REPO / "docs" / "gpu-check.md").read_text().splitlines()

    def cells(prefix: str) -> list[str]:
        row = next(line for line in lines if line.startswith(prefix))
        return [cell.strip() for cell in row.strip("|").split("|")]

    def percent(cell: str) -> float:
        return float(re.search(r"([\d.]+)%", cell).group(1)) / 100

    dense = cells("| 2026-12-04 | NVIDIA H200")
    experts = percent(cells("| `gpt_oss_layers` (gpt-oss-20b, 4 blocks")[3])
    experts_compiled = percent(cells("| the same with `GPU_CHECK_SET='parallel.compile=true'`")[3])
    assert {(m.compiled, m.experts, m.mfu, m.date) for m in GPU_CHECK_MFU} == {
        (False, False, percent(dense[3]), dense[0]), (True, False, percent(dense[4]), dense[0]),
        (False, True, experts, "2026-12-05"), (True, True, experts_compiled, "2026-12-05")}
    assert "### 2026-12-05: the Llama-3.2-1B and gpt-oss steps" in lines


@pytest.mark.parametrize("args, message", [
    (["--tokens", "abc"],
     "--tokens abc is not a positive whole number of tokens; give e.g. 1e9 or 2000000000"),
    (["--tokens", "0"], "--tokens 0 is not a positive whole number"),
    (["--tokens", "-5"], "--tokens -5 is not a positive whole number"),
    (["--tokens", "1.5"], "--tokens 1.5 is not a positive whole number"),
    (["--tokens", "inf"], "--tokens inf is not a positive whole number"),
    (["--tokens", "1e9", "--mfu", "48.6"],
     "--mfu 48.6 is not a model FLOPs utilisation between 0 and 1; give it as a fraction: 0.486 for 48.6%"),
    (["--tokens", "1e9", "--mfu", "0"], "--mfu 0 is not a model FLOPs utilisation between 0 and 1; give a "
                                        "fraction, e.g. 0.4 for 40%"),
    (["--tokens", "1e9", "--mfu", "nan"], "--mfu nan is not a model FLOPs utilisation"),
    (["--tokens", "1e9", "--mfu", "half"], "--mfu half is not a model FLOPs utilisation"),
    (["--mfu", "0.4"], "--mfu 0.4 applies only to --tokens; add --tokens N (e.g. 1e9) or drop --mfu"),
])
def test_bad_tokens_and_mfu_are_one_line_errors_before_anything_runs(capsys, monkeypatch, args, message):
    def must_not_run(*_args, **_kwargs):
        raise AssertionError("the program ran for bad arguments")

    monkeypatch.setattr(offline, "run_offline", must_not_run)
    assert main(["plan", str(REPO / "examples" / "demo.yaml"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fsdpctl plan: {message}") and err.count("\n") == 1, err


def test_whole_numbers_of_tokens_in_any_spelling():
    assert {tokens_module.parse_tokens(text) for text in ("2e9", "2000000000", "2_000_000_000", "2.0e9")} == {
        2_000_000_000}


def test_a_spot_cluster_costs_at_most_its_cap(tmp_path, capsys, two_types):
    """Spot has no fixed price: the dollars are a bound, the nodes at capacity.spot_max_price."""
    config = write(tmp_path, "small.yaml", SMALL)
    spec = write(tmp_path, "spec.yaml", demo_data(capacity={"type": "spot", "spot_max_price": 7.0}))
    training, text = plan(capsys, spec, "--trainer-config", config, "--tokens", "9e13", "--mfu", "0.5",
                          "--prices", prices(tmp_path))
    hours = 9e13 * SMALL_FLOPS_PER_TOKEN / (32 * A100 * 0.5) / 3600
    spec_run = training["on_spec"]
    assert spec_run["dollars"] is None and spec_run["per_hour"] is None
    assert spec_run["max_dollars"] == pytest.approx(hours * (4 * 7.0 + FIXED_PER_HOUR), rel=1e-9)
    assert f"at most {spec_run['max_dollars']:,.2f} USD; the cluster costs at most" in flat(text)
    assert training["capacity"] == "spot" and training["cheapest"]["dollars"] is None


def test_a_capacity_block_has_no_price_and_no_cheapest(tmp_path, capsys, two_types):
    config = write(tmp_path, "small.yaml", SMALL)
    spec = write(tmp_path, "spec.yaml", demo_data(
        capacity={"type": "capacity-block", "reservation_id": "cr-0123456789abcdef0"}))
    training, text = plan(capsys, spec, "--trainer-config", config, "--tokens", "1e9")
    assert training["on_spec"]["max_dollars"] is None and training["cheapest"] is None
    assert "an unknown amount; the cluster costs an unknown amount per hour" in flat(text)
    assert "Cheapest instance type: unknown (no cluster that fits has a price)." in flat(text)


def test_a_batch_that_does_not_split_on_the_cluster_and_a_run_past_the_expiry(tmp_path, capsys, two_types):
    # 32 sequences per micro-step do not split over 3 nodes x 8 ranks; they do over 4 (and 1, 2).
    config = write(tmp_path, "small.yaml", SMALL)
    training, text = plan(capsys, write(tmp_path, "spec.yaml", demo_data(node_count=3)), "--trainer-config",
                          config, "--tokens", "1e9")
    assert training["on_spec"] is None
    assert training["on_spec_problem"].startswith("the trainer refuses it on 24 ranks: "
                                                  "training.global_batch_size: does not split evenly")
    assert [r["nodes"] for r in training["smallest_per_type"]] == [1, 1]
    hours = 1e14 * SMALL_FLOPS_PER_TOKEN / (32 * A100 * 0.344) / 3600
    assert hours > 2
    training, text = plan(capsys, write(tmp_path, "spec.yaml", demo_data(expiry_hours=2)), "--trainer-config",
                          config, "--tokens", "1e14")
    assert training["expiry_hours"] == 2 and training["on_spec"]["hours"] == pytest.approx(hours, rel=1e-9)
    assert ("longer than its expiry_hours 2: the expiry stops it first (raise expiry_hours, or `fsdpctl "
            "extend --hours N`)") in flat(text)


def test_a_config_computing_in_fp32_is_not_timed(tmp_path, capsys):
    config = write(tmp_path, "fp32.yaml", {**SMALL, "parallel": {"strategy": "FULL_SHARD"}})
    training, text = plan(capsys, str(REPO / "examples" / "demo.yaml"), "--trainer-config", config,
                          "--tokens", "1e9")
    assert training["skipped"].startswith(f"trainer config {config} computes in fp32")
    assert flat(text).startswith("Training on 1,000,000,000 tokens: not computed: trainer config")


def test_the_estimator_knows_every_gpu_of_the_catalog():
    assert {t.gpu_model for t in CATALOG.values()} <= set(ESTIMATOR_GPUS)


def test_gpt_oss_120b_on_the_whole_catalog(capsys):
    """The docs' worked example: on 4 x p4d it does not fit; p4d fits nowhere (its 64 sequences per
    micro-step split over at most 8 nodes), p5e is not offered in us-east-1, and p5 is the cheapest."""
    training, text = plan(capsys, str(REPO / "examples" / "demo.yaml"), "--trainer-config", "gpt-oss-120b",
                          "--tokens", "1e9", fits=False)
    assert training["on_spec"] is None
    assert {u["instance_type"] for u in training["no_fit"]} == {"p4d.24xlarge", "p5e.48xlarge"}
    assert {r["instance_type"] for r in training["smallest_per_type"]} == {
        "p4de.24xlarge", "p5.48xlarge", "p5en.48xlarge"}
    cheapest = training["cheapest"]
    # The smallest p5 cluster that fits, at the on-demand price of the nodes and the fixed costs.
    assert cheapest["instance_type"] == "p5.48xlarge"
    # At the MFU the GPU check measured on gpt-oss's blocks (eager: the preset does not compile).
    hours = 1e9 * training["flops_per_token"] / (cheapest["world_size"] * H100 * 0.131) / 3600
    assert cheapest["hours"] == pytest.approx(hours, rel=1e-9)
    assert cheapest["per_hour"] > cheapest["nodes"] * 55.04
    assert all(len(line) <= 100 for line in text.splitlines())
