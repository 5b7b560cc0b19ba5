"""The client subcommands (`radixcache generate|chat|stats|pin`) as real processes against a fake-engine worker."""

from __future__ import annotations

import subprocess
import sys

import pytest
from fake_engine import FakeEngine
from worker_harness import ThreadedWorker

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def worker():
    w = ThreadedWorker(FakeEngine(), auth_tokens={"tok": "alice"}).start()
    try:
        yield w
    finally:
        w.stop()


def radixcache(worker, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "radixcache", args[0], "--target", worker.target, "--token", "tok", *args[1:]]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=60)


def test_generate_streams_text(worker):
    r = radixcache(worker, "generate", "hello there", "--max-tokens", "5")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "abcde\n"
    assert "cached_tokens=0" in r.stderr and "finish_reason=length" in r.stderr


def test_chat_from_a_pipe_prints_cached_tokens_per_turn(worker):
    r = radixcache(worker, "chat", "--max-tokens", "4", "--system", "terse", stdin="first question\nsecond\n")
    assert r.returncode == 0, r.stderr
    turns = [line for line in r.stdout.splitlines() if line.startswith("[prompt_tokens=")]
    assert len(turns) == 2
    assert "cached_tokens=0 " in turns[0]
    cached = int(turns[1].split("cached_tokens=")[1].split()[0])
    prompt1 = int(turns[0].split("prompt_tokens=")[1].split()[0])
    assert cached == prompt1 + 4  # the whole first turn: prompt + reply
    assert r.stdout.count("assistant> abcd") == 2


def test_stats_and_pin(worker):
    r = radixcache(worker, "pin", "a system prompt", "--ttl", "30")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "pinned 16 tokens"
    r = radixcache(worker, "pin", "a system prompt", "--unpin")
    assert r.stdout.strip() == "unpinned 16 tokens"
    r = radixcache(worker, "stats", "--model")
    assert r.returncode == 0, r.stderr
    assert "live_leases      0" in r.stdout and "vocab_size       259" in r.stdout


def test_errors_are_reported_with_their_code(worker):
    r = radixcache(worker, "generate", "x", "--max-tokens", "0")
    assert r.returncode == 1
    assert "INVALID_ARGUMENT: max_tokens must be >= 1" in r.stderr
    cmd = [sys.executable, "-m", "radixcache", "stats", "--target", worker.target]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "UNAUTHENTICATED" in r.stderr


def test_client_commands_never_import_torch():
    code = (
        "import sys; from radixcache import cli; from radixcache.client import cli as c, Client, AsyncClient, Chat; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
