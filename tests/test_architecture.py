"""The layout's rules, checked over the import graph of the three packages (README.md, "Layout").

Every `import` counts, also those inside functions: a lazy import is still a dependency. A module
that imports a package's submodule depends on that submodule, not on the package's __init__.
"""

from __future__ import annotations

import ast
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
