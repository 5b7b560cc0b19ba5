"""Dependencies point one way (docs/MODULES.md): checked on the source, every import counted (module level,
TYPE_CHECKING blocks and function bodies alike), so a cycle cannot creep back as a "type-only" import."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Import name -> source folder (pyproject's package-dir).
PACKAGES = {"radixcache": "radixcache", "radixcache.worker": "worker", "radixcache.client": "client",
            "radixcache.cluster": "cluster"}  # fmt: skip


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    for name, folder in sorted(PACKAGES.items(), key=lambda kv: -len(kv[0])):
        if rel.parts[0] == folder:
            parts = [name, *rel.with_suffix("").parts[1:]]
            return ".".join(p for p in parts if p != "__init__")
    raise AssertionError(path)


def imports_of(path: Path) -> set[str]:
    """Every radixcache module `path` imports, wherever the import statement sits."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import module`
    return {name for name in found if name == "radixcache" or name.startswith("radixcache.")}


def source_files(folder: str) -> list[Path]:
    return [p for p in sorted((ROOT / folder).rglob("*.py")) if "v1" not in p.relative_to(ROOT).parts]


def graph(folder: str) -> dict[str, set[str]]:
    modules = {module_name(p): p for p in source_files(folder)}
    return {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}


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


def test_the_cache_package_imports_no_worker_client_or_cluster_code() -> None:
    for path in source_files("radixcache"):
        if path.name == "cli.py":  # the one dispatcher; it imports subcommands by name, lazily
            continue
        upward = {m for m in imports_of(path) if m.startswith(("radixcache.worker", "radixcache.client",
                                                               "radixcache.cluster"))}  # fmt: skip
        assert not upward, f"{path.relative_to(ROOT)} imports {sorted(upward)}"


def test_the_cache_modules_import_each_other_without_a_cycle() -> None:
    assert cycle_in(graph("radixcache")) is None, " -> ".join(cycle_in(graph("radixcache")) or [])


def test_the_worker_never_imports_the_cluster_and_the_client_never_imports_the_worker() -> None:
    for path in source_files("worker"):
        assert not {m for m in imports_of(path) if m.startswith("radixcache.cluster")}, path
    for path in source_files("client"):
        assert not {m for m in imports_of(path) if m.startswith(("radixcache.worker", "radixcache.cluster"))}, path


def test_the_cycle_finder_finds_a_cycle() -> None:  # the check above must be able to fail
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle_in({"a": {"b"}, "b": set()}) is None
