"""`make lint`'s type check: mypy over the modules pyproject.toml's [tool.mypy] `files` names, as they import.

The code imports worker/ as `radixcache.worker` (and client/, cluster/ likewise): setup.py's FOLDERS maps those
folders under the package, and an editable install resolves them with an import hook that mypy cannot follow. So this
first lays the installed layout out as links under build/typecheck/ (radixcache/'s entries, plus worker/, client/ and
cluster/ inside it, read from setup.py's FOLDERS), runs mypy there (pyproject's mypy_path and files point into it),
and reports every path as the file in the repository. Exit status: mypy's.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = Path("build/typecheck")  # relative to ROOT, as pyproject's mypy_path and files are


def folders() -> dict[str, str]:
    """setup.py's FOLDERS (import name -> folder), read without running setup()."""
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "FOLDERS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit("setup.py has no FOLDERS mapping")


def link_tree(mapping: dict[str, str]) -> dict[str, str]:
    """Lay the packages out under TREE as they install; returns linked prefix -> repository prefix."""
    shutil.rmtree(ROOT / TREE, ignore_errors=True)
    prefixes = {}
    for name, folder in mapping.items():
        place = ROOT / TREE / name.replace(".", "/")
        if "." not in name:  # the top package: a real folder, so the mapped ones can go inside it
            place.mkdir(parents=True)
            for entry in (ROOT / folder).iterdir():
                if entry.name != "__pycache__":
                    (place / entry.name).symlink_to(entry)
        else:
            place.symlink_to(ROOT / folder, target_is_directory=True)
        prefixes[f"{TREE / name.replace('.', '/')}/"] = f"{folder}/"
    return prefixes


def main() -> int:
    prefixes = link_tree(folders())
    run = subprocess.run([sys.executable, "-m", "mypy", *sys.argv[1:]], cwd=ROOT, capture_output=True, text=True)
    longest_first = sorted(prefixes, key=len, reverse=True)
    for line in (run.stdout + run.stderr).splitlines():
        for linked in longest_first:
            if line.startswith(linked):
                line = prefixes[linked] + line[len(linked) :]
                break
        print(line)
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
