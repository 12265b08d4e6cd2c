"""The package's structure: no import cycle (lazy imports inside functions
count: a cycle is a cycle, whenever it is walked), and no module imports a
private name of another module of the package."""
from __future__ import annotations

import ast
import pathlib

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: source folder -> the package it is installed as (pyproject's mapping)
PACKAGES = {"accel_magics": "accel_magics", "kernel_ext": "accel_magics.kernel_ext",
            "widgets": "accel_magics.widgets"}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import in the file."""
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [alias.name for alias in node.names]
            # "from . import x" imports the submodule x
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            out += [(sub, []) for sub in subs]
            out.append((target, [n for n in names if f"{target}.{n}" not in modules]))
    return [(target, names) for target, names in out if target in modules]


def test_no_import_cycle_in_the_package():
    modules = _modules()
    graph = {name: {t for t, _ in _imports(name, path, modules) if t != name} for name, path in modules.items()}
    # a package's __init__ importing its own submodules is how packages are made: not a cycle by itself
    for name in graph:
        graph[name] = {t for t in graph[name] if not (t.startswith(name + ".") and modules[name].name == "__init__.py")}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


def test_no_module_imports_a_private_name_of_another():
    modules = _modules()
    offenders = [f"{name} imports {target}.{n}" for name, path in modules.items()
                 for target, names in _imports(name, path, modules) for n in names
                 if n.startswith("_") and not n.startswith("__") and target != name]
    assert not offenders, "\n".join(offenders)


def test_every_package_folder_is_in_the_wheel():
    """A folder of the package (an ``__init__.py``) missing from pyproject's
    explicit ``packages`` works in an editable install and is absent from the
    wheel a user installs (kernel_ext/doctor was: ``%load_ext`` failed with
    ModuleNotFoundError in the notebook-hosts check)."""
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml")) as f:
        text = f.read()
    listed = set(re.findall(r'"([\w.]+)"', re.search(r"^packages = \[(.*?)\]", text, re.S | re.M).group(1)))
    folders = {"accel_magics": "accel_magics", "kernel_ext": "accel_magics.kernel_ext",
               "widgets": "accel_magics.widgets"}
    found = set()
    for top, name in folders.items():
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            if "__init__.py" in filenames:
                rel = os.path.relpath(dirpath, os.path.join(root, top))
                found.add(name if rel == "." else name + "." + rel.replace(os.sep, "."))
    assert found - listed == set(), f"package folders missing from pyproject's packages: {sorted(found - listed)}"
