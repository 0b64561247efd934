"""The package layers point down, and no two modules import each other, function-local imports
included.

The order is written once, in LAYERS: a module may import its own package and the packages of
lower layers. A failure names each offending import, so the fix is to move the helper down (or
the caller up), never to hide the import inside a function.
"""

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

# Lowest first. Packages on one line share a layer and may not import each other.
LAYERS = [
    ["rlhf.errors"],
    ["rlhf.files", "rlhf.logs", "rlhf.families", "rlhf.trace", "rlhf.environ"],
    ["rlhf.config"],
    ["rlhf.rewards"],
    ["rlhf.envs", "rlhf.node_probes"],
    ["rlhf.data", "rlhf.algorithms"],
    ["rlhf.parallel"],
    ["rlhf.models"],
    ["rlhf.demo"],
    ["rlhf.engine"],
    ["rlhf.rollout"],
    ["rlhf.controller"],
    ["workers"],
    ["rlhf.trainer"],
    ["rlhf.bench", "rlhf.cli", "rlhf.doctor", "rlhf.plan", "rlhf.preflight", "rlhf.report",
     "rlhf.verify"],
]
# The top layer's apps are entry points over the library; they may call each other.
PEERS_ALLOWED = set(LAYERS[-1])


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for top in ("rlhf", "workers"):
        for path in sorted((REPO / top).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """Every project module `name` imports, at any depth of its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            # `from pkg import sub` imports pkg.sub (and runs pkg/__init__, which is pkg's own
            # business); `from pkg import name` imports pkg.
            candidates = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules
                          else source for alias in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in modules:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                targets.add(candidate)
    return targets


def _layer_of(module: str) -> tuple[int, str]:
    if module == "rlhf":  # the root package's __init__
        return 0, module
    best = None
    for level, packages in enumerate(LAYERS):
        for package in packages:
            if module == package or module.startswith(package + "."):
                if best is None or len(package) > len(best[1]):
                    best = (level, package)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add its package to LAYERS in {__file__}")
    return best


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_imports_point_down(graph):
    wrong = []
    for source, targets in sorted(graph.items()):
        source_level, source_package = _layer_of(source)
        for target in sorted(targets):
            target_level, target_package = _layer_of(target)
            if target_package == source_package:
                continue
            if target_level > source_level or (
                    target_level == source_level and source_package not in PEERS_ALLOWED):
                wrong.append(f"{source} -> {target} ({source_package} is below "
                             f"{target_package})" if target_level > source_level else
                             f"{source} -> {target} (peers on one layer)")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def test_no_import_cycles(graph):
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not cycles, "modules that import each other:\n" + "\n".join(map(str, cycles))


def test_the_checker_sees_function_local_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from rlhf.trainer import ppo\n    import rlhf.engine.engine\n")
    found = _imports("rlhf.config.m", module, {"rlhf.trainer.ppo": 0, "rlhf.engine.engine": 0,
                                                "rlhf.config.m": 0})
    assert found == {"rlhf.trainer.ppo", "rlhf.engine.engine"}
