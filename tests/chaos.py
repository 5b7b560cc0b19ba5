"""Chaos against a running worker: concurrent streams of two tenants with random cancels, deadlines and Abort calls,
while pins with TTLs, unpins and flushes come and go, and a small pool forces preemption.

`run_chaos(target, tokens, count=..., seed=...)` drives it (seeded, bounded in count and time) and returns a
ChaosReport of every promise it saw broken; tests/test_chaos.py runs a short one, `make soak` (scripts/soak.py) a
long one. What it checks, per stream:
- a stream nobody cancelled ends with exactly one final message (the last one), or, with a deadline, with
  DEADLINE_EXCEEDED and no final message; an Abort()ed stream ends with finish_reason "aborted" (or had finished);
- no call ever ends UNKNOWN or INTERNAL, and a request never fails for capacity (the prompts fit the pool);
- a greedy reference prompt gives the tokens it gives on an idle worker (`reference_tokens`, asked first).
The caller checks the leak side (stats once idle) with `wait_idle`.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from dataclasses import dataclass, field

import grpc

from radixcache.client import AsyncClient, Client

# What a request does: run to the end, be cancelled by its client, run under a short deadline, be Abort()ed.
ACTIONS = ("run", "run", "run", "cancel", "deadline", "abort")
ADMIN_STATUSES = {"OK", "RESOURCE_EXHAUSTED"}  # a pin over its budget, or on pages promised to a request
FINAL_TO_STATUS_S = 0.25  # the longest a call may stay open after its final message, on a busy machine


@dataclass
class ChaosReport:
    requests: int = 0
    cancelled: int = 0  # by their client (cancel, or a deadline that ran out)
    aborted: int = 0  # by an Abort() call that found the request running
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)  # of streams and admin calls
    admin_calls: collections.Counter[str] = field(default_factory=collections.Counter)
    references_checked: int = 0
    broken: list[str] = field(default_factory=list)  # every promise seen broken, described

    @property
    def unknown_or_internal(self) -> int:
        return self.statuses["UNKNOWN"] + self.statuses["INTERNAL"]


@dataclass(frozen=True)
class Workload:
    """The seeded prompts: a few shared prefixes (system prompts) per tenant, and greedy reference prompts."""

    prefixes: list[list[int]]
    references: list[list[int]]
    vocab: int
    max_tokens: int

    @classmethod
    def build(cls, seed: int, *, vocab: int, page_size: int, max_tokens: int = 40) -> Workload:
        rng = random.Random(seed)
        lo = 3  # skip the special ids of the models we test with (bos/eos/unk or pad)
        prefixes = [
            [rng.randrange(lo, vocab) for _ in range(rng.randrange(page_size, 5 * page_size))] for _ in range(4)
        ]
        references = [p + [rng.randrange(lo, vocab) for _ in range(rng.randrange(1, 2 * page_size))] for p in prefixes]
        return cls(prefixes, references, vocab, max_tokens)

    def prompt(self, rng: random.Random) -> list[int]:
        return rng.choice(self.prefixes) + [rng.randrange(3, self.vocab) for _ in range(rng.randrange(1, 40))]


def reference_tokens(target: str, token: str, workload: Workload) -> list[list[int]]:
    """Greedy tokens of every reference prompt, asked one at a time (an idle worker)."""
    with Client(target, token=token) as c:
        return [
            c.generate_text(token_ids=p, max_tokens=workload.max_tokens, ignore_eos=True).token_ids
            for p in workload.references
        ]


async def _stream(
    client: AsyncClient,
    rid: str,
    tenant: str,
    rng: random.Random,
    workload: Workload,
    expected: list[list[int]],
    report: ChaosReport,
) -> None:
    action = rng.choice(ACTIONS)
    reference = rng.randrange(len(workload.references)) if action == "run" and rng.random() < 0.3 else None
    if reference is not None:
        prompt, sampling = workload.references[reference], dict(max_tokens=workload.max_tokens, ignore_eos=True)
    else:
        greedy = rng.random() < 0.5
        sampling = dict(
            max_tokens=rng.randrange(1, workload.max_tokens + 1),
            ignore_eos=rng.random() < 0.8,
            temperature=None if greedy else rng.choice([0.5, 1.0, 1.5]),
            seed=None if greedy else rng.randrange(1 << 30),
        )
        prompt = workload.prompt(rng)
    timeout = rng.uniform(0.05, 1.0) if action == "deadline" else 120.0
    stop_after = rng.randrange(1, 6)  # messages before a cancel or an Abort
    finals, tokens, messages, status = 0, [], 0, "OK"
    last_reason, final_at = None, None
    started = time.monotonic()
    stream = client.generate(token_ids=prompt, request_id=rid, timeout=timeout, **sampling)
    try:
        async for chunk in stream:
            messages += 1
            tokens += chunk.token_ids
            if chunk.finish_reason is not None:
                finals += 1
                last_reason, final_at = chunk.finish_reason, time.monotonic() - started
            elif finals:
                report.broken.append(f"{tenant}/{rid}: a message after the final one")
            if action == "cancel" and messages >= stop_after and not finals:
                break
            if action == "abort" and messages == stop_after and not finals:
                if await client.abort(rid):
                    report.aborted += 1
    except grpc.RpcError as e:
        status = e.code().name
    finally:
        await stream.aclose()
    report.statuses[status] += 1
    if action == "cancel" and not finals:
        report.cancelled += 1
        return
    if status == "DEADLINE_EXCEEDED" and action == "deadline":
        report.cancelled += 1
        # The final message and the call's status are two frames: a deadline may fall between them (a race on a
        # busy machine, seen once in ~700 such calls). A call still open FINAL_TO_STATUS_S after its final message
        # is a server that did not end it.
        if finals and timeout - final_at > FINAL_TO_STATUS_S:
            report.broken.append(f"{tenant}/{rid}: DEADLINE_EXCEEDED {timeout - final_at:.3f} s after a final message")
        return
    if status != "OK" or finals != 1:
        report.broken.append(f"{tenant}/{rid} ({action}): status {status}, {finals} final messages")
        return
    if reference is not None:
        report.references_checked += 1
        if tokens != expected[reference]:
            report.broken.append(f"{tenant}/{rid}: reference {reference} gave {tokens}, idle {expected[reference]}")
    if action == "abort" and last_reason not in ("aborted", "length", "stop_token"):
        report.broken.append(f"{tenant}/{rid}: aborted stream ended {last_reason!r}")


async def _admin(client: AsyncClient, rng: random.Random, workload: Workload, report: ChaosReport) -> None:
    """One random admin call: pin with a TTL, unpin, flush, stats."""
    op = rng.choice(("pin", "pin", "unpin", "flush", "stats"))
    prefix = rng.choice(workload.prefixes)
    try:
        if op == "pin":
            await client.pin(token_ids=prefix, ttl_seconds=rng.uniform(0.05, 2.0))
        elif op == "unpin":
            await client.unpin(token_ids=prefix)
        elif op == "flush":
            await client.flush()
        else:
            await client.stats()
        status = "OK"
    except grpc.RpcError as e:
        status = e.code().name
        if status not in ADMIN_STATUSES:
            report.broken.append(f"{op}: {status} {e.details()}")
    report.admin_calls[f"{op} {status}"] += 1
    report.statuses[status] += 1


async def chaos(
    target: str,
    tokens: dict[str, str],
    workload: Workload,
    expected: list[list[int]],
    *,
    count: int,
    seed: int,
    concurrency: int = 12,
    seconds: float = 600.0,
) -> ChaosReport:
    """`count` streams, `concurrency` at a time, tenants taken from `tokens` (token -> tenant), admin calls between."""
    rng = random.Random(seed)
    report = ChaosReport()
    clients = {token: AsyncClient(target, token=token) for token in tokens}
    pending: set[asyncio.Task] = set()
    tasks: list[asyncio.Task] = []
    deadline = time.monotonic() + seconds
    try:
        for n in range(count):
            if time.monotonic() > deadline:
                break
            while len(pending) >= concurrency:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            token = rng.choice(list(tokens))
            client = clients[token]
            jobs = [
                _stream(
                    client, f"c{n}", tokens[token], random.Random(rng.randrange(1 << 62)), workload, expected, report
                )
            ]
            report.requests += 1
            if rng.random() < 0.15:
                jobs.append(_admin(client, random.Random(rng.randrange(1 << 62)), workload, report))
            for job in jobs:
                tasks.append(asyncio.ensure_future(job))
                pending.add(tasks[-1])
            await asyncio.sleep(rng.uniform(0, 0.01))
        if pending:
            await asyncio.wait(pending)
        for task in tasks:
            if task.exception() is not None:
                report.broken.append(f"driver task failed: {task.exception()!r}")
    finally:
        for client in clients.values():
            await client.close()
    return report


def run_chaos(
    target: str, tokens: dict[str, str], workload: Workload, expected: list[list[int]], **kwargs: object
) -> ChaosReport:
    return asyncio.run(chaos(target, tokens, workload, expected, **kwargs))  # type: ignore[arg-type]


def wait_idle(target: str, token: str, timeout: float = 30.0) -> dict[str, float]:
    """Stats once nothing runs or waits and no lease is live (or the last ones seen at `timeout`)."""
    with Client(target, token=token) as c:
        deadline = time.monotonic() + timeout
        while True:
            s = c.stats()
            if not (s["running"] or s["waiting"] or s["live_leases"]) or time.monotonic() > deadline:
                return s
            time.sleep(0.05)
