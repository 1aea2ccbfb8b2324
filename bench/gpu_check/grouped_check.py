"""Does grouped GEMM compute what the per-expert loop does? Forward and, on CUDA, backward.

    python bench/gpu_check/grouped_check.py --config model-config.json --device cuda|cpu \
        --output grouped_check.json [--rows N] [--seed S]

trainer/moe.py's StackedExperts runs a block's experts by `torch._grouped_mm` (`grouped`: CUDA in bf16, what
training on a GPU takes) or by one matmul per expert (`looped`: anywhere else). The CPU tests compare the two
forwards on CPU only, and CPU torch has no grouped backward; this compares them where training runs them.
For the widths of a config.json (hidden_size, intermediate_size, num_local_experts; gpt-oss's clamped SwiGLU
constants), a GptOssExperts and a SwiGLUExperts (Qwen3-MoE's and Mixtral's experts) of those widths get
random bf16 weights; `--rows` random rows are split into runs, one per expert, of lengths that torchtitan's
grouped GEMM never sees (it pads each run to a multiple of 8 rows; the trainer does not): the first and last
expert get no rows (offsets that start and end on a repeat), others 1, 7, 24 and 33 rows, the rest random
(seeded). Each module runs the rows three ways: grouped (bf16), looped (bf16) and an fp32 loop on the same
bf16 values (the reference). On CUDA a fixed random cotangent then goes back through each, giving the
gradients of the rows and of every expert parameter.

The rule, for the output and every gradient, whole and per expert (each expert's rows, or its slice of a
stacked parameter): grouped's relative error against the reference (norm of the difference over the
reference's norm; the norm of the difference where the reference is zero, e.g. the gradient of an expert
without rows) is at most 2 x the bf16 loop's + 1e-3. Both bf16 paths round the same intermediates, so
grouped GEMM's own error can only add a comparable amount; a wrong run (rows of one expert multiplied by
another's weights, an unwritten gradient of an empty run) is off by order 1.

Writes GroupedCheck as JSON (every number, `passed`), prints one line per tensor; exit status 0 when every
comparison passed, 1 when one did not (or grouped GEMM raised), 2 on bad arguments. On CPU only the forward
is compared (`"backward": "not on cpu"`). bench/gpu_check.sh runs it in the gpt_oss_layers step.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

from trainer.config import ModelConfig  # noqa: E402
from trainer.errors import ConfigError  # noqa: E402
from trainer.hf.config import read_architecture  # noqa: E402
from trainer.moe import GptOssExperts, StackedExperts, SwiGLUExperts  # noqa: E402

DEFAULT_ROWS = 4099  # a few thousand, odd: not a multiple of 8 in total either
DEFAULT_SEED = 0
# Run lengths every check has (besides an empty first and last run): one row, an odd count under 8, a
# multiple of 8 that is not one of 16, an odd count over 16.
FIXED_RUNS = (1, 7, 24, 33)
MIN_EXPERTS = len(FIXED_RUNS) + 4  # the empty first and last runs and at least two random ones
LOOP_FACTOR, FLOOR = 2.0, 1e-3
RULE = f"grouped_rel <= {LOOP_FACTOR:g} x looped_rel + {FLOOR:g}, for the whole tensor and each expert's part"


# --- the result --------------------------------------------------------------------------------------

@dataclass
class Comparison:
    """One tensor (or one expert's part of it): grouped's and the loop's errors against the reference."""

    grouped_rel: float
    """|grouped - reference| / |reference| (|grouped - reference| where the reference is zero)."""
    looped_rel: float
    """The same for the bf16 loop."""
    allowed: float
    """LOOP_FACTOR x looped_rel + FLOOR: what grouped may reach."""
    ratio: float
    """grouped_rel / allowed: at most 1 passes."""
    passed: bool


@dataclass(kw_only=True)
class ExpertPart(Comparison):
    expert: int
    rows: int
    """Rows the expert got."""


@dataclass
class TensorCheck:
    """The output or a gradient of one module: the whole tensor, then each expert's part."""

    tensor: str
    """`output`, `grad_input` (the rows' gradient) or `grad_<parameter>`."""
    whole: Comparison
    experts: list[ExpertPart]
    """Each expert's rows (output, grad_input: none for an expert without rows) or stacked slice."""
    passed: bool


@dataclass
class Finding:
    """Where a comparison came out, for the summary: module, tensor, expert (None: the whole tensor)."""

    module: str
    tensor: str
    expert: int | None
    grouped_rel: float
    looped_rel: float
    allowed: float
    ratio: float

    def describe(self) -> str:
        part = "" if self.expert is None else f" expert {self.expert}"
        return (f"{self.module} {self.tensor}{part}: grouped {self.grouped_rel:.3g} vs loop "
                f"{self.looped_rel:.3g} (allowed {self.allowed:.3g}, ratio {self.ratio:.3g})")


@dataclass
class ModuleCheck:
    module: str
    """GptOssExperts or SwiGLUExperts."""
    tensors: list[TensorCheck]
    error: str | None
    """What grouped GEMM raised, when it did (the module then fails)."""
    passed: bool


@dataclass
class GroupedCheck:
    """What grouped_check.json holds."""

    device: str
    torch_version: str
    config: str
    dim: int
    ffn_dim: int
    n_experts: int
    rows: int
    seed: int
    run_lengths: list[int]
    backward: str
    """`checked` (CUDA), or `not on cpu`: CPU torch has no grouped GEMM backward."""
    rule: str
    modules: list[ModuleCheck]
    passed: bool
    worst: Finding | None
    """The comparison closest to (or furthest past) its allowance."""
    failures: list[Finding] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> GroupedCheck:
        """The file this script wrote (bench/gpu_summary.py reads it); ValueError when it is not one."""
        return TypeAdapter(cls).validate_json(path.read_bytes())


# --- the comparison ----------------------------------------------------------------------------------

def relative_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    # In fp32, which holds bf16 exactly: gpt-oss-120b's stacked gradients are 2 billion elements.
    difference = torch.linalg.vector_norm(result.float() - reference.float()).item()
    scale = torch.linalg.vector_norm(reference.float()).item()
    return difference / scale if scale > 0 else difference


def judge(grouped_rel: float, looped_rel: float) -> Comparison:
    allowed = LOOP_FACTOR * looped_rel + FLOOR
    ratio = grouped_rel / allowed
    # NaN compares false: a non-finite result fails.
    return Comparison(grouped_rel, looped_rel, allowed, ratio, passed=bool(ratio <= 1.0))


def parts(name: str, counts: list[int]) -> list[tuple[int, int, slice | int]]:
    """(expert, rows, index) of each expert's part of tensor `name`: its rows of the output and of the rows'
    gradient (experts without rows have none), its slice of a stacked parameter's gradient."""
    if name in ("output", "grad_input"):
        starts = [sum(counts[:e]) for e in range(len(counts))]
        return [(e, n, slice(start, start + n))
                for e, (start, n) in enumerate(zip(starts, counts, strict=True)) if n > 0]
    return [(e, n, e) for e, n in enumerate(counts)]


def compare(name: str, reference: torch.Tensor, looped: torch.Tensor, grouped: torch.Tensor,
            counts: list[int]) -> TensorCheck:
    """The rule on tensor `name`, whole and per expert."""
    whole = judge(relative_error(grouped, reference), relative_error(looped, reference))
    experts = [ExpertPart(**asdict(judge(relative_error(grouped[index], reference[index]),
                                         relative_error(looped[index], reference[index]))), expert=e, rows=n)
               for e, n, index in parts(name, counts)]
    return TensorCheck(name, whole, experts, passed=whole.passed and all(p.passed for p in experts))


def findings(module: str, check: TensorCheck) -> list[Finding]:
    def finding(c: Comparison, expert: int | None) -> Finding:
        return Finding(module, check.tensor, expert, c.grouped_rel, c.looped_rel, c.allowed, c.ratio)

    return [finding(check.whole, None), *(finding(p, p.expert) for p in check.experts)]


def worst_of(found: list[Finding]) -> Finding | None:
    # A NaN ratio is the worst there is.
    return max(found, key=lambda f: math.inf if math.isnan(f.ratio) else f.ratio, default=None)


# --- the runs ----------------------------------------------------------------------------------------

def run_lengths(n_experts: int, rows: int, seed: int) -> list[int]:
    """Rows per expert: none for the first and last expert, FIXED_RUNS for experts placed at random between
    them, the remaining rows spread over the others at random (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    middle = torch.randperm(n_experts - 2, generator=generator) + 1
    fixed, free = middle[:len(FIXED_RUNS)], middle[len(FIXED_RUNS):]
    lengths = [0] * n_experts
    for expert, n in zip(fixed.tolist(), FIXED_RUNS, strict=True):
        lengths[expert] = n
    # Uneven shares, as a router makes: some experts several times the mean.
    shares = torch.empty(len(free)).exponential_(generator=generator)
    picks = torch.multinomial(shares, rows - sum(FIXED_RUNS), replacement=True, generator=generator)
    for expert, n in zip(free.tolist(), torch.bincount(picks, minlength=len(free)).tolist(), strict=True):
        lengths[expert] = n
    return lengths


@dataclass
class Widths:
    """The experts of a config.json, as the trainer reads it (trainer/hf/config.py)."""

    dim: int
    ffn_dim: int
    n_experts: int
    alpha: float
    limit: float
    """gpt-oss's clamped SwiGLU constants (swiglu_alpha, swiglu_limit)."""

    @classmethod
    def of(cls, config: Path) -> Widths:
        model = ModelConfig(**read_architecture(str(config), "--config").model_fields)
        return cls(model.dim, model.expert_ffn_dim, model.n_experts, model.swiglu_alpha, model.swiglu_limit)


MODULES: dict[str, Callable[[Widths], StackedExperts]] = {
    "GptOssExperts": lambda w: GptOssExperts(w.dim, w.ffn_dim, w.n_experts, w.alpha, w.limit),
    "SwiGLUExperts": lambda w: SwiGLUExperts(w.dim, w.ffn_dim, w.n_experts),
}


def randomise(module: StackedExperts, generator: torch.Generator) -> None:
    """Weights of std 1 / sqrt(fan-in) (activations of order 1, as trained blocks have), biases of 0.1."""
    with torch.no_grad():
        # gpt-oss stores x @ W ([experts, in, out]), SwiGLUExperts as nn.Linear does ([experts, out, in]).
        fan_in_dim = 1 if isinstance(module, GptOssExperts) else 2
        for name, param in module.named_parameters():
            std = 0.1 if name.endswith("_bias") else param.shape[fan_in_dim] ** -0.5
            param.copy_(torch.randn(param.shape, generator=generator, device=param.device) * std)


ExpertsPath = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""StackedExperts.looped or .grouped of one module: (rows sorted by expert, rows per expert) -> outputs."""


def outputs(path: ExpertsPath, module: StackedExperts, rows: torch.Tensor, counts: torch.Tensor,
            cotangent: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The output of one path and, with a cotangent, the gradients of the rows and of every parameter."""
    rows = rows.detach().requires_grad_(cotangent is not None)
    with torch.set_grad_enabled(cotangent is not None):
        out = path(rows, counts)
    results = {"output": out.detach()}
    if cotangent is not None:
        names, params = zip(*module.named_parameters(), strict=True)
        grads = torch.autograd.grad(out, (rows, *params), cotangent.to(out.dtype))
        results["grad_input"] = grads[0]
        results.update({f"grad_{name}": grad for name, grad in zip(names, grads[1:], strict=True)})
    return results


def check_module(name: str, widths: Widths, device: torch.device, counts: list[int], seed: int,
                 backward: bool) -> tuple[ModuleCheck, list[Finding]]:
    generator = torch.Generator(device=device).manual_seed(seed)
    with device:  # made where they run: gpt-oss-120b's experts are 3.2 billion parameters
        bf16 = MODULES[name](widths).to(torch.bfloat16)
        reference = MODULES[name](widths)
    randomise(bf16, generator)
    with torch.no_grad():  # the reference computes in fp32 on exactly the bf16 weights
        for target, source in zip(reference.parameters(), bf16.parameters(), strict=True):
            target.copy_(source)
    total = sum(counts)
    rows = torch.randn(total, widths.dim, generator=generator, device=device).to(torch.bfloat16)
    cotangent = torch.randn(total, widths.dim, generator=generator, device=device) if backward else None
    runs = torch.tensor(counts, device=device)
    expected = outputs(reference.looped, reference, rows.float(), runs, cotangent)
    looped = outputs(bf16.looped, bf16, rows, runs, cotangent)
    try:
        grouped = outputs(bf16.grouped, bf16, rows, runs, cotangent)
    except RuntimeError as e:
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return ModuleCheck(name, [], error, passed=False), []
    tensors = [compare(key, expected[key], looped[key], grouped[key], counts) for key in expected]
    found = [f for t in tensors for f in findings(name, t)]
    return ModuleCheck(name, tensors, None, passed=all(t.passed for t in tensors)), found


def check(config: Path, widths: Widths, device: torch.device, rows: int, seed: int) -> GroupedCheck:
    counts = run_lengths(widths.n_experts, rows, seed)
    backward = device.type == "cuda"
    modules, found = [], []
    for name in MODULES:
        module_check, module_found = check_module(name, widths, device, counts, seed, backward)
        modules.append(module_check)
        found += module_found
        if device.type == "cuda":
            torch.cuda.empty_cache()  # gpt-oss-120b's 128 experts: one module's tensors at a time
    failures = [f for f in found if not f.ratio <= 1.0]
    return GroupedCheck(device=device.type, torch_version=torch.__version__, config=str(config),
                        dim=widths.dim, ffn_dim=widths.ffn_dim, n_experts=widths.n_experts, rows=rows,
                        seed=seed, run_lengths=counts, backward="checked" if backward else "not on cpu",
                        rule=RULE, modules=modules, passed=all(m.passed for m in modules),
                        worst=worst_of(found), failures=failures)


def report(result: GroupedCheck) -> str:
    lines = [f"grouped GEMM vs the per-expert loop on {result.device} (torch {result.torch_version}): "
             f"{result.n_experts} experts of {result.dim} x {result.ffn_dim}, {result.rows} rows in runs of "
             f"{result.run_lengths}; backward {result.backward}; rule: {result.rule}"]
    for module in result.modules:
        if module.error:
            lines.append(f"{module.module}: grouped GEMM raised {module.error}")
        for t in module.tensors:
            worst = worst_of(findings(module.module, t))
            lines.append(f"{module.module} {t.tensor}: grouped {t.whole.grouped_rel:.3g}, loop "
                         f"{t.whole.looped_rel:.3g}, allowed {t.whole.allowed:.3g}; worst part: "
                         f"{worst.describe()} -> {'ok' if t.passed else 'FAILED'}")
    worst = f"; worst: {result.worst.describe()}" if result.worst else ""
    lines.append(f"grouped equals loop: {'passed' if result.passed else 'FAILED'}{worst}")
    return "\n".join(lines)


# --- the command -------------------------------------------------------------------------------------

class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"error: {message}; run with --help for the options\n")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--config", type=Path, required=True,
                        help="a config.json with experts (the gpt_oss_layers step's model-config.json)")
    parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
    parser.add_argument("--output", type=Path, required=True, help="the JSON result (GroupedCheck)")
    parser.add_argument("--rows", type=int, default=DEFAULT_ROWS,
                        help=f"rows routed (default {DEFAULT_ROWS})")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"default {DEFAULT_SEED}")
    args = parser.parse_args(argv)
    try:
        widths = Widths.of(args.config)
    except ConfigError as e:
        parser.error("; ".join(map(str, e.problems)))
    if widths.n_experts < MIN_EXPERTS:
        parser.error(f"--config {args.config}: num_local_experts is {widths.n_experts}, the check needs at "
                     f"least {MIN_EXPERTS} experts (an empty first and last run, runs of {FIXED_RUNS}, two "
                     "random); give a config.json with experts (gpt-oss, Qwen3-MoE, Mixtral)")
    if args.rows < sum(FIXED_RUNS) + 2:
        parser.error(f"--rows {args.rows} is too few: give at least {sum(FIXED_RUNS) + 2} "
                     f"(default {DEFAULT_ROWS})")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch {torch.__version__} sees no GPU; use --device cpu (forward only)")
    # The reference is an fp32 loop: TF32 matmuls would make it no better than bf16.
    torch.set_float32_matmul_precision("highest")
    result = check(args.config, widths, torch.device(args.device), args.rows, args.seed)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(asdict(result), indent=1) + "\n")
    print(report(result))
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
