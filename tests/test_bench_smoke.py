"""Benchmarks that cannot rot: every script under bench/ runs in its --smoke mode (seconds, tiny sizes) and ends with
its one-line JSON result carrying the keys its readers take from it (BENCHMARKS.md, run_all's summary).

A change to the engine, the cache or a front that breaks a benchmark (an assertion of its own, a renamed field, a
sequence that ends early) then fails `make test`, not the next person who runs `make bench`. The smoke figures mean
nothing; only that the script runs to its last line does.

The scripts run as subprocesses, up to two at a time (the machines are 2-core: most scripts are one thread plus
waiting on their workers), longest first. run_all.py --smoke runs hf_baseline, serve_bench and decode_floor in their
own --smoke modes, so those three are checked from its output rather than run twice.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"

# What each script's last line must hold: key -> None (any value) or the keys expected inside it.
F = None
EXPECTED: dict[str, dict] = {
    "tree_bench.py": dict.fromkeys(
        [
            "insert_us",
            "insert_us_with_sink",
            "sink_overhead",
            "event_drain_us",
            "match_us",
            "evict_us",
            "evict_us_1k",
            "evict_us_10k",
            "evict_us_100k",
            "heap_rebuild_us_100k",
            "convert_us",
            "smoke",
        ]
    ),  # fmt: skip
    "engine_bench.py": dict.fromkeys(
        [
            "decode_tps_b1",
            "decode_tps_b4",
            "decode_tps_b16",
            "ttft_cold_ms",
            "ttft_cached_ms",
            "ttft_speedup",
            "speculate",
            "smoke",
        ]
    ),  # fmt: skip
    "hf_baseline.py": {
        "threads": F,
        "gsp": {"throughput_tok_s": F, "batch_size": F, "ttft_p50_s": F},
        "unique": {"throughput_tok_s": F},
    },  # fmt: skip
    "serve_bench.py": {
        "gsp": {
            "cache_on": {"ttft_p50_s": F, "hit_rate_of_max": F},
            "cache_off": {"ttft_p50_s": F},
            "throughput_vs_concurrency": F,
            "outputs_identical": F,
        },
        "multiturn": {"cache_on": {"ttft_p50_rounds3plus_s": F}, "outputs_identical": F},
        "unique": {"overhead": F, "overhead_abba_sums": F},
    },  # fmt: skip
    "decode_floor.py": dict.fromkeys(
        [
            "threads",
            "speculate",
            "copy_bandwidth_bytes_s",
            "read_bandwidth_bytes_s",
            "cache_check",
            "rows",
            "b1_over_floor",
            "b16_over_b1",
            "smoke",
        ]
    ),  # fmt: skip
    "run_all.py": dict.fromkeys(
        [
            "gsp_ttft_speedup",
            "gsp_throughput_vs_hf",
            "gsp_hit_rate_of_max",
            "multiturn_ttft_speedup",
            "unique_overhead",
            "decode_b1_over_floor",
            "decode_b16_over_b1",
            "greedy_outputs_identical_on_off",
            "cache_check",
            "decode_speculate",
            "smoke",
        ]
    ),  # fmt: skip
    "window_bench.py": dict.fromkeys(
        [
            "window_bytes_ratio",
            "decode_16k_vs_global",
            "decode_16k_vs_off",
            "hit_rate_on",
            "hit_rate_off",
            "speculate",
            "smoke",
        ]
    ),  # fmt: skip
    "retention_bench.py": dict.fromkeys(
        [
            "long_prompt_hit_rate_lru",
            "long_prompt_hit_rate_priority",
            "one_off_hit_rate_lru",
            "one_off_hit_rate_priority",
            "answers_identical",
            "speculate",
            "smoke",
        ]
    ),  # fmt: skip
    "spec_bench.py": dict.fromkeys(
        [
            "agentic_speedup_b1",
            "agentic_speedup_b8",
            "accepted_per_step",
            "unique_overhead",
            "greedy_identical",
            "seeded_identical",
            "models",
            "smoke",
        ]
    ),  # fmt: skip
    "kv_precision_bench.py": dict.fromkeys(
        [
            "bytes_per_token",
            "bpb_delta",
            "kl",
            "decode_ms",
            "decode_b8_4k_vs_full",
            "workload",
            "demote_hit_rate_vs_lru",
            "smoke",
        ]
    ),  # fmt: skip
    "moe_bench.py": dict.fromkeys(
        [
            "mla_bytes_per_token_vs_expanded",
            "mla_bytes_per_token_vs_gqa",
            "mla_decode_absorbed_vs_expanded",
            "moe_step_vs_dense_active",
            "smoke",
        ]
    ),  # fmt: skip
    "store_bench.py": dict.fromkeys(
        [
            "cross_replica_rehit_speedup",
            "scaleup_cached_share",
            "unique_overhead",
            "failover_cached_share",
            "fault_failed_requests",
            "fault_wrong_answers",
            "wrong_answers",
            "smoke",
        ]
    )
    | {"store_eviction_hit_rate": dict.fromkeys(["store", "no_store"])},  # fmt: skip
    "constrained_bench.py": dict.fromkeys(
        [
            "constrained_step_overhead_b1",
            "constrained_step_overhead_b16",
            "constrained_step_cpu_overhead_b1",
            "constrained_step_cpu_overhead_b16",
            "compile_cold_ms_max",
            "compile_cached_ms_max",
            "speculate",
            "smoke",
        ]
    ),  # fmt: skip
    "rss_growth.py": dict.fromkeys(["dtype", "requests", "rss_after_warmup_mb", "rss_end_mb", "growth_mb", "smoke"]),
    "tier_bench.py": dict.fromkeys(
        [
            "disk_rehit_ttft_speedup",
            "oversub_hit_rate",
            "restart_cached_share",
            "ready_delay_s",
            "unique_overhead",
            "corrupt_served",
            "tier_ms_per_decode_step_p99",
            "decode_step_ms_p99",
            "details",
            "smoke",
        ]
    ),  # fmt: skip
    "http_hostile.py": dict.fromkeys(
        ["variant", "phase", "worker_alive", "killed_by_watchdog", "peak_rss_mb", "opened", "open_at_end"]
    ),
    "http_vs_grpc.py": dict.fromkeys(
        [
            "http_ttft_p50_overhead_ms",
            "http_throughput_ratio",
            "http_openai_ttft_p50_overhead_ms",
            "responses_ttft_p50_overhead_ms",
            "messages_ttft_p50_overhead_ms",
            "front_cost",
            "loop_previous_response_id",
            "loop_resend_history",
            "smoke",
        ]
    ),  # fmt: skip
    "exact_cost.py": dict.fromkeys(
        ["dtype", "threads", "decode_b1_ratio", "decode_b8_ratio", "prefill_ratio", "decode_b1_exact_tok_s"]
    ),
    "cluster_bench.py": {
        "present": {
            router: dict.fromkeys(["hit_rate_of_max", "ttft_p50_ms", "failed"]) for router in ("exact", "ray_prefix")
        },
        "decision_ms_p50": F,
        "smoke": F,
    },  # fmt: skip
}
# Benches of plain decode: speculation off, and their output says so (key path -> 0).
PLAIN_DECODE = {
    "engine_bench.py": ["speculate"],
    "decode_floor.py": ["speculate"],
    "window_bench.py": ["speculate"],
    "retention_bench.py": ["speculate"],
    "constrained_bench.py": ["speculate"],
    "run_all.py": ["decode_speculate"],
    "tier_bench.py": ["details", "spill_cost", "speculate"],
}
# Scripts run by run_all.py --smoke, checked from its output.
UNDER_RUN_ALL = ("hf_baseline.py", "serve_bench.py", "decode_floor.py")
LLAMACPP = "llamacpp_compare.py"  # needs a ~10-minute llama-server build: run only where it is cached
# where llamacpp_compare.py caches its llama-server build (SERVER_BIN there)
LLAMACPP_BUILT = any((BENCH / "results" / "llamacpp").glob("*/vendor/llama.cpp/build/bin/llama-server"))
RUN = [s for s in EXPECTED if s not in UNDER_RUN_ALL]


def _store_missing() -> str | None:
    """Why Mooncake's store cannot run here (the `store` extra, or Debian's libibverbs1, missing), or None."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


STORE_MISSING = _store_missing()
# Longest first, so that two at a time finish together.
ORDER = ["cluster_bench.py", "tier_bench.py", "run_all.py", "http_vs_grpc.py"]


def scripts() -> list[str]:
    """Every bench/*.py that runs as a script (`if __name__ == "__main__":`); the others are modules."""
    out = []
    for path in sorted(BENCH.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                out.append(path.name)
    return out


def run_one(script: str) -> dict:
    cmd = [sys.executable, str(BENCH / script), "--smoke"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", str(e.stdout or ""), str(e.stderr or "")
    return {"rc": rc, "stdout": out, "stderr": err, "wall_s": round(time.perf_counter() - start, 1)}


@pytest.fixture(scope="module")
def runs(request) -> dict[str, dict]:
    """Every selected script's smoke run, two at a time; built once: the smoke checkpoint they share."""
    wanted = {
        item.callspec.params["script"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec") and "script" in item.callspec.params
    }
    if STORE_MISSING:
        wanted.discard("store_bench.py")  # its test skips
    todo = sorted(
        {s if s in RUN else "run_all.py" for s in wanted},
        key=lambda s: (s not in ORDER, ORDER.index(s) if s in ORDER else 0, s),
    )
    build = [
        sys.executable,
        "-c",
        "import sys; sys.path.insert(0, 'bench'); import common; common.bench_checkpoint(True)",
    ]
    subprocess.run(build, cwd=ROOT, check=True, capture_output=True, timeout=300)
    with ThreadPoolExecutor(min(2, os.cpu_count() or 1)) as pool:
        done = dict(zip(todo, pool.map(run_one, todo), strict=True))
    print("\nsmoke wall seconds: " + ", ".join(f"{s} {r['wall_s']}" for s, r in done.items()))
    return done


def last_json(lines: list[str], where: str) -> dict:
    lines = [line for line in lines if line.strip()]
    assert lines, f"{where}: printed nothing"
    try:
        value = json.loads(lines[-1])
    except json.JSONDecodeError:
        pytest.fail(f"{where}: the last line is not JSON: {lines[-1][:300]!r}")
    assert isinstance(value, dict), f"{where}: the last line is not one JSON object"
    return value


def missing(value: object, spec: dict | None, path: str = "") -> list[str]:
    if spec is None:
        return []
    if not isinstance(value, dict):
        return [path or "(top)"]
    out = []
    for key, inner in spec.items():
        if key not in value:
            out.append(f"{path}{key}")
        else:
            out += missing(value[key], inner, f"{path}{key}.")
    return out


def result_of(runs: dict[str, dict], script: str) -> dict:
    """The script's last-line JSON: its own run's, or its part of run_all's output (from its `$ python X` line to
    the next one, or to the blank line before run_all's table)."""
    run = runs[script if script in RUN else "run_all.py"]
    assert run["rc"] == 0, f"{script} --smoke exited {run['rc']}:\n{run['stderr'][-4000:]}"
    lines = run["stdout"].splitlines()
    if script in RUN:
        return last_json(lines, script)
    starts = [i for i, line in enumerate(lines) if line.startswith("$ ")]
    (start,) = [i for i in starts if lines[i].split()[2] == script]
    end = min([i for i in starts if i > start] + [len(lines)])
    part = lines[start + 1 : end]
    if "" in part:
        part = part[: part.index("")]
    assert "--smoke" in lines[start].split(), f"run_all --smoke ran {lines[start]!r}"
    return last_json(part, f"{script} (under run_all.py --smoke)")


def test_every_bench_script_has_a_smoke_check() -> None:
    found = set(scripts())
    assert found == {*EXPECTED, LLAMACPP}, (
        f"bench scripts without a smoke check here: {sorted(found - {*EXPECTED, LLAMACPP})}"
    )
    for script in found:
        assert '"--smoke"' in (BENCH / script).read_text(encoding="utf-8"), f"{script} has no --smoke flag"


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_smoke_mode_ends_with_its_json(runs: dict[str, dict], script: str) -> None:
    if script == "store_bench.py" and STORE_MISSING:
        pytest.skip(f"store_bench.py needs Mooncake's store: {STORE_MISSING}")
    result = result_of(runs, script)
    assert not missing(result, EXPECTED[script]), f"{script}: the last line lacks {missing(result, EXPECTED[script])}"
    if "smoke" in EXPECTED[script]:
        assert result["smoke"] is True, f"{script} did not run its smoke mode"
    if script in PLAIN_DECODE:
        value = result
        for key in PLAIN_DECODE[script]:
            value = value[key]
        assert value == 0, f"{script} measures plain decode: speculation must be off and said so"


@pytest.mark.skipif(not LLAMACPP_BUILT, reason="needs the llama-server build (make bench-llamacpp)")
def test_llamacpp_smoke_where_it_is_built() -> None:
    run = run_one(LLAMACPP)
    assert run["rc"] == 0, run["stderr"][-4000:]
    result = last_json(run["stdout"].splitlines(), LLAMACPP)
    assert not missing(result, dict.fromkeys(["decode_b1_vs_llamacpp_f32", "gsp_throughput_vs_llamacpp"]))
