"""Stored responses of the Responses API (`store: true`, OpenAI's default): what `previous_response_id`, GET and
DELETE /v1/responses/{id} read. Per tenant, and bounded: at most `max_responses` and `max_bytes` per tenant, each
for `ttl_s` seconds; past a bound the oldest go first. A tenant never reads, continues or deletes another's.

A stored response keeps the exact token ids of its conversation (the prompt it was computed from, then what it
generated) with the text they stand for, so a follow-up continues from those tokens (responses_api.py), and the
conversation as chat messages, so the follow-up's new items can be rendered after it. What the ids computed is
pinned in the KV cache for a while (the pin budget, --max-pinned, bounds it), not by the store: pins expire on
their own and are shared by path, so deleting a response leaves them to their TTL.

On the event loop only (no lock): every call is microseconds.
"""

from __future__ import annotations

import json
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_RESPONSES = 1000  # per tenant
DEFAULT_MAX_BYTES = 64 << 20  # per tenant
DEFAULT_TTL_S = 3600.0
DEFAULT_PIN_TTL_S = 600.0


@dataclass
class StoredResponse:
    id: str
    body: dict[str, Any]  # the response object, as GET returns it
    token_ids: array  # array("i"): the prompt, then everything generated (a final stop token included)
    text: str  # what token_ids stand for: the rendered prompt, then the generated text with special tokens
    generated_text_without_last: str  # the same text less the last generated token's (a stop token's) text
    conversation: list[dict[str, Any]]  # the chat messages after the instructions, the reply included
    instructions: str | None
    expires_at: float = 0.0
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = (
            4 * len(self.token_ids)
            + len(self.text.encode("utf-8")) * 2
            + len(json.dumps(self.body))
            + len(json.dumps(self.conversation))
            + 512
        )

    def prefixes(self) -> list[tuple[list[int], str]]:
        """(ids, the text they stand for) a follow-up may continue from: all of them, then all but the last
        generated token (a stop token the template writes otherwise, e.g. an EOS where it writes an end-of-turn)."""
        ids = list(self.token_ids)
        return [(ids, self.text), (ids[:-1], self.generated_text_without_last)]


class ResponseStore:
    def __init__(
        self,
        *,
        max_responses: int = DEFAULT_MAX_RESPONSES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        ttl_s: float = DEFAULT_TTL_S,
        pin_ttl_s: float = DEFAULT_PIN_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_responses, self.max_bytes, self.ttl_s, self.pin_ttl_s = max_responses, max_bytes, ttl_s, pin_ttl_s
        self.clock = clock
        self._tenants: dict[str, OrderedDict[str, StoredResponse]] = {}  # oldest first (= soonest to expire)
        self._bytes: dict[str, int] = {}

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0 and self.max_bytes > 0 and self.ttl_s > 0

    def put(self, tenant: str, response: StoredResponse) -> bool:
        """Store (replacing one of the same id); False if it is larger than a tenant's whole budget."""
        if not self.enabled or response.size > self.max_bytes:
            return False
        self._expire(tenant)
        responses = self._tenants.setdefault(tenant, OrderedDict())
        self._drop(tenant, response.id)
        response.expires_at = self.clock() + self.ttl_s
        responses[response.id] = response
        self._bytes[tenant] = self._bytes.get(tenant, 0) + response.size
        while len(responses) > self.max_responses or self._bytes[tenant] > self.max_bytes:
            self._drop(tenant, next(iter(responses)))
        return True

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        self._expire(tenant)
        return self._tenants.get(tenant, {}).get(response_id)

    def delete(self, tenant: str, response_id: str) -> bool:
        self._expire(tenant)
        return self._drop(tenant, response_id)

    def __len__(self) -> int:
        return sum(len(r) for r in self._tenants.values())

    def bytes(self, tenant: str) -> int:
        return self._bytes.get(tenant, 0)

    def _drop(self, tenant: str, response_id: str) -> bool:
        responses = self._tenants.get(tenant)
        gone = responses.pop(response_id, None) if responses is not None else None
        if gone is None:
            return False
        self._bytes[tenant] -= gone.size
        if not responses:
            del self._tenants[tenant], self._bytes[tenant]
        return True

    def _expire(self, tenant: str) -> None:
        responses = self._tenants.get(tenant)
        now = self.clock()
        while responses and next(iter(responses.values())).expires_at <= now:
            self._drop(tenant, next(iter(responses)))
            responses = self._tenants.get(tenant)
