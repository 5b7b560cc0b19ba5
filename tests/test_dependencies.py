"""Dependencies point one way (docs/MODULES.md): checked on the source, every import counted (module level,
TYPE_CHECKING blocks and function bodies alike), so a cycle cannot creep back as a "type-only" import.

The packages are read where the installed ones live (`radixcache.worker.__path__` is worker/ in the editable
install), so the module names here are the import names, never a second copy of setup.py's folder mapping."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGES = ("radixcache", "radixcache.worker", "radixcache.client", "radixcache.cluster")

# worker/'s rooms by floor, top first: a room imports its own modules and rooms on lower floors, never a room on
# its own floor or above (cli.py, `radixcache serve`, is the worker's top, then server.py; default_model/ holds data only).
WORKER_FLOORS = (
    ("cli",),
    ("server",),
    ("grpc", "http"),
    ("events", "metrics", "front"),
    ("vllm_metrics",),
    ("engine",),
    ("speculation", "model"),
    ("attention",),
    ("default_model",),
)


def package_root(name: str) -> Path:
    return Path(importlib.import_module(name).__path__[0])


def modules_of(package: str) -> dict[str, Path]:
    """Import name -> source file of every module of `package` and its sub-packages (the generated stubs aside)."""
    root = package_root(package)
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("").parts
        if rel[:1] == ("v1",):
            continue
        found[".".join(p for p in (package, *rel) if p != "__init__")] = path
    return found


def all_modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        found.update(modules_of(package))
    return found


def imports_of(path: Path, own: str = "") -> set[str]:
    """Every radixcache module `path` imports, wherever the import statement sits (relative ones resolved
    against `own`, the module's import name)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = own.split(".")[: -node.level + (1 if path.name == "__init__.py" else 0) or None]
                module = ".".join([*base, *([module] if module else [])])
            if module:
                found.add(module)
                found.update(f"{module}.{a.name}" for a in node.names)  # `from pkg import module`
    return {name for name in found if name == "radixcache" or name.startswith("radixcache.")}


def private_names_imported(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every `from module import _name` in `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        (node.module, a.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("radixcache")
        for a in node.names
        if a.name.startswith("_") and not a.name.startswith("__")
    ]


def graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {name: {m for m in imports_of(path, name) if m in modules and m != name} for name, path in modules.items()}


def cycle_in(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the list of modules around it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def room_of(module: str) -> str:
    """worker/'s room of a radixcache.worker module: its first name below radixcache.worker ("" for the package)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else ""


def floor_of(room: str) -> int:
    for i, rooms in enumerate(WORKER_FLOORS):
        if room in rooms:
            return i
    raise AssertionError(f"worker/{room} is on no floor of WORKER_FLOORS: add it where it belongs")


def upward_or_sideways(module: str, imported: str) -> bool:
    """Whether a worker module importing `imported` breaks the floors."""
    if not imported.startswith("radixcache.worker."):
        return False
    mine, theirs = room_of(module), room_of(imported)
    if not mine or mine == theirs:
        return False
    return floor_of(theirs) <= floor_of(mine)


def test_every_folder_with_modules_is_a_package_and_is_installed() -> None:
    """A folder of modules without __init__.py would be left out of the wheel by find_packages."""
    for package in PACKAGES:
        root = package_root(package)
        for folder in {p.parent for p in root.rglob("*.py")}:
            assert (folder / "__init__.py").exists(), f"{folder} has modules but no __init__.py"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_inside_a_package(package: str) -> None:
    edges = graph(modules_of(package))
    assert cycle_in(edges) is None, " -> ".join(cycle_in(edges) or [])


def test_no_import_cycle_across_the_packages() -> None:
    edges = graph(all_modules())
    assert cycle_in(edges) is None, " -> ".join(cycle_in(edges) or [])


def test_the_cache_package_imports_no_worker_client_or_cluster_code() -> None:
    for name, path in modules_of("radixcache").items():
        if name == "radixcache.cli":  # the one dispatcher; it imports subcommands by name, lazily
            continue
        upward = {m for m in imports_of(path, name) if m.startswith(PACKAGES[1:])}
        assert not upward, f"{name} imports {sorted(upward)}"


def test_the_worker_never_imports_the_cluster_and_the_client_never_imports_the_worker() -> None:
    for name, path in modules_of("radixcache.worker").items():
        assert not {m for m in imports_of(path, name) if m.startswith("radixcache.cluster")}, name
    for name, path in modules_of("radixcache.client").items():
        assert not {m for m in imports_of(path, name) if m.startswith(("radixcache.worker", "radixcache.cluster"))}, (
            name
        )


def test_worker_rooms_import_only_rooms_below_them() -> None:
    broken = [
        f"{name} imports {imported}"
        for name, path in modules_of("radixcache.worker").items()
        for imported in sorted(imports_of(path, name))
        if upward_or_sideways(name, imported)
    ]
    assert not broken, "\n".join(broken)


def test_no_module_imports_another_rooms_private_names() -> None:
    broken = []
    for name, path in all_modules().items():
        for module, private in private_names_imported(path):
            if module.rsplit(".", 1)[0] != name.rsplit(".", 1)[0]:  # a module's own package may share privates
                broken.append(f"{name} imports {module}.{private}")
    assert not broken, "\n".join(broken)


def test_the_cycle_finder_finds_a_cycle() -> None:  # the check above must be able to fail
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle_in({"a": {"b"}, "b": set()}) is None


def test_the_floor_rule_refuses_an_import_up_or_sideways() -> None:  # and so must this one
    assert upward_or_sideways("radixcache.worker.engine.engine", "radixcache.worker.front.validation")
    assert upward_or_sideways("radixcache.worker.grpc.servicer", "radixcache.worker.http.app")
    assert not upward_or_sideways("radixcache.worker.front.core", "radixcache.worker.engine.api")
    assert not upward_or_sideways("radixcache.worker.engine.step", "radixcache.worker.engine.scheduler")
