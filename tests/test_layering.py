"""The package layering (docs/ARCHITECTURE.md, "Dependencies"): every tpfuse import, at module level or
inside a function, points to the same layer or a lower one, and no modules import each other in a cycle."""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"

# Lower layers first; a module may import its own layer and those below it.
LAYERS = [
    {"config", "gpu_timing", "knobs"},
    {"kernels"},
    {"comm"},
    {"model"},
    {"spec"},
    {"engine"},
    {"server", "bench", "demo", "cli", "__main__", ""},  # "" is the package's own __init__
]
LEVEL = {part: level for level, parts in enumerate(LAYERS) for part in parts}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the tpfuse modules it imports (a `from package import name` names the submodule when
    there is one)."""
    files = {_module_name(p): p for p in (SRC / "tpfuse").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = graph.setdefault(module, set())
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.split(".")[0] == "tpfuse")
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                if base.split(".")[0] != "tpfuse":
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in files else base)
        targets.discard(module)
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_module_belongs_to_a_layer():
    unknown = sorted({_layer(m) for m in import_graph()} - set(LEVEL))
    assert not unknown, f"add {unknown} to LAYERS here and to docs/ARCHITECTURE.md"


def test_no_import_points_to_a_higher_layer():
    upward = [
        f"{source} -> {target}"
        for source, targets in import_graph().items()
        for target in sorted(targets)
        if LEVEL[_layer(target)] > LEVEL[_layer(source)]
    ]
    assert not upward, "imports against the layering:\n" + "\n".join(sorted(upward))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in graph), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles():
    cycles = _cycles(import_graph())
    assert not cycles, "modules that import each other (directly or around a loop):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_checks_see_a_cycle_and_an_upward_edge():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph()
    assert "tpfuse.comm.communicator" in graph["tpfuse.comm.factory"]
    assert "tpfuse.model.linear_choice" in graph["tpfuse.engine.runner"]  # `from tpfuse.model import x`
