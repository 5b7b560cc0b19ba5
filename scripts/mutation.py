"""Mutation testing (`make mutation`): mutmut over the cache and the request path, then a score per module.

Each target runs in its own copy of the tree (build/mutation/<target>/) with its own mutmut configuration, so a
mutant is tested only by the fast, in-process tests that belong to its module (and, of those, only the ones mutmut
saw reaching the mutated function). A rerun resumes: mutants already decided keep their result until their source
changes. Processes/subprocess tests (tests/test_e2e_*) are never used: a mutant lives in this process only.

    python scripts/mutation.py                      # every target
    python scripts/mutation.py radixcache validation
    python scripts/mutation.py --report-only        # scores of what earlier runs decided

Survivors are listed per target in build/mutation/<target>/survivors.txt (`mutmut show NAME` there shows one);
each one gets a test or a line in docs/MUTATION.md saying why it is equivalent.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "mutation"

# target -> (files to mutate, the tests that exercise them in-process)
TARGETS: dict[str, tuple[list[str], list[str]]] = {
    "radixcache": (
        ["radixcache/*"],
        [
            "test_tree.py",
            "test_pages.py",
            "test_cache.py",
            "test_cache_stateful.py",
            "test_memory_cli.py",
            "test_attention.py",
            "test_events.py",
            "test_invariant_checks.py",
        ],  # fmt: skip
    ),
    # test_wire_promises (a real model behind a real server: several seconds a mutant, and each survivor waits out
    # its cancel/deadline bounds) is left out: on one core it made each worker target a run of hours. The scores of
    # these targets are therefore lower bounds; the wire tests still run in `make test`.
    "validation": (["worker/front/validation.py"], ["test_validation.py", "test_server_fake.py"]),
    "sequence": (["worker/engine/sequence.py"], ["test_sequence.py", "test_sampling.py", "test_engine.py"]),
    "scheduler": (
        ["worker/engine/scheduler/*"],
        [
            "test_scheduler.py",
            "test_engine.py",
            "test_engine_capacity.py",
            "test_engine_soak.py",
            "test_engine_samples.py",
        ],
    ),
    # SubscribeCacheEvents: test_servicer_wire and test_events_worker (whose subprocess tests never see a mutant).
    "servicer": (
        ["worker/grpc/servicer.py"],
        ["test_servicer_wire.py", "test_server_fake.py", "test_events_worker.py"],
    ),
}
WORKER_TARGETS = {"validation", "sequence", "scheduler", "servicer"}
NOT_MUTATED = ["radixcache/v1/*", "radixcache/cli.py", "radixcache/__main__.py"]  # stubs and the dispatcher
# Tests that start a subprocess never see a mutant (it lives in this process): leave them out.
PYTEST_ARGS = [
    "-p",
    "no:cacheprovider",
    "-q",
    "-x",
    "-m",
    "not e2e",
    "-k",
    "not test_dispatcher_and_module_entry_point",
]
# Imported once by a worker target's fork server (see prepare): nothing here may start a thread at import.
PRELOAD = ["torch", "numpy", "sortedcontainers", "hypothesis", "pytest_timeout"]
GOAL = {"radixcache": 0.90, "validation": 0.90}  # others: 0.80
# A timeout is not counted as a kill: in a forked gRPC process a hang may be the fork's, not the mutant's.
KILLED = {"killed", "caught by type check"}
KILLED_EXIT_CODES = {1, 3, 37}  # mutmut's exit codes for the statuses in KILLED (mutmut.stats.status_by_exit_code)
UNDECIDED = {"not checked", "skipped"}


def toml_list(items: list[str]) -> str:
    return "[" + ", ".join(f'"{x}"' for x in items) + "]"


def prepare(target: str) -> Path:
    """Copy the sources and tests into WORK/target and write its mutmut configuration.

    worker/ is copied to radixcache/worker/, where the installed package has it: mutmut names a mutant after its
    file's path and matches it against the module the tests imported (radixcache.worker.front.validation).
    """
    mutate, tests = TARGETS[target]
    here = WORK / target
    here.mkdir(parents=True, exist_ok=True)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for src, dst in (("radixcache", "radixcache"), ("worker", "radixcache/worker"), ("tests", "tests")):
        shutil.copytree(ROOT / src, here / dst, dirs_exist_ok=True, ignore=skip, copy_function=shutil.copy2)
    tests_present = [f"tests/{t}" for t in tests if (ROOT / "tests" / t).exists()]
    only = [m.replace("worker/", "radixcache/worker/") for m in mutate]
    never = NOT_MUTATED + ([] if any(m.startswith("worker/") for m in mutate) else ["radixcache/worker/*"])
    # gRPC does not survive a fork of a process that already started it (its threads are gone: hangs, segfaults):
    # a worker target forks every mutant from a fork server that has imported only modules that start no thread
    # (PRELOAD: torch alone is ~1.6 s a mutant), so each mutant still imports gRPC and starts its servers afresh.
    # That import and start-up cost CPU seconds mutmut's time limit (made from the tests' durations) leaves out.
    isolation = ""
    if target in WORKER_TARGETS:
        (here / "preload.txt").write_text("\n".join(PRELOAD) + "\n")
        isolation = (
            'process_isolation = "forkserver"\nforkserver_warmup = "import"\npreload_modules_file = "preload.txt"\n'
            "timeout_constant = 10.0\n"
        )
    config = (
        "\n[tool.mutmut]\n"
        f"{isolation}"
        'source_paths = ["radixcache"]\n'
        f"only_mutate = {toml_list(only)}\n"
        f"do_not_mutate = {toml_list(never)}\n"
        f"pytest_add_cli_args = {toml_list(PYTEST_ARGS)}\n"
        f"pytest_add_cli_args_test_selection = {toml_list(tests_present)}\n"
    )
    pyproject = (ROOT / "pyproject.toml").read_text()
    (here / "pyproject.toml").write_text(pyproject + config)
    return here


def retest_undecided(here: Path) -> int:
    """Forget every verdict but a kill, so the next run tests those mutants again with the current tests.

    mutmut keeps a verdict until the mutated function's source changes; it never retests a survivor because a
    test was added or made stronger. Without its stats file mutmut also keeps every verdict through a change of
    test selection (it then cannot compare configurations) and records the tests of every function afresh. A kill stays a kill (tests are only ever made stronger), so only survivors,
    timeouts, "no tests" and the like are run again. Returns how many verdicts were forgotten.
    """
    # Which tests reach which function is recorded once and then only extended for tests with new names: a test
    # made stronger, or a function the tests reach since, would keep a stale (or no) list. Record it afresh.
    (here / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
    forgotten = 0
    for meta in (here / "mutants").rglob("*.py.meta"):
        try:
            data = json.loads(meta.read_text())
        except json.JSONDecodeError:  # a run killed while writing it: make mutmut mutate that file afresh
            meta.unlink()
            meta.with_suffix("").unlink(missing_ok=True)
            continue
        codes = data.get("exit_code_by_key", {})
        stale = [k for k, code in codes.items() if code is not None and code not in KILLED_EXIT_CODES]
        for key in stale:
            codes[key] = None
        if stale:
            meta.write_text(json.dumps(data, indent=4))
            forgotten += len(stale)
    return forgotten


def run(target: str, max_children: int, retest: bool) -> int:
    here = prepare(target)
    if retest:
        n = retest_undecided(here)
        if n:
            print(f"   retesting {n} mutants that no test killed last time", flush=True)
    print(f"== mutmut: {target} in {here.relative_to(ROOT)}", flush=True)
    # mutmut redraws a progress line many times a second: keep only its summary lines on the terminal.
    # One OpenMP thread: mutmut forks each mutant from a process that has already run torch, and a forked child
    # blocks forever in a thread pool its parent started (the mutant then "times out" on the wall clock).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with open(here / "mutmut.log", "w") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "mutmut", "run", "--max-children", str(max_children)],
            cwd=here,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    if proc.returncode != 0:
        print(f"   mutmut exited with {proc.returncode}; see {here / 'mutmut.log'}")
    return proc.returncode


def results(target: str) -> dict[str, str]:
    """mutant name -> status, as mutmut recorded them for `target`."""
    here = WORK / target
    if not (here / "mutants").is_dir():
        return {}
    out = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=here, capture_output=True, text=True
    ).stdout
    found = {}
    for line in out.splitlines():
        m = re.match(r"\s*(\S+__mutmut_\d+): (.+)$", line)
        if m:
            found[m.group(1)] = m.group(2).strip()
    return found


def module_of(mutant: str) -> str:
    """radixcache.tree.xǁRadixTreeǁinsert__mutmut_3 -> radixcache.tree (functions are x_name, methods xǁClassǁname)."""
    return re.split(r"\.x[_ǁ]", mutant)[0]


def report(targets: list[str]) -> None:
    print(
        f"{'target':<11} {'module':<24} {'mutants':>7} {'killed':>7} {'survived':>8} {'timeout':>7} {'no tests':>8}"
        f" {'unrun':>6} {'score':>7}"
    )
    for target in targets:
        statuses = results(target)
        if not statuses:
            print(f"{target:<11} (not run)")
            continue
        by_module: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        survivors = []
        for name, status in sorted(statuses.items()):
            by_module[module_of(name)][status] += 1
            if status not in KILLED and status not in UNDECIDED:
                survivors.append(f"{name}: {status}")
        total = collections.Counter()
        for module, counts in sorted(by_module.items()):
            total += counts
            print(line(target, module, counts))
        if len(by_module) > 1:
            print(line(target, "(all)", total))
        goal = GOAL.get(target, 0.80)
        print(f"{'':<11} goal {goal:.0%}; survivors listed in build/mutation/{target}/survivors.txt")
        (WORK / target / "survivors.txt").write_text("\n".join(survivors) + "\n")


def line(target: str, module: str, counts: collections.Counter) -> str:
    killed = sum(counts[s] for s in KILLED)
    decided = sum(counts.values()) - sum(counts[s] for s in UNDECIDED)
    score = killed / decided if decided else 0.0  # of the mutants run: survivors, timeouts and no-tests count against
    unrun = sum(counts[s] for s in UNDECIDED)
    return (
        f"{target:<11} {module:<24} {sum(counts.values()):>7} {killed:>7} {counts['survived']:>8} "
        f"{counts['timeout']:>7} {counts['no tests']:>8} {unrun:>6} {score:>7.1%}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("targets", nargs="*", help=f"some of {', '.join(TARGETS)} (default: all, in that order)")
    p.add_argument("--report-only", action="store_true")
    # One child by default: the machine this runs on has 2 cores and the other one is someone else's.
    p.add_argument("--max-children", type=int, default=1, help="mutants tested at once (default: 1)")
    p.add_argument(
        "--keep-verdicts",
        action="store_true",
        help="do not retest the survivors, timeouts and no-tests of earlier runs (default: retest them)",
    )
    args = p.parse_args()
    targets = args.targets or list(TARGETS)
    unknown = set(targets) - set(TARGETS)
    if unknown:
        p.error(f"unknown target(s) {', '.join(sorted(unknown))}; known: {', '.join(TARGETS)}")
    failed = 0
    if not args.report_only:
        for target in targets:
            failed |= run(target, args.max_children, not args.keep_verdicts) != 0
    report(targets)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
