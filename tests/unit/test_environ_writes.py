"""No module of ``service/`` or ``model/`` writes the process environment but one.

Why: configuration handed over through ``os.environ`` is invisible where it is used and leaks
between tests; the deployment reaches vLLM's processes through ``additional_config``, and the few
variables only the environment can carry are written by :mod:`service.child_environment`. A static
check, so that a write on a rarely taken path is found too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {"service/child_environment.py"}
WRITING_METHODS = {"setdefault", "update", "pop", "popitem", "clear", "__setitem__", "__delitem__"}


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` or a bare ``environ``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ"
    return isinstance(node, ast.Name) and node.id == "environ"


def environ_writes(source: str, filename: str = "<source>") -> list[int]:
    """Line numbers of environment writes in ``source``."""
    lines = []
    for node in ast.walk(ast.parse(source, filename)):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        if any(isinstance(t, ast.Subscript) and _is_environ(t.value) for t in targets):
            lines.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr in WRITING_METHODS and _is_environ(f.value):
                lines.append(node.lineno)
            if f.attr in ("putenv", "unsetenv") and isinstance(f.value, ast.Name) and f.value.id == "os":
                lines.append(node.lineno)
    return sorted(lines)


def test_the_checker_finds_each_kind_of_write():
    source = (
        "import os\nos.environ['A'] = '1'\nos.environ.setdefault('B', '2')\nos.environ.update(C='3')\n"
        "del os.environ['A']\nos.putenv('D', '4')\nos.environ.pop('B')\nx = os.environ.get('C')\n"
    )
    assert environ_writes(source) == [2, 3, 4, 5, 6, 7]


def test_only_the_child_environment_module_writes_the_environment():
    found = {}
    for path in sorted(p for top in ("service", "model") for p in (ROOT / top).rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel not in ALLOWED and (lines := environ_writes(path.read_text(), rel)):
            found[rel] = lines
    assert found == {}, f"environment writes outside {sorted(ALLOWED)}: {found}"
