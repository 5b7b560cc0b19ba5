"""The disk tier end to end: real `radixcache serve --kv-disk` processes restarted on the same folder, after SIGTERM
(which saves what memory holds) and after SIGKILL in the middle of spilling (nothing wrong is ever served)."""

from __future__ import annotations

import random
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from worker_process import WorkerProcess

from radixcache.client import Client

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

PAGE = 16
BASE = ("--page-size", str(PAGE), "--kv-pages", "24", "--max-step-tokens", "128")
ARGS = (*BASE, "--kv-disk-size", "64MiB")


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 180) for _ in range(length)] for _ in range(n)]


def wait_disk_ready(c: Client, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while not (s := c.stats())["disk_ready"]:
        assert time.monotonic() < deadline, "the disk tier did not open"
        time.sleep(0.05)
    return s


def generate(c: Client, prompt: list[int]) -> tuple[list[int], int]:
    out = c.generate_text(token_ids=prompt, max_tokens=4, ignore_eos=True)
    return out.token_ids, out.cached_tokens


def drive(target: str, work: list[list[int]], reference: dict, stop: threading.Event, wrong: list) -> None:
    """Send the prompts round and round until stopped (or the worker dies); note any answer that differs."""
    with Client(target) as c:
        i = 0
        while not stop.is_set():
            try:
                tokens, _ = generate(c, work[i % len(work)])
            except grpc.RpcError:
                return
            if tokens != reference[i % len(work)]:
                wrong.append((i, tokens))
            i += 1


def test_sigterm_then_restart_serves_the_same_prefixes_from_disk(tmp_path: Path) -> None:
    work = prompts(3, 96, seed=1)  # 18 pages: most fit in the pool, so the shutdown is what writes them
    with WorkerProcess(*ARGS, "--kv-disk", str(tmp_path)) as w, Client(w.target) as c:
        wait_disk_ready(c)
        before = [generate(c, p)[0] for p in work]
        w.terminate()
        assert w.wait(60) == 0, w.log()[-3000:]
    with WorkerProcess(*ARGS, "--kv-disk", str(tmp_path)) as w, Client(w.target) as c:
        wait_disk_ready(c)
        for prompt, expected in zip(work, before, strict=True):
            tokens, cached = generate(c, prompt)
            assert tokens == expected
            assert cached >= 80, w.log()[-2000:]  # every whole page but the one recomputed for the first token
        s = c.stats()
        assert s["disk_hit_tokens"] >= 3 * 80 and s["disk_corrupt_pages"] == 0


def test_sigkill_while_spilling_never_serves_a_wrong_page(tmp_path: Path) -> None:
    work = prompts(12, 64, seed=2)  # 48 pages of prompts through a 24-page pool: every request evicts
    reference: dict[int, list[int]] = {}
    with WorkerProcess(*BASE) as w, Client(w.target) as c:  # the answers, computed without any tier
        for i, p in enumerate(work):
            reference[i] = generate(c, p)[0]
    for kill in range(3):
        with WorkerProcess(*ARGS, "--kv-disk", str(tmp_path)) as w:
            stop, wrong = threading.Event(), []
            thread = threading.Thread(target=drive, args=(w.target, work, reference, stop, wrong), daemon=True)
            thread.start()
            time.sleep(1.5 + kill)
            w.proc.send_signal(signal.SIGKILL)
            w.proc.wait(10)
            stop.set()
            thread.join(10)
            assert not wrong, wrong
    with WorkerProcess(*ARGS, "--kv-disk", str(tmp_path)) as w, Client(w.target) as c:
        wait_disk_ready(c)
        hits = 0
        for i, p in enumerate(work):
            tokens, cached = generate(c, p)
            assert tokens == reference[i]  # from disk or recomputed, never different
            hits += cached
        s = c.stats()
        assert s["disk_hit_tokens"] > 0 and hits > 0  # the kills left pages that serve
        assert s["disk_bytes"] <= s["disk_capacity_bytes"]
