"""Imports point one way: web -> assistant -> {engine, speech}, and no module imports itself back.

Every module's imports are read with ``ast`` (those inside functions too: they run later, but tie
the modules together all the same), so nothing is imported and no dependency needs to be installed.
An import names the module it loads (``from engine.attention import backend`` the submodule,
``from engine.attention import AttentionMetadata`` the package); the parent packages Python loads
on the way are not counted, or every package whose ``__init__`` imports a submodule would be a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("engine", "speech", "assistant", "web")
# The first-party packages each one may not import (the layers above it, and its sibling).
FORBIDDEN = {
    "engine": {"speech", "assistant", "web"},
    "speech": {"engine", "assistant", "web"},
    "assistant": {"web"},
    "web": {"engine", "speech"},
}


def module_files(root: Path) -> dict[str, Path]:
    """Module name -> file for every ``.py`` under the packages (``pkg/__init__.py`` is ``pkg``)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file, at any depth; first-party targets are
    resolved to the module they load, others kept as written."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package, one level up per extra dot
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                found.append((node.lineno, submodule if submodule in modules else target))
    return [(line, nearest_module(target, modules)) for line, target in found]


def nearest_module(name: str, modules: dict[str, Path]) -> str:
    """The longest prefix of a dotted name that is a first-party module (``engine.bench.cli.main``
    -> ``engine.bench.cli``), or the name itself for third-party ones."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return name


def import_graph(root: Path) -> tuple[dict[str, Path], dict[str, list[tuple[int, str]]]]:
    modules = module_files(root)
    return modules, {m: imports_of(m, path, modules) for m, path in modules.items()}


def layer_violations(root: Path) -> list[str]:
    """``file:line imports X`` for each import of a first-party package its layer may not use."""
    modules, graph = import_graph(root)
    bad = []
    for module, imports in graph.items():
        for line, target in imports:
            if target.split(".")[0] in FORBIDDEN[module.split(".")[0]]:
                bad.append(f"{modules[module].relative_to(root)}:{line} imports {target}")
    return bad


def import_cycles(root: Path) -> list[list[str]]:
    """The strongly connected components of more than one module in the first-party import graph
    (Tarjan's algorithm): each is a set of modules that import each other, directly or not."""
    modules, graph = import_graph(root)
    edges = {m: sorted({t for _, t in imports if t in modules and t != m}) for m, imports in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
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
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def test_engine_and_speech_import_nothing_above_them_and_web_only_the_assistant():
    assert layer_violations(REPO) == []


def test_no_modules_import_each_other():
    assert import_cycles(REPO) == []


def test_the_checks_see_imports_inside_functions_relative_imports_and_cycles(tmp_path):
    """The checks on a made-up tree: each kind of import they must catch, caught."""
    files = {
        "engine/__init__.py": "",
        "engine/core.py": "def f():\n    from assistant import models\n",
        "engine/a.py": "from engine.b import x\n",
        "engine/b.py": "from . import c\n",
        "engine/c.py": "import engine.a\n",
        "speech/__init__.py": "import engine.core\n",
        "assistant/__init__.py": "",
        "assistant/models.py": "import json\n",
        "web/__init__.py": "from assistant import models\nfrom speech import y\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert layer_violations(tmp_path) == [
        "engine/core.py:2 imports assistant.models",
        "speech/__init__.py:1 imports engine.core",
        "web/__init__.py:2 imports speech",
    ]
    assert import_cycles(tmp_path) == [["engine.a", "engine.b", "engine.c"]]
