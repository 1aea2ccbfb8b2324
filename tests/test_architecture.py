"""The layout's rules, checked over the import graph of the three packages (README.md, "Layout").

Every `import` counts, also those inside functions: a lazy import is still a dependency. A module
that imports a package's submodule depends on that submodule, not on the package's __init__.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("infra", "fsdpctl", "trainer")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))
            if "__pycache__" not in p.parts}


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The project modules `name` imports (resolved to modules where `from X import Y` names one)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import a.b.c` where c is an attribute
                target = target.rpartition(".")[0]
            if target and target.split(".")[0] in (*PACKAGES, "tests"):
                found.add(target)
    found.discard(name)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _violations(importer_prefix: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    def within(module: str, prefixes: tuple[str, ...]) -> bool:
        return any(module == p or module.startswith(p + ".") for p in prefixes)

    return sorted(f"{importer} imports {target}" for importer, targets in GRAPH.items()
                  if within(importer, (importer_prefix,)) and not within(importer, allowed)
                  for target in targets if within(target, forbidden))


def test_the_graph_sees_the_whole_project():
    assert {"infra.program", "infra.spec.model", "fsdpctl.cli", "fsdpctl.targets.aws.stack",
            "fsdpctl.checks.smoke", "trainer.checkpoint.manager"} <= set(GRAPH)
    assert "fsdpctl.errors" in GRAPH["fsdpctl.state"]
    # a lazy import inside a function is seen
    assert "fsdpctl.configure" in GRAPH["fsdpctl.lifecycle"]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module: the import cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    return found


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert cycles(GRAPH) == []


@pytest.mark.parametrize(("importer", "forbidden", "why"), [
    ("infra", ("fsdpctl", "trainer", "tests"),
     "infra/ is the cluster's definition (spec, catalog, Pulumi program): `pulumi up` runs it alone"),
    ("trainer", ("infra", "fsdpctl", "tests"), "the nodes install the trainer alone (fsdp-trainer)"),
    ("fsdpctl", ("tests",), "product code never depends on the tests"),
    ("fsdpctl.targets", ("fsdpctl.configure", "fsdpctl.deploy", "fsdpctl.checks", "fsdpctl.lifecycle",
                         "fsdpctl.demo"),
     "targets make and remove nodes; lifecycle configures and deploys after them"),
    ("fsdpctl.checks", ("fsdpctl.targets", "fsdpctl.lifecycle", "fsdpctl.configure"),
     "checks run on whatever nodes the state lists, whichever target made them"),
])
def test_direction_rules(importer, forbidden, why):
    assert _violations(importer, forbidden) == [], why


def test_nothing_imports_the_cli_but_its_entry_point():
    importers = sorted(m for m, targets in GRAPH.items() if "fsdpctl.cli" in targets)
    assert importers == ["fsdpctl.__main__"]


@pytest.mark.parametrize("leaf", ["fsdpctl.errors", "trainer.errors", "infra.spec.problems",
                                  "infra.spec.constants"])
def test_error_modules_are_leaves(leaf):
    assert GRAPH[leaf] == set(), f"{leaf} must import nothing of the project"


def _third_party_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_trainer_never_imports_transformers():
    """transformers (and peft) are the tests' independent reference for Hugging Face models, not a
    dependency of the nodes' wheel: the trainer reads config.json, safetensors and tokenizer.json itself."""
    offenders = sorted(f"{name} imports {lib}" for name, path in MODULES.items() if name.startswith("trainer")
                       for lib in _third_party_imports(path) & {"transformers", "peft", "huggingface_hub"})
    assert offenders == []
    # The check sees third-party imports at all.
    assert "safetensors" in _third_party_imports(MODULES["trainer.hf.weights"])


# ---- typed data across stage boundaries ----------------------------------------------------------
# What one stage hands the next (a check's result to the report, the trainer's records to fsdpctl,
# the stack outputs to the state, Ansible's recap to the state) is a typed record, never a
# dict[str, Any] read by string keys downstream (DEVELOPERS' rule; issue 23).
STAGE_MODULES = ("fsdpctl.checks", "fsdpctl.configure", "fsdpctl.targets.aws.stack", "trainer.metrics",
                 "trainer.records")
# Where untyped data enters from outside and becomes typed: the only public signatures allowed a
# mapping of Any (or an unparameterised one).
LOOSE_MAPPINGS_ALLOWED = {
    "fsdpctl.configure.parse_extra_vars": "Ansible's extra variables (`-e k=v`): free-form by nature, "
                                          "handed to ansible-runner as they are",
    "fsdpctl.configure.configure": "the same extra variables, passed through to ansible-runner",
    "fsdpctl.configure.run_configure": "the same extra variables, passed through to ansible-runner",
    "fsdpctl.targets.aws.stack.state_from_outputs": "the Automation API's stack outputs are plain JSON "
                                                    "values; this is where they become StackOutputs",
    "fsdpctl.targets.aws.stack.DeadLetter.from_message": "an SQS message as boto3 returns it (JSON); "
                                                         "this is where it becomes a DeadLetter",
}
_MAPPINGS = {"dict", "Dict", "Mapping", "MutableMapping"}


def _type_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def loose_mappings(annotation: ast.expr | None) -> list[str]:
    """The mappings in a type annotation whose values are untyped: `dict[str, Any]`, `Mapping[str,
    object]`, or a bare `dict` (also inside another type, `list[dict[str, Any]]`)."""
    if annotation is None:
        return []
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):  # a quoted annotation
        annotation = ast.parse(annotation.value, mode="eval").body
    found, parameterised = [], set()
    for node in ast.walk(annotation):
        if isinstance(node, ast.Subscript) and _type_name(node.value) in _MAPPINGS:
            parameterised.add(id(node.value))
            args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if len(args) == 2 and _type_name(args[1]) in ("Any", "object"):
                found.append(ast.unparse(node))
    found += [ast.unparse(node) for node in ast.walk(annotation) if isinstance(node, ast.Name | ast.Attribute)
              and _type_name(node) in _MAPPINGS and id(node) not in parameterised]
    return found


def _public_functions(module: str, tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef]]:
    """Module-level functions and the methods of module-level classes whose names are public."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_"):
            yield f"{module}.{node.name}", node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and not item.name.startswith("_"):
                    yield f"{module}.{node.name}.{item.name}", item


def untyped_boundaries(module: str, source: str) -> dict[str, list[str]]:
    """Each public function of `source` with a loose mapping in a parameter's or its return annotation."""
    out = {}
    for name, function in _public_functions(module, ast.parse(source)):
        args = function.args
        annotated = [a.annotation for a in [*args.posonlyargs, *args.args, *args.kwonlyargs,
                                           *filter(None, [args.vararg, args.kwarg])]]
        loose = [m for annotation in [*annotated, function.returns] for m in loose_mappings(annotation)]
        if loose:
            out[name] = loose
    return out


def test_the_boundary_rule_sees_loose_mappings():
    source = ("def a(x: dict[str, Any]) -> int: ...\n"
              "def b(x: int) -> list[Mapping[str, object]]: ...\n"
              "def c(*, x: dict | None = None): ...\n"
              "def d(x: dict[str, int], y: 'typing.Mapping[str, float]') -> dict[int, list[str]]: ...\n"
              "def _private(x: dict[str, Any]): ...\n"
              "class Public:\n    def e(self, **kw: dict[str, Any]): ...\n    def _f(self, x: dict): ...\n"
              "class _Private:\n    def g(self, x: dict): ...\n"
              "def h():\n    def nested(x: dict[str, Any]): ...\n")
    assert untyped_boundaries("m", source) == {"m.a": ["dict[str, Any]"], "m.b": ["Mapping[str, object]"],
                                               "m.c": ["dict"], "m.Public.e": ["dict[str, Any]"]}


def test_no_untyped_mapping_crosses_a_stage_boundary():
    found = {name: loose for module, path in MODULES.items()
             if any(module == s or module.startswith(s + ".") for s in STAGE_MODULES)
             for name, loose in untyped_boundaries(module, path.read_text()).items()}
    offenders = sorted(f"{name}: {', '.join(loose)}" for name, loose in found.items()
                       if name not in LOOSE_MAPPINGS_ALLOWED)
    assert offenders == [], "give these a pydantic model or a dataclass (typed data across stages)"
    # An entry whose function is gone or typed now goes too.
    assert sorted(set(LOOSE_MAPPINGS_ALLOWED) - set(found)) == []


def test_fsdpctl_reads_the_trainers_records_without_torch():
    """The operator machine parses the metrics files (fsdpctl/checks) with the trainer's own types;
    it may have no torch: trainer.records needs pydantic and the standard library only, and the
    checks import nothing else of the trainer."""
    assert GRAPH["trainer.records"] == set()
    assert _third_party_imports(MODULES["trainer.records"]) - set(sys.stdlib_module_names) == {"pydantic"}
    offenders = sorted(f"{importer} imports {target}" for importer, targets in GRAPH.items()
                       if importer.startswith("fsdpctl.checks")
                       for target in targets if target.startswith("trainer") and target != "trainer.records")
    assert offenders == []


# ---- scripts that start a process group exit through trainer.distributed.exit_process -------------
# A native gloo/torch thread can abort a finished two-rank process at interpreter teardown (SIGABRT,
# exit -6 under torchrun; see exit_process): a complete run must not read as a failed one.
SCRIPT_ROOTS = ("trainer", "bench", "tests")


def _main_block(tree: ast.Module) -> ast.If | None:
    for node in tree.body:
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"):
            return node
    return None


def exits_natively(source: str) -> bool:
    """Whether a script that starts a process group ends its `__main__` block without exit_process."""
    if "init_process_group(" not in source and "init_distributed(" not in source:
        return False
    block = _main_block(ast.parse(source))
    if block is None:
        return False
    called = {getattr(call.func, "id", getattr(call.func, "attr", None))
              for call in ast.walk(block) if isinstance(call, ast.Call)}
    return "exit_process" not in called


def test_the_exit_rule_sees_a_native_exit():
    script = ('import torch.distributed as dist\n\ndef main():\n    dist.init_process_group("gloo")\n\n'
              'if __name__ == "__main__":\n    main()\n')
    assert exits_natively(script)
    assert not exits_natively(script + "    exit_process(0)\n")
    assert not exits_natively(script.split("\nif __name__")[0])  # a library module


def test_scripts_that_start_a_process_group_exit_through_exit_process():
    scripts = [p for root in SCRIPT_ROOTS for p in sorted((REPO / root).rglob("*.py"))
               if "__pycache__" not in p.parts]
    offenders = [str(p.relative_to(REPO)) for p in scripts if exits_natively(p.read_text())]
    assert offenders == []
