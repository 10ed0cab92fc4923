"""The package's shape, checked: no import cycle, no private names across modules, no huge
classes, and a protocol that does not need Lightning (fast; reads the source with ``ast``)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "lightning_recover")
MAX_CLASS_LINES = 300
_SOURCES: dict[str, str] = {}


def _modules() -> dict[str, ast.Module]:
    found = {}
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                _SOURCES[dotted] = open(path).read()
                found[dotted] = ast.parse(_SOURCES[dotted], path)
    return found


def _imports(module: str, tree: ast.Module) -> list[tuple[str, list[str]]]:
    """``(imported module, [names])`` for every import, relative ones resolved."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, [alias.name for alias in node.names]))
    return out


def test_no_module_imports_a_private_name_of_another():
    modules = _modules()
    offenders = []
    for module, tree in modules.items():
        for target, names in _imports(module, tree):
            if not target.startswith("lightning_recover"):
                continue
            offenders.extend(f"{module} imports {target}.{n}" for n in names if n.startswith("_"))
        aliases = set()  # names this module binds to one of the package's modules
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_recover"):
                aliases.update(a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in modules)
            elif isinstance(node, ast.Import):
                aliases.update(a.asname for a in node.names if a.asname and a.name in modules)
        for node in ast.walk(tree):  # module._private attribute access on an imported sibling module
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if isinstance(node.value, ast.Name) and node.value.id in aliases:
                    offenders.append(f"{module} uses {node.value.id}.{node.attr}")
    assert not offenders, "\n".join(offenders)


def test_no_class_over_the_size_limit():
    """Counted in lines that hold code or docstrings (blank and comment-only lines do not count, so
    that the formatter's line breaking does not decide the limit)."""
    big = []
    for module, tree in _modules().items():
        source = _SOURCES[module]
        lines = source.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                body = lines[node.lineno - 1 : node.end_lineno]
                size = sum(1 for line in body if line.strip() and not line.strip().startswith("#"))
                if size > MAX_CLASS_LINES:
                    big.append(f"{module}.{node.name}: {size} lines")
    assert not big, "\n".join(big)


def test_no_import_cycle_among_top_level_imports():
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, tree in modules.items():
        for node in tree.body:  # module-level imports only: deferred imports inside functions break cycles
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            graph[module].update(t for t in targets if t in modules and t != module)
    for module in graph:  # a package's __init__ importing its own submodules is not a cycle
        graph[module] = {t for t in graph[module] if not module.startswith(t + ".")}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt) :] + [nxt]))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_protocol_works_without_lightning():
    code = (
        "import sys; sys.modules['lightning'] = None; sys.modules['lightning.fabric'] = None; "
        "import lightning_recover.protocol, lightning_recover.launch.supervisor; "
        "from lightning_recover.protocol import Replica, plan_quotas; "
        "assert not [m for m, v in sys.modules.items() if m.split('.')[0] == 'lightning' and v is not None]"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_strategy_registers_without_importing_lightning_early():
    """``import lightning_recover`` leaves Lightning unimported (the CLI, the launcher and the
    coordinator never use it: its import costs ~4 s per process), and ``strategy="recover"`` is
    registered whichever of the two is imported first."""
    check = (
        "from lightning.fabric.strategies import STRATEGY_REGISTRY; "
        "from lightning.pytorch.strategies import StrategyRegistry; "
        "assert 'recover' in STRATEGY_REGISTRY and 'recover' in StrategyRegistry; "
    )
    ours_first = "import sys, lightning_recover.cli; assert 'lightning' not in sys.modules; import lightning; " + check
    lightning_first = "import lightning.pytorch, lightning_recover; " + check
    for code in (ours_first, lightning_first):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert result.returncode == 0, result.stderr
