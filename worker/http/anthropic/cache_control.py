"""cache_control breakpoints as pins: the prefix each breakpoint marks stays cached for its TTL (5 minutes or an
hour, renewed by each request that marks it again) inside the worker's pin budget, so the next turn of an agent
reads it even when other tenants' work evicts.

Which tokens a breakpoint marks: its cut conversation (requests.Breakpoint.prompt: the conversation up to and
including the marked block) is rendered and tokenized as the request's own prompt is (the chat template, the
tenant's remembered replies), and the breakpoint's prefix is what those ids share with the request's prompt ids.
That is the prompt up to the end of the marked block, wherever the template writes it, and always a prefix of what
the request computes. This runs in a worker thread while the request is computed; the pins are set when it has
finished (its pages are in the tree then, and no longer promised to it: a pin never takes pages a running request
was promised, so pinning during the request could fail where pinning after it succeeds), before its usage is sent.

Never fails the request: a breakpoint past the pin budget, or one the template cannot render on its own, is not
pinned (logged); its tokens then count as input_tokens, not cache_creation_input_tokens. Usage, as Anthropic counts
it: cache_read_input_tokens = what the cache served (any cached prefix, at a breakpoint or not);
cache_creation_input_tokens = the tokens pinned under a breakpoint that were computed now; input_tokens = the rest.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from radixcache.worker.front.core import FrontCore, Refusal
from radixcache.worker.front.validation import PromptInput
from radixcache.worker.http.anthropic.protocol import CacheCreation
from radixcache.worker.http.anthropic.requests import Breakpoint

log = logging.getLogger("radixcache.anthropic")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class BreakpointPins:
    """The pins of one request's breakpoints. Made right after the request is admitted (its prompt ids known);
    `creation(cached_tokens)` once it has finished pins them; `cancel()` if it is abandoned. Without breakpoints, or
    on a worker that caches nothing or pins nothing (--no-cache, --max-pinned 0), it does nothing."""

    def __init__(self, core: FrontCore, tenant: str, breakpoints: Sequence[Breakpoint], prompt_ids: Sequence[int]):
        self.core, self.tenant, self.prompt_ids = core, tenant, prompt_ids
        self._finished = asyncio.Event()
        self.pinned: list[tuple[Breakpoint, int]] = []  # (breakpoint, tokens pinned), longest prefix last
        pinning = breakpoints and core.facts.cache_enabled and core.facts.max_pinned_pages > 0
        self._task = asyncio.ensure_future(self._run(list(breakpoints))) if pinning else None

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _prefix(self, breakpoint: Breakpoint) -> int:
        """How many of the prompt's tokens the breakpoint marks (0 if its cut conversation cannot be rendered)."""
        try:
            ids, _ = await self.core.tokenize(breakpoint.prompt, tenant=self.tenant)
        except Refusal as r:
            log.info("cache_control on %s: not pinned, the cut conversation does not render (%s)", breakpoint.where, r)
            return 0
        return await asyncio.to_thread(common_prefix, ids, self.prompt_ids)

    async def _run(self, breakpoints: list[Breakpoint]) -> None:
        try:
            await self._pin(breakpoints)
        except Exception:  # a bug here must not fail the request: it is served, and this is logged
            log.exception("cache_control: pinning the breakpoints failed")

    async def _pin(self, breakpoints: list[Breakpoint]) -> None:
        lengths = [await self._prefix(b) for b in breakpoints]
        await self._finished.wait()
        for breakpoint, length in sorted(zip(breakpoints, lengths, strict=True), key=lambda bl: bl[1]):
            if length == 0:
                continue
            prefix = PromptInput(token_ids=list(self.prompt_ids[:length]))
            try:
                pinned, _ = await self.core.pin(self.tenant, prefix, breakpoint.ttl_s)
            except Refusal as r:  # past the pin budget (or the worker is stopping): served, not pinned
                log.info("cache_control on %s: not pinned (%s): %s", breakpoint.where, r.kind.value, r.message)
                continue
            self.pinned.append((breakpoint, pinned))

    async def creation(self, cached_tokens: int) -> CacheCreation:
        """Pin (the request has finished); the tokens each TTL newly holds: of each pinned prefix, those past what
        the cache served and past the shorter pinned prefixes."""
        if self._task is not None:
            self._finished.set()
            try:
                await self._task
            except asyncio.CancelledError:
                if not self._task.cancelled():  # this request itself was cancelled, not its pins
                    raise
        created = CacheCreation()
        covered = cached_tokens
        for breakpoint, pinned in self.pinned:
            new = max(0, pinned - covered)
            covered = max(covered, pinned)
            if breakpoint.ttl == "1h":
                created.ephemeral_1h_input_tokens += new
            else:
                created.ephemeral_5m_input_tokens += new
        return created
