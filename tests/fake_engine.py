"""A test double of worker.engine.Engine (the API in docs/MODULES.md), for server-only behaviour.

It runs one loop thread like the real engine and streams one RequestOutput per step per request, but computes
nothing: token i of a completion is letter i of the alphabet. A byte-level tokenizer (id = byte + 3) and a
prefix "cache" per namespace (the longest prefix of an earlier sequence, capped at len(prompt) - 1) are enough to
exercise streaming order, cancellation, deadlines, tenants, pins and shutdown without a model.

Scripted prompts (a test puts the marker in its prompt text): a prompt containing SLOW_PREFILL takes
`slow_prefill` seconds before its first token (abortable); one containing FAILS_AFTER_ONE_TOKEN ends with
FinishReason.ERROR after one token; one containing NO_CAPACITY ends like a request that cannot fit beside pinned pages
(ErrorKind.NO_CAPACITY). A chat prompt rendered with tools (the template writes them between
<tools> and </tools>) is answered with a Hermes-style call of the first tool, as a model trained for tools would:
<tool_call>{"name": <first tool>, "arguments": {"city": "Paris"}}</tool_call>, then EOS.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

from radixcache.explain import Explanation, off_explanation
from radixcache.miss_reasons import NO_SHARED_PREFIX
from radixcache.worker.engine.api import DuplicateRequestError
from radixcache.worker.engine.checks import check_engine_request
from radixcache.worker.engine.request import ErrorKind, FinishReason, Request, RequestOutput

BOS, EOS, OFFSET = 1, 2, 3
SLOW_PREFILL, FAILS_AFTER_ONE_TOKEN, NO_CAPACITY = "SLOW", "BOOM", "FULL"  # markers of scripted prompts


class ByteTokenizer:
    vocab_size = 256 + OFFSET
    eos_token_ids = (EOS,)
    bos_token_id = BOS
    max_bytes_per_token = 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + OFFSET for b in text.encode("utf-8")]
        return [BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - OFFSET for i in ids if i >= OFFSET).decode("utf-8", "replace")

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, tools: list | None = None
    ) -> str:
        text = "\x01" + (f"<tools>{json.dumps(tools)}</tools>" if tools else "")
        text += "".join(f"<{m['role']}>{m['content']}</s>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class _Seq:
    request: Request
    on_output: Callable[[RequestOutput], None]
    cached: int
    started: float = field(default_factory=time.monotonic)
    generated: list[int] = field(default_factory=list)
    aborted: bool = False
    first_at: float | None = None


class FakeEngine:
    def __init__(self, *, context_length: int = 512, num_pages: int = 256, page_size: int = 4, step_s: float = 0.005):
        self.tokenizer = ByteTokenizer()
        self.model_config = SimpleNamespace(vocab_size=ByteTokenizer.vocab_size, max_position_embeddings=context_length)
        self.vocab_size = ByteTokenizer.vocab_size
        self.context_length = context_length
        self.page_size = page_size
        self.num_pages = num_pages
        self.kv_bytes = num_pages * page_size * 64
        self.step_s = step_s
        self.slow_prefill = 2.0
        self.pins: dict[tuple[str, tuple[int, ...]], float | None] = {}
        self.steps = 0
        self.submitted: list[Request] = []
        self.finished: dict[str, FinishReason] = {}  # request id -> how it ended (what the server made happen)
        self.flushed: list[str | None] = []  # the namespace of every flush_cache call
        self._seen: dict[str, list[list[int]]] = {}  # namespace -> sequences "cached"
        self._seqs: dict[str, _Seq] = {}
        self._lock = threading.Condition()
        self._draining = False
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- API ---------------------------------------------------------------------------------------------------
    def submit(self, request: Request, on_output: Callable[[RequestOutput], None]) -> None:
        check_engine_request(request, self)  # as Engine.submit: the engine's own rules, before anything is queued
        with self._lock:
            if self._draining or self._stopped:
                raise RuntimeError("the engine is shutting down")
            if request.request_id in self._seqs:
                raise DuplicateRequestError(f"duplicate request id {request.request_id!r}")
            cached = min(self._cached_length(request.prompt_ids, request.namespace), len(request.prompt_ids) - 1)
            self.submitted.append(request)
            self._seqs[request.request_id] = _Seq(request, on_output, cached)
            self._lock.notify_all()

    def _cached_length(self, token_ids: list[int], namespace: str) -> int:
        """The longest prefix of token_ids that a finished sequence of `namespace` shares (call with the lock held)."""
        longest = 0
        for seq in self._seen.get(namespace, []):
            n = 0
            for a, b in zip(seq, token_ids, strict=False):
                if a != b:
                    break
                n += 1
            longest = max(longest, n)
        return longest

    def abort(self, request_id: str) -> bool:
        with self._lock:
            seq = self._seqs.get(request_id)
            if seq is None or seq.aborted:
                return False
            seq.aborted = True
            self._lock.notify_all()
            return True

    def stats(self, namespace: str | None = None) -> SimpleNamespace:
        """The whole fake's figures, or (namespace) that tenant's: its requests and pins; capacity is shared."""

        def mine(ns: str) -> bool:
            return namespace is None or ns == namespace

        with self._lock:
            running = sum(mine(s.request.namespace) for s in self._seqs.values())
            cache = SimpleNamespace(
                pages_total=self.num_pages,
                pages_free=self.num_pages - len(self._seqs),
                pages_cached=0,
                pages_evictable=0,
                pages_pinned=sum(mine(ns) for ns, _ in self.pins),
                pages_in_use=running,
                queried_tokens=sum(len(r.prompt_ids) for r in self.submitted if mine(r.namespace)),
                hit_tokens=0,
                evicted_pages=0,
                live_leases=running,
            )
            return SimpleNamespace(running=running, waiting=0, preemptions=0, steps=self.steps, cache=cache)

    def flush_cache(self, namespace: str | None = None) -> int:
        with self._lock:
            self.flushed.append(namespace)
            names = list(self._seen) if namespace is None else [namespace]
            return sum(len(self._seen.pop(n, [])) for n in names)

    def pin(self, token_ids: list[int], namespace: str = "", ttl_s: float | None = None) -> int:
        with self._lock:
            if not any(s[: len(token_ids)] == list(token_ids) for s in self._seen.get(namespace, [])):
                return 0
            self.pins[(namespace, tuple(token_ids))] = ttl_s
            return len(token_ids) // self.page_size * self.page_size

    def explain(self, token_ids: list[int], namespace: str = "") -> Explanation:
        """The fake caches nothing: every prompt explains as nothing shared."""
        return off_explanation(token_ids, self.page_size, NO_SHARED_PREFIX)

    def unpin(self, token_ids: list[int], namespace: str = "") -> int:
        with self._lock:
            if self.pins.pop((namespace, tuple(token_ids)), "absent") == "absent":
                return 0
            return len(token_ids) // self.page_size * self.page_size

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._draining = True
            while drain and self._seqs:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._lock.wait(left)
            for seq in self._seqs.values():
                seq.aborted = True
            self._stopped = True
            self._lock.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    # -- loop ----------------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._seqs and not self._stopped:
                    self._lock.wait()
                if self._stopped and not self._seqs:
                    return
                seqs = list(self._seqs.values())
                self.steps += 1
            for seq in seqs:
                self._step(seq)
            time.sleep(self.step_s)

    def _emit(
        self,
        seq: _Seq,
        ids: list[int],
        reason: FinishReason | None,
        error: str | None = None,
        kind: ErrorKind = ErrorKind.INTERNAL,
    ) -> None:
        r = seq.request
        now = time.monotonic()
        ttft = None
        if ids and seq.first_at is None:
            seq.first_at = now
            ttft = now - seq.started
        tpot = None
        if reason is not None:
            tpot = (now - (seq.first_at or now)) / max(1, len(seq.generated))
            with self._lock:
                del self._seqs[r.request_id]
                self.finished[r.request_id] = reason
                if reason is not FinishReason.ERROR:
                    self._seen.setdefault(r.namespace, []).append(list(r.prompt_ids) + seq.generated)
                self._lock.notify_all()
        out = RequestOutput(
            request_id=r.request_id,
            token_ids=ids,
            text=self.tokenizer.decode(ids),
            prompt_tokens=len(r.prompt_ids),
            cached_tokens=seq.cached,
            completion_tokens=len(seq.generated),
            finish_reason=reason,
            error=error,
            error_kind=kind if error else None,
            time_to_first_token=ttft,
            time_per_output_token=tpot,
        )
        seq.on_output(out)

    def _step(self, seq: _Seq) -> None:
        r = seq.request
        if seq.aborted:
            return self._emit(seq, [], FinishReason.ABORTED)
        if not seq.generated and SLOW_PREFILL.encode() in bytes(i - OFFSET for i in r.prompt_ids if i >= OFFSET):
            if time.monotonic() - seq.started < self.slow_prefill:
                return None  # still "prefilling"
        prompt = bytes(i - OFFSET for i in r.prompt_ids if i >= OFFSET)
        tool = re.search(rb'<tools>\[\{"type": "function", "function": \{"name": "([^"]+)"', prompt)
        if tool is not None:
            reply = b'<tool_call>{"name": "%s", "arguments": {"city": "Paris"}}</tool_call>' % tool.group(1)
            if len(seq.generated) == len(reply):
                seq.generated.append(EOS)
                return self._emit(seq, [EOS], FinishReason.STOP_TOKEN)
            token = reply[len(seq.generated)] + OFFSET
        else:
            token = ord("a") + len(seq.generated) % 26 + OFFSET
        seq.generated.append(token)
        if FAILS_AFTER_ONE_TOKEN.encode() in prompt:
            return self._emit(seq, [token], FinishReason.ERROR, "injected failure")
        if NO_CAPACITY.encode() in prompt:
            return self._emit(
                seq, [], FinishReason.ERROR, "the KV cache cannot hold this request", ErrorKind.NO_CAPACITY
            )
        if token in r.sampling.stop_token_ids:
            return self._emit(seq, [token], FinishReason.STOP_TOKEN)
        done = len(seq.generated) >= r.sampling.max_tokens
        return self._emit(seq, [token], FinishReason.LENGTH if done else None)
