"""Hostile HTTP requests (bodies and what is said about them), each with the answer the HTTP front must give, for
tests/test_http_hostile.py and `make soak`'s HTTP phase.

`hostile_requests(model)` lists them: a huge `n`, bodies of a million messages / tools / parts / stop strings
(16 MB; the Responses API's input items and tools too), JSON nested 100,000 deep, a 15 MiB prompt, bodies not said to be JSON, a foreign Host, lone surrogates in
tool-use fields, invalid JSON and UTF-8, a wrong method, plus a valid request. `send_all` sends them round-robin
from a few threads for a while and reports every answer that differs from the expected one.
"""

from __future__ import annotations

import collections
import itertools
import json
import threading
import time
from dataclasses import dataclass, field

import httpx
from client_priority import lower_this_threads_priority

JSON = {"Content-Type": "application/json"}
HUGE_N = 1180591620717411303424


@dataclass(frozen=True)
class Hostile:
    name: str
    path: str
    body: bytes
    status: int  # the answer it must get
    param: str | None = None  # and the field its error must name ("": not checked)
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON))
    method: str = "POST"


def many(item: bytes, count: int) -> bytes:
    return b"[" + b",".join([item] * count) + b"]"


def huge_bodies() -> dict[str, bytes]:
    """Bodies of 7-16 MB holding a million small items under one field (the key: the field the 400 names)."""
    hi = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
    return {
        "messages": b'{"model": "m", "messages": ' + many(b'{"role":"u"}', 1_250_000) + b"}",
        "tools": hi + b'"tools": ' + many(b'{"type": "function", "function": {"name": "f"}}', 300_000) + b"}",
        "messages[0].content": b'{"model": "m", "messages": [{"role": "user", "content": '
        + many(b'{"type": "text", "text": "x"}', 500_000)
        + b"}]}",
        "stop": hi + b'"stop": ' + many(b'"x"', 2_000_000) + b"}",
    }


def _with_lone_surrogate(model: str, path: tuple) -> tuple[bytes, str]:
    turns = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"c": "P"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get", "content": "sunny"},
    ]  # fmt: skip
    target: object = turns
    for step in path[:-1]:
        target = target[step]  # type: ignore[index]
    target[path[-1]] = '{"c": "\\ud800"}' if path[-1] == "arguments" else "call_\ud800"  # type: ignore[index]
    name = f"messages[{path[0]}]" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path[1:])
    return json.dumps({"model": model, "max_tokens": 1, "messages": turns}).encode(), name


def hostile_requests(model: str) -> list[Hostile]:
    chat, completions = "/v1/chat/completions", "/v1/completions"
    hi = [{"role": "user", "content": "hi"}]
    out = [
        Hostile(f"n={n} {path}", path, json.dumps(body | {"model": model, "max_tokens": 2, "n": n}).encode(), 400, "n")
        for n in (HUGE_N, 3_000_000)
        for path, body in ((chat, {"messages": hi}), (completions, {"prompt": "hi"}))
    ]
    out += [Hostile(f"a million {name}", chat, raw, 400, name) for name, raw in huge_bodies().items()]
    responses = "/v1/responses"  # the Responses API reads its body through the same bounded parse
    out += [
        Hostile("a million input items", responses, b'{"model": "m", "input": ' + many(b'"x"', 1_000_000) + b"}",
                400, "input"),
        Hostile("a million Responses tools", responses, b'{"model": "m", "input": "hi", "tools": '
                + many(b'{"type": "function", "name": "f"}', 300_000) + b"}", 400, "tools"),
        Hostile("Responses nested 100000 deep", responses, b'{"input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                400, None),
    ]  # fmt: skip
    text = "lorem ipsum, dolor {sit} amet\n" * (15 * (1 << 20) // 30)
    out += [
        Hostile(
            "15 MiB prompt",
            chat,
            json.dumps({"model": model, "messages": [{"role": "user", "content": text}]}).encode(),
            400,
            "messages[0].content",  # refused while parsed: longer than any string a request may hold
        ),  # fmt: skip
        Hostile("nested 100000 deep", chat, b"[" * 100_000 + b"]" * 100_000, 400, None),
        Hostile("invalid JSON", chat, b'{"model": "m", "messages": [', 400, None),
        Hostile("invalid UTF-8", chat, b'{"model": "m", "messages": "\xff"}', 400, None),
        Hostile("17 MiB", chat, b'{"model": "' + b"m" * (17 << 20) + b'"}', 413, ""),
    ]
    plain = json.dumps({"model": model, "prompt": "hi", "max_tokens": 1}).encode()
    out += [
        Hostile(f"Content-Type {ct}", completions, plain, 415, None, headers={"Content-Type": ct} if ct else {})
        for ct in ("text/plain", "application/x-www-form-urlencoded", "")
    ]
    out += [
        Hostile("Host evil.example", completions, plain, 400, None, headers=JSON | {"Host": "evil.example"}),
        Hostile("GET on a POST route", chat, b"", 405, None, method="GET"),
        Hostile("valid", completions, plain, 200, ""),
    ]
    for path in ((2, "tool_call_id"), (2, "name"), (1, "tool_calls", 0, "id"),
                 (1, "tool_calls", 0, "function", "name"), (1, "tool_calls", 0, "function", "arguments")):  # fmt: skip
        body, name = _with_lone_surrogate(model, path)
        out.append(Hostile(f"lone surrogate in {name}", chat, body, 400, name))
    return out


def check_answer(hostile: Hostile, r: httpx.Response) -> str | None:
    """What is wrong with the answer to `hostile` (None: it is the one expected)."""
    if r.status_code != hostile.status:
        return f"{hostile.name}: {r.status_code} (expected {hostile.status}): {r.text[:200]}"
    if r.status_code == 200:
        return None
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"{hostile.name}: {r.status_code} without an OpenAI error body: {r.text[:200]}"
    if error.get("type") != "invalid_request_error" or not error.get("message"):
        return f"{hostile.name}: error type {error.get('type')!r}: {error}"
    if hostile.param != "" and error.get("param") != hostile.param:
        return f"{hostile.name}: param {error.get('param')!r} (expected {hostile.param!r})"
    return None


@dataclass
class SendReport:
    requests: int = 0
    statuses: collections.Counter = field(default_factory=collections.Counter)
    wrong: list[str] = field(default_factory=list)  # answers that differ from the expected ones

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if isinstance(status, int) and status >= 500)


def send_all(base_url: str, hostile: list[Hostile], *, seconds: float, senders: int = 2, token: str | None = None,
             at_least_rounds: int = 1) -> SendReport:  # fmt: skip
    """Each of `senders` threads sends the requests round-robin (each from a different starting point) until
    `seconds` have passed and every request was sent `at_least_rounds` times by some thread."""
    report, lock = SendReport(), threading.Lock()
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + seconds
    needed = len(hostile) * at_least_rounds

    def send(offset: int) -> None:
        lower_this_threads_priority()
        with httpx.Client(base_url=base_url, timeout=120) as http:
            for i in itertools.count(offset):
                with lock:
                    if report.requests >= needed and time.monotonic() > deadline:
                        return
                h = hostile[i % len(hostile)]
                try:
                    r = http.request(h.method, h.path, content=h.body or None, headers=auth | h.headers)
                    status: int | str = r.status_code
                    wrong = check_answer(h, r)
                except httpx.HTTPError as e:
                    status, wrong = type(e).__name__, f"{h.name}: {type(e).__name__}: {e}"
                with lock:
                    report.requests += 1
                    report.statuses[status] += 1
                    if wrong is not None:
                        report.wrong.append(wrong)

    threads = [threading.Thread(target=send, args=(k * len(hostile) // senders,), daemon=True) for k in range(senders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 600)
    return report
