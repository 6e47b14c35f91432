"""The import graph of ``model/`` and ``service/``: floors, and no cycle.

Floors: each package sits on a floor and imports only from packages on lower floors (within a
package anything goes, as long as there is no cycle). From the bottom: the math (``ops``, Triton
``kernels``); what every process runs (``runtime``: variables, guards, metrics); the FP8 QSA cache
and PLE (``qsa_kv``, ``ple``); the deployment decided once (``deployment``); the two
implementations and the offline tools (``ours``, ``upstream``, ``tools``: none imports another);
the vLLM plugin; the service. So a lower module can be read, tested and changed without the
floors above it.

Why static: a cycle (``qsa_kv.runtime`` <-> ``qsa_kv.state`` used to be one) works or breaks
depending on which module a process happens to import first, so a test that imports modules in
one order proves little. Every ``import``/``from ... import`` anywhere in a module counts,
including ``TYPE_CHECKING`` blocks and function bodies: a type-only or deferred import back into
a module is still a dependency running both ways, which is what the layering forbids.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (ROOT / "model", ROOT / "service")
FLOORS = {
    "model.ops": 0,
    "model.kernels": 0,
    "model.runtime": 1,
    "model.qsa_kv": 2,
    "model.ple": 2,
    "model.deployment": 3,
    "model.ours": 4,
    "model.upstream": 4,
    "model.tools": 4,
    "model.plugin": 5,
    "model": 5,
    "service": 6,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _targets(node: ast.AST, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            module = ".".join([*base, node.module] if node.module else base)
        else:
            module = node.module or ""
        return [module] + [f"{module}.{a.name}" for a in node.names]  # "from pkg import submodule"
    return []


def import_graph() -> dict[str, set[str]]:
    """Module -> the ``model``/``service`` modules it imports (package ``__init__`` files are modules too)."""
    files = {_module_name(p): p for package in PACKAGES for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            graph[name] |= {t for t in _targets(node, package) if t in files and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
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


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    graph = import_graph()
    assert "model.qsa_kv.state" in graph and "model.qsa_kv.runtime" in graph["model.qsa_kv.state"]
    assert cycles(graph) == [], "import cycles in model/ (each list imports itself around)"


def package_of(module: str) -> str:
    """The floor's key of a module: ``model.<package>`` (or ``model.plugin``, ``model``), ``service``."""
    parts = module.split(".")
    return "service" if parts[0] == "service" else ".".join(parts[:2])


def floor_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports into another package on the same floor or a higher one."""
    found = []
    for module, targets in sorted(graph.items()):
        own = package_of(module)
        for target in sorted(targets):
            other = package_of(target)
            if other != own and FLOORS[other] >= FLOORS[own]:
                found.append((module, target))
    return found


def test_the_floor_checker_finds_an_import_going_up_or_sideways():
    graph = {"model.ops.a": {"model.ours.b"}, "model.ours.b": {"model.upstream.c"}, "model.upstream.c": set()}
    assert floor_violations(graph) == [("model.ops.a", "model.ours.b"), ("model.ours.b", "model.upstream.c")]


def test_every_package_has_a_floor_and_imports_only_lower_floors():
    graph = import_graph()
    assert {package_of(m) for m in graph} <= set(FLOORS), "a new package needs its floor in FLOORS"
    assert floor_violations(graph) == []
