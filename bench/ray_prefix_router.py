"""Ray Serve LLM's PrefixCacheAffinityRouter over radixcache's `Request`, for bench/cluster_bench.py (not shipped).

Ray's router matches prompt *text* (a `prompt` or `messages` attribute) in its own tree of routed prompts; ours
sends token ids. This adapter gives it one character per token id, so its character match is our token match. It
sees no namespace: Ray's router has no notion of tenants, which is part of what the benchmark compares. Everything
else (its thresholds, its tree actor, power-of-two fallback) is Ray's, unchanged and at its defaults.
"""

from __future__ import annotations

# The class ray.serve.llm.request_router.PrefixCacheAffinityRouter re-exports (importing it from there needs pyarrow,
# Ray's llm extra, which a radixcache cluster does not).
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter

from radixcache.worker.engine.request import Request

CODE_POINT_BASE = 0x4E00  # token id i -> chr(base + i): printable, one code point each for ids below ~20,000


class TokenPrefixCacheAffinityRouter(PrefixCacheAffinityRouter):
    def _extract_text_from_request(self, pending_request) -> str:  # noqa: ANN001 - Ray's signature
        request = pending_request.args[0] if pending_request.args else None
        if isinstance(request, Request):
            return "".join(chr(CODE_POINT_BASE + t) for t in request.prompt_ids)
        return super()._extract_text_from_request(pending_request)
