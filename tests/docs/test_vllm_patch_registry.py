"""Every place in ``model/`` that patches vLLM at run time is listed in ``docs/design/vllm-patches.md``.

A patch of someone else's code is a debt: it must say what it targets, why, how it is checked and
when it can go. The registry is that list; this test finds the patches in the code (every function
named ``install`` or ``_install*``, and every function that assigns an attribute of, or calls
``setattr`` on, something imported from ``vllm``) and fails on one the registry does not name as
``path::function``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = ROOT / "docs" / "design" / "vllm-patches.md"


def _vllm_names(nodes: list[ast.stmt]) -> set[str]:
    """Names these statements (not nested functions) bind to vLLM modules or their members."""
    names: set[str] = set()
    for node in nodes:
        for sub in ast.walk(node) if not isinstance(node, ast.FunctionDef) else [node]:
            if isinstance(sub, ast.ImportFrom) and (sub.module or "").split(".")[0] == "vllm":
                names |= {alias.asname or alias.name for alias in sub.names}
            elif isinstance(sub, ast.Import):
                names |= {
                    alias.asname or alias.name.split(".")[0]
                    for alias in sub.names
                    if alias.name.startswith("vllm")
                }
    return names


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Call):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _patches_vllm(func: ast.FunctionDef, module_names: set[str]) -> bool:
    bound = module_names | _vllm_names(func.body)
    changed = True
    while changed:  # aliases such as ``cls = FastIncrementalDetokenizer``
        changed = False
        for sub in ast.walk(func):
            if isinstance(sub, ast.Assign) and _root(sub.value) in bound:
                for target in sub.targets:
                    if isinstance(target, ast.Name) and target.id not in bound:
                        bound.add(target.id)
                        changed = True
    for sub in ast.walk(func):
        targets = sub.targets if isinstance(sub, ast.Assign) else []
        if any(isinstance(t, ast.Attribute) and _root(t) in bound for t in targets):
            return True
        if (
            isinstance(sub, ast.Call)
            and getattr(sub.func, "id", None) == "setattr"
            and _root(sub.args[0]) in bound
        ):
            return True
    return False


def vllm_patches() -> list[str]:
    """``path::function`` of every patching function in ``model/``."""
    found = []
    for path in sorted((ROOT / "model").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        module_names = _vllm_names(
            [n for n in tree.body if not isinstance(n, ast.FunctionDef | ast.ClassDef)]
        )
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef):
                continue
            named = node.name == "install" or node.name.startswith("_install")
            if named or _patches_vllm(node, module_names):
                found.append(f"{path.relative_to(ROOT).as_posix()}::{node.name}")
    return found


def test_the_finder_sees_the_known_patches():
    found = vllm_patches()
    assert "model/runtime/vllm_fixes.py::install" in found
    assert "model/upstream/optional_kernels.py::disable_cute_dsl_hc" in found


def test_every_vllm_patch_is_in_the_registry():
    registry = REGISTRY.read_text()
    missing = [name for name in vllm_patches() if f"`{name}`" not in registry]
    assert not missing, f"vLLM patches missing from {REGISTRY.relative_to(ROOT)}: {missing}"


# Where patches may be installed: the plugin's registration (every vLLM process) and the upstream
# subclasses' first construction; besides, a patch installing its companion (gdn), the capture
# guard's first reader, the indexer projection kept separate for one constructor, and the benches'
# baseline of vLLM's own model with the plugin off.
INSTALLERS = {
    ("model/plugin.py", "register"),
    ("model/upstream/patches.py", "apply"),
    ("model/upstream/gdn.py", "install"),
    ("model/qsa_kv/snapshot.py", "__init__"),
    ("model/upstream/qsa.py", "__init__"),
    ("model/upstream/optional_kernels.py", "prepare_upstream_without_plugin"),
}


def _called_names(nodes) -> set[str]:
    names = set()
    for node in nodes:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call):
                f = sub.func
                names.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return names


def test_patches_are_installed_at_explicit_moments_never_on_import():
    patch_functions = {name.split("::")[1] for name in vllm_patches()}
    on_import, elsewhere = [], []
    for path in sorted((ROOT / "model").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(), rel)
        top = [
            n for n in tree.body if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        ]
        if hits := _called_names(top) & patch_functions:
            on_import.append((rel, sorted(hits)))
        for func in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            calls = _called_names(func.body) & ({"install", "_install_core"} | patch_functions)
            if calls and (rel, func.name) not in INSTALLERS:
                elsewhere.append((rel, func.name, sorted(calls)))
    assert on_import == [], f"patches installed when a module is imported: {on_import}"
    assert elsewhere == [], f"patches installed outside {sorted(INSTALLERS)}: {elsewhere}"
