"""The package's shape, checked (fast; reads the source with ``ast``): no import cycle of any kind
(imports inside functions count), lazy imports only where listed with their reason, no private names
across modules, no huge classes or functions, no two modules of the same name, benchmarks out of the
product, and a protocol and a checkpoint engine that do not need Lightning."""

from __future__ import annotations

import ast
import collections
import functools
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "lightning_recover")
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 100
_SOURCES: dict[str, str] = {}
# Every node of a module's tree in ast.walk's order, and those inside a function (a def's own node and all
# below it), listed once when the trees are parsed: walking the package's trees again in every test cost
# ~0.35 s of CPU per walk (~2.5 s per run of this file).
_NODES: dict[str, list[ast.AST]] = {}
_IN_FUNCTIONS: dict[str, list[ast.AST]] = {}

# Modules that import package modules inside functions, and why. A lazy import is for start-up cost or an
# optional dependency, never to hide a cycle: the graph of test_no_import_cycle counts these imports too.
LAZY_IMPORTS = {
    "lightning_recover": "registers the strategies when Lightning is imported, not before (its import costs ~4 s)",
    "lightning_recover.cli": "each subcommand imports only what it runs (--help and the launcher stay fast)",
    "lightning_recover.demo": "the launcher side of the demo does not import the model or Lightning",
    "lightning_recover.protocol.replica": "a replica of one process needs no device mesh (replica_world)",
    "lightning_recover.lightning.base": "only the process that launches imports the launcher",
    "lightning_recover.lightning.fabric": "DCP and the spread save only for sharded saves and loads",
    "lightning_recover.lightning.trainer": "the checkpoint plugin imports lightning.pytorch, built only when asked for",
    "lightning_recover.lightning.trainer_checkpoint": "the spread save only for sharded saves",
    "lightning_recover.bench.async_checkpoint": "each method imports what it measures, when it runs",
    "lightning_recover.bench.checkpoint": "each method imports what it measures, when it runs",
    "lightning_recover.bench.dcp_ranks": "each method imports what it measures, when it runs",
    "lightning_recover.bench.resilience_train": "each mode imports what it runs",
    "lightning_recover.control_plane.config": "the etcd client and store only once an etcd:// address is given",
    "lightning_recover.control_plane.etcd_cluster": "the client only to wait for a started cluster's health",
}


@functools.lru_cache(maxsize=1)  # parsed once for all the tests here (the trees are only read)
def _modules() -> dict[str, ast.Module]:
    found = {}
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                _SOURCES[dotted] = open(path).read()
                found[dotted] = ast.parse(_SOURCES[dotted], path)
                _NODES[dotted], _IN_FUNCTIONS[dotted] = _walk(found[dotted])
    return found


def _walk(tree: ast.AST) -> tuple[list[ast.AST], list[ast.AST]]:
    """``list(ast.walk(tree))`` (the same breadth-first order), and the nodes of it that are a function
    definition or inside one."""
    nodes: list[ast.AST] = []
    in_functions: list[ast.AST] = []
    todo = collections.deque([(tree, False)])
    while todo:
        node, inside = todo.popleft()
        inside = inside or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        todo.extend((child, inside) for child in ast.iter_child_nodes(node))
        nodes.append(node)
        if inside:
            in_functions.append(node)
    return nodes, in_functions


def _targets(node: ast.AST, module: str, modules: dict) -> list[str]:
    """The package's modules an import statement loads (a package's own ``__init__`` excluded)."""
    if isinstance(node, ast.Import):
        found = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
        found = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    else:
        return []
    return [t for t in found if t in modules and t != module and not module.startswith(t + ".")]


def _lazy_imports(module: str, modules: dict) -> set[str]:
    """Package modules imported inside a function of ``module``."""
    out = set()
    for node in _IN_FUNCTIONS[module]:
        out.update(_targets(node, module, modules))
    return out


def _size(lines: list[str], node: ast.AST) -> int:
    """Lines that hold code or docstrings (blank and comment-only lines do not count, so that the
    formatter's line breaking does not decide a limit)."""
    body = lines[node.lineno - 1 : node.end_lineno]
    return sum(1 for line in body if line.strip() and not line.strip().startswith("#"))


def _imports(module: str) -> list[tuple[str, list[str]]]:
    """``(imported module, [names])`` for every import, relative ones resolved."""
    out = []
    for node in _NODES[module]:
        if isinstance(node, ast.Import):
            out.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, [alias.name for alias in node.names]))
    return out


def test_no_module_imports_a_private_name_of_another():
    modules = _modules()
    offenders = []
    for module in modules:
        for target, names in _imports(module):
            if not target.startswith("lightning_recover"):
                continue
            offenders.extend(f"{module} imports {target}.{n}" for n in names if n.startswith("_"))
        aliases = set()  # names this module binds to one of the package's modules
        for node in _NODES[module]:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_recover"):
                aliases.update(a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in modules)
            elif isinstance(node, ast.Import):
                aliases.update(a.asname for a in node.names if a.asname and a.name in modules)
        for node in _NODES[module]:  # module._private attribute access on an imported sibling module
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if isinstance(node.value, ast.Name) and node.value.id in aliases:
                    offenders.append(f"{module} uses {node.value.id}.{node.attr}")
    assert not offenders, "\n".join(offenders)


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _is_private(dotted: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in dotted.split(".")[1:])


def test_private_upstream_names_are_listed_with_their_reason():
    """A private torch or Lightning name used by the package is in upstream_private.PRIVATE_NAMES (or under one
    listed there), where tests/unit/test_upstream_private.py checks it against the installed versions."""
    from lightning_recover.upstream_private import PRIVATE_NAMES

    def listed(dotted: str) -> bool:
        # a listed name, a use under one (torch._C.X.y), or a part of one's chain (torch._C of torch._C.X)
        return any(
            dotted == key or dotted.startswith(key + ".") or key.startswith(dotted + ".") for key in PRIVATE_NAMES
        )

    unlisted = []
    for module in _modules():
        used = set()
        for node in _NODES[module]:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("torch", "lightning"):
                used.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Attribute):
                dotted = _dotted(node)
                if dotted and dotted.split(".")[0] in ("torch", "lightning"):
                    used.add(dotted)
        unlisted.extend(f"{module}: {d}" for d in sorted(used) if _is_private(d) and not listed(d))
    assert not unlisted, "list these in lightning_recover/upstream_private.py with why:\n" + "\n".join(unlisted)


def test_no_class_over_the_size_limit():
    """Counted in lines that hold code or docstrings (blank and comment-only lines do not count, so
    that the formatter's line breaking does not decide the limit)."""
    big = []
    for module in _modules():
        source = _SOURCES[module]
        lines = source.splitlines()
        for node in _NODES[module]:
            if isinstance(node, ast.ClassDef):
                size = _size(lines, node)
                if size > MAX_CLASS_LINES:
                    big.append(f"{module}.{node.name}: {size} lines")
    assert not big, "\n".join(big)


# Module-level functions of protocol/ whose first parameter is a Membership, and why. A function that reads and
# writes a Membership's state is a method of it, or of a part it owns: moving it out of the class only to fit
# MAX_CLASS_LINES hides the class's size instead of splitting it.
MEMBERSHIP_FIRST = {
    "lightning_recover.protocol.decisions.commit_protocol": "a factory: picks the commit protocol's class",
}


def test_no_protocol_function_takes_a_membership_first():
    """Counted: a first positional parameter annotated ``Membership``, or named ``membership`` or ``group`` (the
    name a Membership had, annotated ``Any``)."""
    offenders = []
    for module, tree in _modules().items():
        if not module.startswith("lightning_recover.protocol."):
            continue
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            positional = [*node.args.posonlyargs, *node.args.args]
            if not positional:
                continue
            first = positional[0]
            annotation = ast.unparse(first.annotation) if first.annotation is not None else ""
            if "Membership" in annotation or first.arg in ("membership", "group"):
                offenders.append(f"{module}.{node.name}")
    unlisted = sorted(set(offenders) - set(MEMBERSHIP_FIRST))
    stale = sorted(set(MEMBERSHIP_FIRST) - set(offenders))
    assert not unlisted, "make these methods of Membership or of a part it owns:\n" + "\n".join(unlisted)
    assert not stale, f"MEMBERSHIP_FIRST lists functions that no longer take a Membership first: {stale}"


def test_no_protocol_class_is_a_base_that_only_holds_methods_of_its_subclass():
    """A base class that declares its subclass's attributes (bare annotations, no dataclass) only holds methods
    moved out of that subclass to fit MAX_CLASS_LINES: split such a class into parts it owns instead."""
    declaring: dict[str, str] = {}  # class name -> module, for protocol/ classes declaring attributes they never set
    classes: list[tuple[str, ast.ClassDef]] = []
    for module, tree in _modules().items():
        if not module.startswith("lightning_recover.protocol."):
            continue
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                classes.append((module, node))
                bare = [n for n in node.body if isinstance(n, ast.AnnAssign) and n.value is None]
                if bare and not node.decorator_list and not node.bases:
                    declaring[node.name] = module
    offenders = [
        f"{module}.{node.name} extends {ast.unparse(base)}"
        for module, node in classes
        for base in node.bases
        if ast.unparse(base).split(".")[-1] in declaring
    ]
    assert not offenders, "\n".join(offenders)


def test_no_function_over_the_size_limit():
    """Counted as classes are; a longer function is several jobs (split it into named steps)."""
    big = []
    for module in _modules():
        lines = _SOURCES[module].splitlines()
        for node in _NODES[module]:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _size(lines, node) > MAX_FUNCTION_LINES:
                big.append(f"{module}.{node.name}: {_size(lines, node)} lines")
    assert not big, "\n".join(big)


def test_no_import_cycle():
    """Every import counts, the ones inside functions too: a deferred import does not make a cycle
    go away, it only moves the failure to run time."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module in modules:
        for node in _NODES[module]:
            graph[module].update(_targets(node, module, modules))
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


def test_lazy_imports_are_listed_with_their_reason():
    modules = _modules()
    lazy = {m for m in modules if _lazy_imports(m, modules)}
    unlisted = sorted(lazy - set(LAZY_IMPORTS))
    stale = sorted(set(LAZY_IMPORTS) - lazy)
    assert not unlisted, f"imports inside functions, not in LAZY_IMPORTS (import at the top, or list why): {unlisted}"
    assert not stale, f"LAZY_IMPORTS lists modules without lazy imports: {stale}"


def test_no_two_modules_share_a_name():
    names: dict[str, list[str]] = {}
    for module in _modules():
        if not os.path.exists(os.path.join(ROOT, *module.split(".")) + ".py"):
            continue  # a package (its __init__)
        names.setdefault(module.rsplit(".", 1)[-1], []).append(module)
    shared = {n: ms for n, ms in names.items() if len(ms) > 1}
    assert not shared, shared


def test_every_package_is_in_the_wheel():
    """pyproject.toml lists the packages one by one: a new subpackage must be listed, or the wheel lacks it."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    packages = {m for m in _modules() if os.path.exists(os.path.join(ROOT, *m.split("."), "__init__.py"))}
    assert packages <= listed, sorted(packages - listed)


def test_benchmarks_stay_out_of_the_product():
    """The research benchmarks (repo-root ``benchmarks/``) are not installed: nothing in the package
    imports them, and only the CLI and the user-facing benches themselves import ``bench``."""
    offenders = []
    for module in _modules():
        for target, _ in _imports(module):
            if target == "benchmarks" or target.startswith("benchmarks."):
                offenders.append(f"{module} imports {target}")
            elif target.startswith("lightning_recover.bench") and not (
                module.startswith("lightning_recover.bench") or module == "lightning_recover.cli"
            ):
                offenders.append(f"{module} imports {target}")
    assert not offenders, "\n".join(offenders)


LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")
# what test_protocol_works_without_lightning imports in a fresh interpreter (and the checkpoint package's modules)
WITHOUT_LIGHTNING = (
    "lightning_recover.protocol",
    "lightning_recover.protocol.replica",  # the package's __init__ imports its public names on first use
    "lightning_recover.launch.supervisor",
    "lightning_recover.launch.commands",
)


def _imports_at_import_time(tree: ast.AST) -> list[ast.AST]:
    """The import statements that run when the module is imported: not those inside a function, nor under
    ``if TYPE_CHECKING:``."""
    out: list[ast.AST] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.extend(_imports_at_import_time(ast.Module(body=node.orelse, type_ignores=[])))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        else:
            out.extend(_imports_at_import_time(node))
    return out


def test_no_lightning_import_reachable_from_the_core():
    """The static half of test_protocol_works_without_lightning (which runs in the slow suite: a fresh
    interpreter): no module that importing the protocol, the launcher or any checkpoint module loads (its
    packages' ``__init__`` included) imports Lightning when it is imported."""
    modules = _modules()
    todo = [*WITHOUT_LIGHTNING, *(m for m in modules if m.startswith("lightning_recover.checkpoint"))]
    seen: set[str] = set()
    offenders = []
    while todo:
        module = todo.pop()
        parts = module.split(".")
        for parent in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):  # packages run their __init__
            if parent in modules and parent not in seen:
                seen.add(parent)
                for node in _imports_at_import_time(modules[parent]):
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                    offenders.extend(f"{parent} imports {n}" for n in names if n.split(".")[0] in LIGHTNING)
                    todo.extend(_targets(node, parent, modules))
    assert "lightning_recover.checkpoint.file.single_file" in seen and "lightning_recover.protocol.replica" in seen
    assert not offenders, "\n".join(offenders)


def test_no_lab_notebook_in_the_product():
    """Issue, session and stop numbers belong in commit messages and benchmarks/LOG.md, not in the product."""
    import re

    pattern = re.compile(r"\b(?:[Ii]ssue|[Ss]ession|[Ss]top) #?\d+|\bissue #\d+")
    found = []
    for directory in (PACKAGE, os.path.join(ROOT, "native_io")):
        for base, _, files in os.walk(directory):
            for name in files:
                if name.endswith((".py", ".c", ".h", ".pyi")):
                    path = os.path.join(base, name)
                    for number, line in enumerate(open(path, encoding="utf-8"), 1):
                        if pattern.search(line):
                            found.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_unit_tier_starts_no_process_and_waits_on_no_clock():
    """tests/unit holds logic only: no subprocess or multiprocessing import, no time.sleep (its conftest also
    fails a unit test that starts a process)."""
    unit = os.path.join(ROOT, "tests", "unit")
    offenders = []
    for name in sorted(os.listdir(unit)):
        if name.startswith("test_") and name.endswith(".py"):
            tree = ast.parse(open(os.path.join(unit, name)).read())
            for node in ast.walk(tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                    offenders += [
                        f"{name}:{node.lineno} imports {n}" for n in names if n in ("subprocess", "multiprocessing")
                    ]
                elif isinstance(node, ast.Attribute) and node.attr == "sleep" and _dotted(node) == "time.sleep":
                    offenders.append(f"{name}:{node.lineno} calls time.sleep")
    assert not offenders, "\n".join(offenders)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of ``tree``'s module, classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def test_the_protocol_asks_the_control_plane_through_its_seam():
    """protocol/ calls its store through ``protocol.backend.ControlPlane`` only: no probing of what a store has
    (``getattr``/``hasattr``), no branch on a backend's name or address (an ``etcd`` string in the code), no
    ``watched`` flag: what differs between the embedded coordinator and etcd lives in the two backends, and the
    capabilities that change how a round or a commit runs are the interface's named attributes."""
    offenders = []
    for module, tree in _modules().items():
        if not module.startswith("lightning_recover.protocol."):
            continue
        docstrings = _docstrings(tree)
        for node in _NODES[module]:
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
            ):
                subject = ast.unparse(node.args[0]) if node.args else ""
                if "store" in subject or subject.endswith("raw"):
                    offenders.append(f"{module}:{node.lineno} probes {subject} with {node.func.id}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if "etcd" in node.value.split("://")[0].lower() and node.value.lower().startswith("etcd"):
                    offenders.append(f"{module}:{node.lineno} names a backend: {node.value!r}")
            elif isinstance(node, ast.Attribute) and node.attr in ("watched", "transactional"):
                offenders.append(f"{module}:{node.lineno} branches on .{node.attr}")
    assert not offenders, "\n".join(offenders)
