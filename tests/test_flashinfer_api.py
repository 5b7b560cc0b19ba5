"""Our FlashInfer calls, checked against the installed flashinfer-python's own source.

The FlashInfer path runs only on a GPU, and its CPU stand-in (tests/fake_flashinfer.py) was written from reading one
release. Here the real package's wrapper classes are read with `ast` (flashinfer is never imported: it needs CUDA
and its CUDA dependencies, which `make setup` leaves out by installing it with --no-deps), and:

- every call our code makes to a wrapper's constructor, plan() and run() (collected with ast from the backend and
  scripts/gpu_check.py, not listed here) passes only keywords the real signature accepts, no more positional
  arguments than it has named positional parameters, and every parameter it requires;
- the fake's constructors, plan() and run() take their positional parameters in the real order under the real
  names, nothing the real does not accept, everything the real requires, and the real defaults (what a call that
  leaves a parameter out means).

A release that renames, reorders or removes one of them fails here, not on a user's GPU. The version read is the one
the Makefile pins, and pyproject's `cuda` extra admits it.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BACKEND = ROOT / "worker" / "attention" / "flashinfer_backend.py"
MLA_BACKEND = ROOT / "worker" / "attention" / "flashinfer_mla_backend.py"
CALLERS = [BACKEND, MLA_BACKEND, ROOT / "scripts" / "gpu_check.py"]
FAKE = ROOT / "tests" / "fake_flashinfer.py"
PAGED = ("BatchPrefillWithPagedKVCacheWrapper", "BatchDecodeWithPagedKVCacheWrapper")
MLA = "BatchMLAPagedAttentionWrapper"  # flashinfer/mla/_core.py, exported as flashinfer.BatchMLAPagedAttentionWrapper
WRAPPERS = (*PAGED, MLA)
METHODS = ("__init__", "plan", "run")


# --- the real package's signatures ------------------------------------------------------------------------------
@dataclass
class Signature:
    """What a method accepts: its named positional parameters in order (self left out), every name it takes by
    keyword, the names it requires, and the source text of each default."""

    where: str
    positional: list[str]
    keywords: set[str]
    required: set[str]
    defaults: dict[str, str] = field(default_factory=dict)


def package_dir() -> Path:
    """The installed flashinfer package's folder, found without importing it."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("flashinfer-python is not installed: `make setup` installs the pinned release with --no-deps")
    return Path(next(iter(spec.submodule_search_locations)))


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def find_class(
    package: Path, module: Path, name: str, depth: int = 0, *, required: bool = True
) -> tuple[ast.ClassDef, Path] | None:
    """The class `name` as `module` exports it: defined there, or followed through its `from .x import name` (or a
    `from .x import *`, as flashinfer/mla/__init__.py re-exports _core's names)."""
    tree = parse(module)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node, module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level >= 1 and depth < 4:
            for alias in node.names:
                if (alias.asname or alias.name) in (name, "*"):
                    base = module.parent
                    for _ in range(node.level - 1):
                        base = base.parent
                    target = base.joinpath(*(node.module or "").split("."))
                    file = target / "__init__.py" if target.is_dir() else target.with_suffix(".py")
                    star = alias.name == "*"
                    found = find_class(package, file, name if star else alias.name, depth + 1, required=not star)
                    if found is not None:
                        return found
    if not required:
        return None
    pytest.fail(f"{name} is not in {module.relative_to(package.parent)}: the installed flashinfer has no such wrapper")


def method_of(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    """The implementation of `name` in the class body (typing overloads left out)."""
    found = None
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            if not any(ast.unparse(d).endswith("overload") for d in node.decorator_list):
                found = node
    return found


def signature(cls: ast.ClassDef, func: ast.FunctionDef, where: str, depth: int = 0) -> Signature:
    """The signature of `func`; a **kwargs it forwards to another method of the class (as 0.6.x's decode plan()
    forwards to _plan_impl) accepts and requires what that method does."""
    a = func.args
    params = [*a.posonlyargs, *a.args]
    if params and params[0].arg in ("self", "cls"):
        params = params[1:]
    positional = [p.arg for p in params]
    offset = len(params) - len(a.defaults)
    defaults = {p.arg: ast.unparse(d) for p, d in zip(params[offset:], a.defaults, strict=True)}
    defaults |= {p.arg: ast.unparse(d) for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None}
    keywords = {p.arg for p in a.args if p.arg not in ("self", "cls")} | {p.arg for p in a.kwonlyargs}
    required = {n for n in positional if n not in defaults} | {p.arg for p in a.kwonlyargs if p.arg not in defaults}
    sig = Signature(where, positional, keywords, required, defaults)
    if a.kwarg is None:
        return sig
    forwarded = False
    for node in ast.walk(func):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if not any(k.arg is None and ast.unparse(k.value) == a.kwarg.arg for k in node.keywords):
            continue
        target = method_of(cls, node.func.attr) if ast.unparse(node.func.value) == "self" else None
        if target is None or depth > 3:
            continue
        inner = signature(cls, target, f"{where} -> {target.name}", depth + 1)
        bound = set(inner.positional[: len(node.args)]) | {k.arg for k in node.keywords if k.arg}
        sig.keywords |= inner.keywords - bound
        sig.required |= inner.required - bound
        sig.defaults |= {k: v for k, v in inner.defaults.items() if k not in bound}
        forwarded = True
    if not forwarded:
        pytest.fail(f"{where} takes **{a.kwarg.arg} and forwards it nowhere this test can read")
    return sig


def real_signatures() -> dict[tuple[str, str], Signature]:
    package = package_dir()
    out = {}
    for name in WRAPPERS:
        found = find_class(package, package / "__init__.py", name)
        assert found is not None
        cls, file = found
        for m in METHODS:
            func = method_of(cls, m)
            assert func is not None, f"flashinfer's {name} has no {m}()"
            out[name, m] = signature(cls, func, f"flashinfer {name}.{m} ({file.relative_to(package.parent)})")
    return out


@pytest.fixture(scope="module")
def real() -> dict[tuple[str, str], Signature]:
    return real_signatures()


# --- our calls ---------------------------------------------------------------------------------------------------
@dataclass
class Call:
    where: str
    classes: set[str]
    method: str
    positional: int
    keywords: list[str]


class Unreadable(Exception):
    """A call whose arguments this test cannot count: write it more plainly (or teach the test)."""


def wrapper_attributes(tree: ast.Module) -> dict[str, set[str]]:
    """self.<attr> (or self.<attr>[key]) -> the wrapper classes constructed into it."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            if isinstance(func, ast.Attribute) and func.attr in WRAPPERS:
                for target in node.targets:
                    while isinstance(target, ast.Subscript):
                        target = target.value
                    if isinstance(target, ast.Attribute):
                        out.setdefault(target.attr, set()).add(func.attr)
    return out


def bindings(func: ast.AST) -> dict[str, list[ast.expr]]:
    """Local name -> every expression assigned to it in the function."""
    out: dict[str, list[ast.expr]] = {}
    for node in ast.walk(func):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out.setdefault(target.id, []).append(node.value)
    return out


def receiver_classes(expr: ast.AST, local: dict, attrs: dict[str, set[str]], seen: frozenset = frozenset()) -> set[str]:
    """The wrapper classes an expression can be: it names a wrapper attribute (self._prefill, or the string
    "_prefill" given to getattr), directly or through local names assigned in the same function."""
    found: set[str] = set()
    for node in ast.walk(expr):
        if isinstance(node, ast.Attribute) and node.attr in attrs:
            found |= attrs[node.attr]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in attrs:
            found |= attrs[node.value]
        elif isinstance(node, ast.Name) and node.id in local and node.id not in seen:
            for value in local[node.id]:
                found |= receiver_classes(value, local, attrs, seen | {node.id})
    return found


def literal_length(expr: ast.expr, local: dict) -> int:
    if isinstance(expr, ast.Name) and len(local.get(expr.id, [])) == 1:
        expr = local[expr.id][0]
    if isinstance(expr, ast.Tuple | ast.List) and not any(isinstance(e, ast.Starred) for e in expr.elts):
        return len(expr.elts)
    raise Unreadable(f"*{ast.unparse(expr)}: not a tuple written out in the same function")


def mapping_keys(expr: ast.expr, local: dict) -> list[str]:
    """The keys of a **mapping: a dict(...) call or a dict display with string keys, either branch of a ternary."""
    if isinstance(expr, ast.Name) and len(local.get(expr.id, [])) == 1:
        return mapping_keys(local[expr.id][0], local)
    if isinstance(expr, ast.IfExp):
        return mapping_keys(expr.body, local) + mapping_keys(expr.orelse, local)
    if isinstance(expr, ast.Call) and ast.unparse(expr.func) == "dict" and not expr.args:
        keys = [k.arg for k in expr.keywords]
        if None not in keys:
            return keys  # type: ignore[return-value]
    if isinstance(expr, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in expr.keys):
        return [k.value for k in expr.keys]  # type: ignore[union-attr]
    raise Unreadable(f"**{ast.unparse(expr)}: not a dict with literal keys in the same function")


def calls_in(source: str, name: str, known: dict[str, set[str]] | None = None) -> list[Call]:
    """Every wrapper constructor, plan() and run() call in a file, with what it passes. `known`: wrapper attributes
    the backends define (scripts/gpu_check.py reaches a backend's wrappers through getattr(backend, "_prefill"))."""
    tree = ast.parse(source)
    attrs = {**(known or {}), **wrapper_attributes(tree)}
    out = []
    for func in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
        local = bindings(func)
        for node in ast.walk(func):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr in WRAPPERS:
                classes, method = {node.func.attr}, "__init__"
            elif node.func.attr in ("plan", "run"):
                classes, method = receiver_classes(node.func.value, local, attrs), node.func.attr
                if not classes:
                    continue  # not a wrapper (asyncio.run, ...)
            else:
                continue
            where = f"{name}:{node.lineno} {ast.unparse(node)[:80]}"
            positional = 0
            for arg in node.args:
                positional += literal_length(arg.value, local) if isinstance(arg, ast.Starred) else 1
            keywords = []
            for kw in node.keywords:
                keywords += [kw.arg] if kw.arg else mapping_keys(kw.value, local)
            out.append(Call(where, classes, method, positional, keywords))
    return out


def problems(call: Call, real: dict[tuple[str, str], Signature]) -> list[str]:
    out = []
    for cls in sorted(call.classes):
        sig = real[cls, call.method]
        if call.positional > len(sig.positional):
            out.append(f"{call.where}: {call.positional} positional arguments, {sig.where} names {len(sig.positional)}")
        bound = set(sig.positional[: call.positional])
        for kw in call.keywords:
            if kw not in sig.keywords:
                out.append(f"{call.where}: keyword {kw!r} is not a parameter of {sig.where}")
            elif kw in bound:
                out.append(f"{call.where}: {kw!r} is given positionally and by keyword ({sig.where})")
        missing = sig.required - bound - set(call.keywords)
        if missing:
            out.append(f"{call.where}: {sig.where} requires {sorted(missing)}")
    return out


def backend_attributes() -> dict[str, set[str]]:
    """The backends' wrapper attributes (self._prefill, self._wrapper, ...) -> the classes held there."""
    out: dict[str, set[str]] = {}
    for path in (BACKEND, MLA_BACKEND):
        for attr, classes in wrapper_attributes(parse(path)).items():
            out.setdefault(attr, set()).update(classes)
    return out


def our_calls() -> list[Call]:
    known = backend_attributes()
    return [
        c
        for path in CALLERS
        for c in calls_in(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix(), known)
    ]


def test_gpu_checks_own_kernel_reruns_are_collected_too() -> None:
    """scripts/gpu_check.py reruns the planned kernels into a NaN buffer through the backends' wrapper attributes:
    those run() calls are checked as well (the paged wrappers' and the MLA wrapper's)."""
    script = ROOT / "scripts" / "gpu_check.py"
    calls = calls_in(script.read_text(encoding="utf-8"), "gpu_check", backend_attributes())
    kinds = {(cls, c.method) for c in calls for cls in c.classes}
    assert {(w, "run") for w in WRAPPERS} <= kinds, sorted(kinds)


@pytest.mark.parametrize(("path", "wrappers"), [(BACKEND, PAGED), (MLA_BACKEND, (MLA,))])
def test_the_calls_are_collected_from_our_code(path: Path, wrappers: tuple[str, ...]) -> None:
    """The collector finds every kind of call each backend makes (so the next test cannot pass on nothing)."""
    backend = calls_in(path.read_text(encoding="utf-8"), "backend")
    kinds = {(cls, c.method) for c in backend for cls in c.classes}
    assert kinds == {(w, m) for w in wrappers for m in METHODS}, sorted(kinds)


def test_the_mla_wrapper_is_read_from_its_real_source(real) -> None:  # noqa: ANN001
    """flashinfer.BatchMLAPagedAttentionWrapper is found through flashinfer/mla's star import, with the plan() and
    run() the MLA backend relies on: plan() with no defaults for causal / sm_scale / the dtypes, run() taking the
    two caches as separate tensors and an `out`."""
    plan, run = real[MLA, "plan"], real[MLA, "run"]
    assert "mla" in plan.where
    assert plan.positional[:12] == [
        "qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr", "num_heads", "head_dim_ckv", "head_dim_kpe",
        "page_size", "causal", "sm_scale", "q_data_type", "kv_data_type",
    ]  # fmt: skip
    assert {"causal", "sm_scale", "q_data_type", "kv_data_type"} <= plan.required
    assert run.positional[:5] == ["q_nope", "q_pe", "ckv_cache", "kpe_cache", "out"]


def test_our_calls_fit_the_installed_flashinfer(real) -> None:  # noqa: ANN001
    found = [p for call in our_calls() for p in problems(call, real)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("window_left=-1 if window is None", "left_window=-1 if window is None"),  # a renamed keyword in **common
        ("causal=True, **common", "is_causal=True, **common"),  # a renamed keyword
        ('"NHD", backend="fa2"', '"NHD", kernel_backend="fa2"'),  # a constructor keyword
        ("k_scale=layer.k_scale", "key_scale=layer.k_scale"),  # a run() keyword
        ("last_len, *geometry, **common", "last_len, *geometry, 1.0, **common"),  # one positional too many
    ],
)
def test_a_changed_call_in_the_backend_is_caught(real, old: str, new: str) -> None:  # noqa: ANN001
    source = BACKEND.read_text(encoding="utf-8")
    assert old in source, f"the backend no longer has {old!r}: update this test's mutation"
    found = [p for call in calls_in(source.replace(old, new), "backend") for p in problems(call, real)]
    assert found, f"renaming {old!r} to {new!r} went unnoticed"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("causal=True, sm_scale=", "is_causal=True, sm_scale="),  # a renamed plan() keyword
        ("kv_data_type=self.kv_dtype,", "kv_dtype=self.kv_dtype,"),
        ("causal=True, sm_scale=self.sm_scale, ", ""),  # required parameters left out
        ("q_pe, ckv, kpe, out=out)", "q_pe, ckv, kpe, output=out)"),  # a run() keyword
        ("q_pe, ckv, kpe, out=out)", "q_pe, ckv, kpe, None, None, False, None, None, None, False, None, 1)"),
        ("ckv_scale=layer.k_scale, kpe_scale=", "ckv_scale=layer.k_scale, rope_scale="),  # the fp8 run()'s scales
        ('use_cuda_graph=False, backend="auto"', 'use_cuda_graph=False, kernel_backend="auto"'),  # the constructor
    ],
)
def test_a_changed_call_in_the_mla_backend_is_caught(real, old: str, new: str) -> None:  # noqa: ANN001
    source = MLA_BACKEND.read_text(encoding="utf-8")
    assert old in source, f"the MLA backend no longer has {old!r}: update this test's mutation"
    found = [p for call in calls_in(source.replace(old, new), "mla backend") for p in problems(call, real)]
    assert found, f"changing {old!r} to {new!r} went unnoticed"


# --- the fake ----------------------------------------------------------------------------------------------------
def fake_signatures() -> dict[tuple[str, str], Signature]:
    """The fake's wrappers' methods, from their class or the base class they inherit it from in the same file."""
    tree = parse(FAKE)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    out = {}
    for name in WRAPPERS:
        for m in METHODS:
            cls = classes[name]
            func = method_of(cls, m)
            while func is None and cls.bases:
                cls = classes[ast.unparse(cls.bases[0])]
                func = method_of(cls, m)
            assert func is not None, f"the fake {name} has no {m}()"
            out[name, m] = signature(cls, func, f"fake {name}.{m}")
    return out


@pytest.mark.parametrize(("cls", "method"), [(w, m) for w in WRAPPERS for m in METHODS])
def test_the_fake_takes_what_the_installed_flashinfer_takes(real, cls: str, method: str) -> None:  # noqa: ANN001
    theirs, ours = real[cls, method], fake_signatures()[cls, method]
    for i, name in enumerate(ours.positional):
        assert i < len(theirs.positional) and theirs.positional[i] == name, (
            f"{ours.where} takes {name!r} as positional #{i + 1}; {theirs.where} has {theirs.positional}"
        )
    assert ours.keywords <= theirs.keywords, (
        f"{ours.where} accepts {sorted(ours.keywords - theirs.keywords)}, FlashInfer does not"
    )
    assert theirs.required <= ours.keywords | set(ours.positional), (
        f"{theirs.where} requires {sorted(theirs.required - ours.keywords - set(ours.positional))}, the fake lacks them"
    )
    differ = {
        k: (v, theirs.defaults[k]) for k, v in ours.defaults.items() if k in theirs.defaults and theirs.defaults[k] != v
    }
    assert not differ, f"{ours.where}: defaults (fake, FlashInfer) differ: {differ}"


# --- the version -------------------------------------------------------------------------------------------------
def makefile_pin() -> str:
    m = re.search(r"^FLASHINFER\s*\??=\s*flashinfer-python==(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert m, "the Makefile pins no flashinfer-python (FLASHINFER ?= flashinfer-python==X)"
    return m.group(1)


def test_the_installed_release_is_the_pinned_one_and_the_cuda_extra_admits_it() -> None:
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    installed = importlib.metadata.version("flashinfer-python")
    assert installed == makefile_pin(), (
        f"flashinfer-python {installed} is installed, the Makefile pins {makefile_pin()}"
    )
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cuda"]
    (requirement,) = [Requirement(r) for r in extra if Requirement(r).name == "flashinfer-python"]
    assert requirement.specifier.contains(installed, prereleases=True), (
        f"pyproject's cuda extra ({requirement}) does not admit the release checked here ({installed})"
    )


# --- which backend a latent (MLA) model gets, on this CPU machine ---------------------------------------------------
def test_a_latent_model_on_the_cpu_gets_torch_and_an_explicit_flashinfer_says_why() -> None:
    import torch

    from radixcache.worker.attention.base import (
        AttentionOptions,
        BackendUnavailableError,
        flashinfer_mla_unsupported_reason,
        resolve_backend_name,
    )

    latent = AttentionOptions(scale=0.1, latent=True, latent_dims=(512, 64))
    options = {"num_heads": 16, "num_kv_heads": 1, "head_dim": 288, "dtype": torch.bfloat16, "attention": latent}
    assert resolve_backend_name("auto", "cpu", **options) == "torch"
    assert resolve_backend_name("torch", "cpu", **options) == "torch"
    for name in ("flashinfer", "flashinfer_mla"):
        with pytest.raises(BackendUnavailableError, match="latent \\(MLA\\) pages: it needs a CUDA device"):
            resolve_backend_name(name, "cpu", **options)
    reason = flashinfer_mla_unsupported_reason("cpu", num_heads=16, dtype=torch.bfloat16, attention=latent)
    assert reason == "it needs a CUDA device, and the model is on cpu"
    # the MLA backend is for latent pages only
    with pytest.raises(BackendUnavailableError, match="latent \\(MLA\\) pages only"):
        resolve_backend_name("flashinfer_mla", "cpu", num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="latent_dims are for latent pages"):
        AttentionOptions(latent_dims=(512, 64))
