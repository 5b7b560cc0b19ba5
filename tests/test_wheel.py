"""The wheel runs: built from a clean copy of the tree, installed into a fresh venv (its dependencies taken from the
project's venv, so no network), it serves `radixcache serve --random-model` and the cluster extra's modules import.

Every other test imports the editable install, which finds modules in the working tree whatever the wheel holds; a
package left out of the wheel (as `radixcache.worker.speculation` once was) only shows here.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import zipfile
from pathlib import Path

import pytest

from radixcache.client import Client

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parent.parent
# Import name -> the folder it is built from (setup.py's FOLDERS).
FOLDERS = {"radixcache": "radixcache", "radixcache.worker": "worker", "radixcache.client": "client",
           "radixcache.cluster": "cluster"}  # fmt: skip
# What a clean checkout lacks: a stale build/lib would put modules into the wheel that setup.py no longer lists.
NOT_COPIED = {".git", ".venv", "build", "dist", ".whl", "gpu-check-out", ".pytest_cache", ".ruff_cache", ".hypothesis"}


def _ignore(folder: str, names: list[str]) -> set[str]:
    skipped = {n for n in names if n == "__pycache__" or n.endswith((".pyc", ".egg-info"))}
    if Path(folder) == ROOT:
        skipped |= NOT_COPIED & set(names)
    if Path(folder) == ROOT / "bench":
        skipped |= {"results"} & set(names)  # llama.cpp builds and bench outputs
    return skipped


class Installed:
    """The wheel's path and the fresh venv it is installed in."""

    def __init__(self, wheel: Path, venv: Path, work: Path) -> None:
        self.wheel, self.venv, self.work = wheel, venv, work
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        self.env.update(VIRTUAL_ENV=str(venv), PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")

    @property
    def radixcache(self) -> str:
        return str(self.venv / "bin" / "radixcache")

    def run(self, *cmd: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        # cwd outside the tree: the source folders must not be importable from the current directory
        return subprocess.run(cmd, cwd=self.work, env=self.env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist, venv, work = tmp / "src", tmp / "dist", tmp / "venv", tmp / "work"
    shutil.copytree(ROOT, src, ignore=_ignore)
    work.mkdir()
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    build = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = dist.glob("radixcache-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    target = str(venv / "bin" / "python")
    install = subprocess.run([*pip, "--python", target, "install", "--no-index", "--no-deps", str(wheel)],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    # The dependencies: the project venv's site-packages, added after the venv's own (a plain path line: the
    # editable install's .pth finder there is not run, so only the wheel can provide radixcache).
    site = Path(subprocess.check_output([target, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())  # fmt: skip
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "zz_project_dependencies.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    return Installed(wheel, venv, work)


def _tree_files() -> dict[str, Path]:
    """Every module of the tree and the default model's files, by the path the wheel gives them."""
    files = {}
    for name, folder in FOLDERS.items():
        for path in (ROOT / folder).rglob("*"):
            rel = path.relative_to(ROOT / folder)
            shipped = path.suffix == ".py" or rel.parts[:1] == ("default_model",)
            if path.is_file() and shipped and "__pycache__" not in rel.parts:
                files["/".join([*name.split("."), *rel.parts])] = path
    return files


def test_the_wheel_holds_every_package_folder_and_module_of_the_tree(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as z:
        names = set(z.namelist())
    packages = {str(Path(n).parent).replace("/", ".") for n in names if n.endswith("/__init__.py")}
    tree = _tree_files()
    tree_packages = {str(Path(n).parent).replace("/", ".") for n in tree if n.endswith("/__init__.py")}
    assert tree_packages - packages == set(), f"packages missing from the wheel: {sorted(tree_packages - packages)}"
    assert set(tree) - names == set(), f"files missing from the wheel: {sorted(set(tree) - names)}"


def test_the_installed_packages_are_the_wheels_not_the_tree(installed: Installed) -> None:
    names = [*FOLDERS, "radixcache.worker.speculation", "radixcache.worker.default_model", "radixcache.cluster.app"]
    code = "import importlib\n" + "".join(f"print(importlib.import_module({n!r}).__file__)\n" for n in names)
    r = installed.run(installed.python, "-c", code)
    assert r.returncode == 0, r.stderr[-3000:]
    files = r.stdout.split()
    assert len(files) == len(names), r.stdout
    for name, file in zip(names, files, strict=True):
        assert Path(file).is_relative_to(installed.venv), f"{name} imported from {file}, not from the wheel's venv"


def test_the_cluster_extras_entry_points_import_from_the_wheel(installed: Installed) -> None:
    r = installed.run(installed.radixcache, "cluster", "--help")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "usage: radixcache cluster" in r.stdout and "--replicas" in r.stdout
    # What Serve loads on each node: the deployments and the request router, with ray itself.
    code = "import ray.serve, radixcache.cluster.app, radixcache.cluster.replica, radixcache.cluster.ingress, " \
           "radixcache.cluster.router; print(radixcache.cluster.replica.__file__)"  # fmt: skip
    r = installed.run(installed.python, "-c", code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert Path(r.stdout.strip()).is_relative_to(installed.venv), r.stdout


def test_the_wheel_serves_a_random_model(installed: Installed) -> None:
    cmd = [installed.radixcache, "serve", "--random-model", "--host", "127.0.0.1", "--port", "0", "--http-port", "0"]
    proc = subprocess.Popen(cmd, cwd=installed.work, env=installed.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()  # stdout's lines, then "" at its end
    assert proc.stdout is not None and proc.stderr is not None
    threading.Thread(target=lambda: [*map(lines.put, proc.stdout), lines.put("")], daemon=True).start()
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    try:
        target = ""
        while not target:
            try:
                line = lines.get(timeout=90)
            except queue.Empty:
                pytest.fail(f"no 'listening on' line in 90 s: {''.join(err)[-3000:]}")
            if not line:
                proc.wait(10)
                pytest.fail(f"the worker exited ({proc.returncode}) before 'listening on': {''.join(err)[-3000:]}")
            if line.startswith("listening on "):
                target = line.split()[-1]
        with Client(target) as c:
            c.wait_ready(30)
            out = c.generate_text("hello", max_tokens=4, ignore_eos=True)
        assert out.completion_tokens == 4, out
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, "".join(err)[-3000:]
